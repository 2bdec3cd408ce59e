"""Tiny shardkit demo, run by ``./scripts/demo.sh`` under torchrun (4 CPU processes, Gloo).

Every rank builds the same ``single_split`` spec over the world and computes the layout of
a (10, 4) tensor with ``build_metadata``: pure metadata, identical on every rank, no
communication. Ranks then print in order.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import sharding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, nargs="+", default=[10, 4], help="global tensor size")
    parser.add_argument("--dim", type=int, default=0, help="dimension to split")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        spec = sharding.single_split(args.dim, [f"rank:{r}/cpu" for r in range(world_size)])
        layout = spec.build_metadata(tuple(args.size), torch.float32)
        for turn in range(world_size):
            if turn == rank:
                mine = [f"offsets={s.offsets} dims={s.dims}" for _, s in layout.shards_on(rank)]
                print(f"rank {rank}/{world_size} (pid {os.getpid()}): holds {', '.join(mine) or 'nothing'}",
                      flush=True)
                if rank == 0:
                    print(f"  full layout of size {tuple(layout.size)}:", flush=True)
                    for i, s in enumerate(layout.shards):
                        print(f"    shard {i}: {s.device} offsets={s.offsets} dims={s.dims}", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
