"""Which modules of a sharded model are zones, decided at shard time. Pure; nothing here runs at compute time.

A *zone* is the smallest module holding a producer (a layer split on its output features:
q/k/v, gate/up) and a consumer (a layer split on its input features: o_proj, down_proj) split
the same way (``LlamaAttention``, ``LlamaMLP``, ``BertAttention``, an ``nn.Sequential`` MLP): its
forward runs under the engine (``engine.zone``), so the activations between the two stay
split through the model's own code. A split that cuts a head is refused here, for modules
that declare a head size (``head_dim``, ``attention_head_size``, ``head_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from sharding import layout

__all__ = ["Endpoint", "find_zones", "check_head_boundaries"]


@dataclass(frozen=True)
class Endpoint:
    """A sharded layer seen from the zones: its module name, role and the split of that activation.

    ``split`` is along the activation's last dimension, given as dimension 0: a producer's
    output may be packed (a fused projection's heads of q, k and v), a consumer's input is one
    slice per rank.
    """

    name: str
    role: Literal["produces", "consumes"]
    split: layout.Split | layout.Packed

    def slices(self) -> list[tuple[int, int]]:
        if isinstance(self.split, layout.Packed):
            return [p for slices in self.split.pieces for p in slices]
        return list(self.split.intervals)


def _matches(producer: Endpoint, consumer: Endpoint) -> bool:
    """Whether the producer's split output is what the consumer takes, directly or once unpacked
    (each of the packed blocks split as the consumer's input: ``qkv.split(...)`` then gives it)."""
    assert isinstance(consumer.split, layout.Split)
    given = producer.split
    if isinstance(given, layout.Packed):
        strided = given.strided()
        return strided is not None and strided.intervals == consumer.split.intervals
    return given.intervals == consumer.split.intervals


def _ancestor(a: str, b: str) -> str:
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    common: list[str] = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def find_zones(endpoints: Sequence[Endpoint]) -> list[str]:
    """Names of the modules whose forward runs on split activations: for every consumer and a
    producer split the same way, their closest common ancestor. Pure."""
    producers = [e for e in endpoints if e.role == "produces"]
    roots: dict[str, None] = {}
    for consumer in (e for e in endpoints if e.role == "consumes"):
        if any(length == 0 for _, length in consumer.slices()):
            continue  # a rank without a slice would take other code paths than its peers
        for producer in producers:
            if _matches(producer, consumer):
                root = _ancestor(producer.name, consumer.name)
                if root not in (producer.name, consumer.name):
                    roots.setdefault(root)
    return list(roots)


_HEAD_ATTRS = ("head_dim", "attention_head_size", "head_size")


def check_head_boundaries(root_name: str, root: torch.nn.Module, endpoints: Sequence[Endpoint]) -> None:
    """Refuse splits of attention projections that cut a head.

    Every module under ``root`` that declares a head size (``head_dim``, ``attention_head_size``
    or ``head_size``) must have each sharded projection below it split on multiples of it.
    """
    for mod_name, module in root.named_modules():
        size = next((getattr(module, a) for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
        if not size:
            continue
        full = f"{root_name}.{mod_name}".strip(".") if mod_name else root_name
        for e in endpoints:
            if full and not e.name.startswith(full + "."):
                continue
            bad = [(s, n) for s, n in e.slices() if s % size or n % size]
            if bad:
                msg = (f"module {e.name!r} is split as {e.slices()} ((start, length) per rank) inside "
                       f"{full or 'the root module'!r} ({type(module).__name__}), whose head size is {size}; "
                       f"split attention projections on head boundaries (multiples of {size}), e.g. an even "
                       f"split when the number of heads is divisible by the number of ranks.")
                raise ValueError(msg)
