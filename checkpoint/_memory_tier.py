"""The memory tier of ``CheckpointManager``: each step in shared memory, replicated to peers, recovered cheaply.

**Saving** (``MemoryTier.save``, every ``memory_every`` steps). On the training thread: plan the
save as ``checkpoint.save`` does (one writer per region), then copy this rank's regions into
a file in shared memory laid out as the rank's data file of a storage checkpoint (a
safetensors file; ``_memory_folder``). That copy is the only work training waits for. A
background thread (one step in flight, like ``async_save``) then:

1. checksums the regions (1 MiB chunks) and tells every rank what it staged (one all-gather):
   the reports every rank needs to assemble the step's metadata, the same ``shardkit.json`` a
   storage save of that step would commit;
2. sends the part to the ranks that hold its replicas, on other hosts (``_memory_plan``), and
   receives the parts it holds for others: straight from and into the mapped files;
3. commits: moves its parts into ``step-<step>/`` and writes the metadata last. A step whose
   replication did not finish (a peer died) is not committed by the ranks it involves;
4. persists to storage when the step is due there, from the same staged bytes
   (``_save.run_plan``, then the manager's retention), and reclaims older memory steps.

A rank whose memory is full skips the step in memory (logged; training goes on): a step is
only ever recovered from memory when every part is there.

**Recovering** (``MemoryTier.load``): every rank lists what its host's folder holds, rank 0
adds the steps committed in storage, and all apply ``choose_step`` to the same reports. From
memory, each rank then builds a checkpoint folder of its own for the chosen step, in memory:
hard links to the parts its host holds, and sparse files into which the byte ranges it needs
of the other parts are received from ranks that hold them (one exchange over the process
group). ``checkpoint.load`` then reads that folder like any checkpoint: the same planner (any
layout, any world size), every chunk checksum verified. A copy found corrupt is removed and
the choice made again, so a load falls back to another copy, an older step or storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import mmap
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fsspec.implementations.local import LocalFileSystem

from _shardkit import comm as _comm
from sharded_tensor import ShardedTensor

from ._async import AsyncSaveHandle
from ._chunks import CHUNK_BYTES, ChunkedChecksum, encode_chunks
from ._codec import build_safetensors_header, tensor_bytes
from ._dtensor import dtensor_views
from ._files import _plan_block, _span
from ._load import _targets
from ._load import load as _load
from ._memory_folder import (
    Held,
    RankFolder,
    default_memory_dir,
    host_identity,
    job_folder,
    reclaim_lives,
    remove_job,
    remove_steps,
    scan,
)
from ._memory_plan import Choice, choose_step, merge_ranges, part_ranks, replica_targets
from ._reader import DataReader, covering
from ._regions import region_key
from ._save import _assemble, _Plan, _plan, _reduce_partials, _Region, data_file_about, region_keys
from ._schema import CHECKSUM_ALGORITHM, METADATA_FILE, CheckpointError, CheckpointMetadata, parse_metadata
from ._source import Block
from ._storage import data_file_name
from ._walk import flatten_state_dict

__all__ = ["LoadReport", "MemoryTier"]

_log = logging.getLogger("checkpoint")

_test_hook: Callable[[str, int], None] | None = None
"""Private, for tests: called as ``(phase, step)`` on the thread doing it, at "staged" (the
copy is done), "replicating" (every rank is about to send and receive replicas) and "committed"
(this rank's parts and metadata are in place)."""


def _hook(phase: str, step: int) -> None:
    if _test_hook is not None:
        _test_hook(phase, step)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Where ``CheckpointManager.load`` found the step it loaded, on this rank (``manager.last_load``).

    Attributes:
        step: the step loaded.
        tier: ``"memory"`` or ``"storage"``.
        local_bytes: bytes read from shared memory on this host (own parts, or replicas kept here).
        peer_bytes: bytes received from other ranks' memory over the process group.
        storage_bytes: bytes of the state_dict's tensors filled from storage.
        seconds: time this rank spent in the load: choosing the step, transfers and filling.
        reason: why storage was read while the memory tier is on (empty otherwise).
    """

    step: int
    tier: Literal["memory", "storage"]
    local_bytes: int
    peer_bytes: int
    storage_bytes: int
    seconds: float
    reason: str = ""


@dataclass(slots=True)
class _Part:
    """This rank's part of one step: its data file's name, header and where each region goes."""

    name: str
    generation: str
    prefix: bytes
    ranges: list[tuple[int, int]]  # each region's [start, end) in the file, in plan order
    keys: list[str]
    defaults: list[str]
    size: int


_ALIGN = 64
"""Where a part's data starts, and so every region whose size is a multiple of it: a copy into a
destination off a cache line's start runs 10-20% slower, and training waits for that copy."""


def _layout(mine: list[_Region], plan: _Plan, generation: str, rank: int) -> _Part:
    """The part's safetensors layout, each region copied into as a typed view.

    The data starts at a multiple of ``_ALIGN``. Regions whose sizes are multiples of it come
    first, so each starts there too; the rest follow by decreasing element size, so each
    starts at a multiple of its own.
    """
    keys = region_keys(mine, plan)

    def place(i: int) -> tuple[bool, int]:
        itemsize = plan.tensors[mine[i].name][1].itemsize
        return math.prod(mine[i].box[1]) * itemsize % _ALIGN != 0, -itemsize

    order = sorted(range(len(mine)), key=place)
    entries = [(keys[i], plan.tensors[mine[i].name][1], mine[i].box[1]) for i in order]
    prefix, placed = build_safetensors_header(entries, data_file_about(mine, keys, plan, generation, rank),
                                              align=_ALIGN)
    ranges: list[tuple[int, int]] = [(0, 0)] * len(mine)
    for j, i in enumerate(order):
        ranges[i] = placed[j]
    defaults = [region_key(r.name, r.box[0], r.box[1], plan.tensors[r.name][0]) for r in mine]
    return _Part(data_file_name(generation, rank), generation, prefix, ranges, keys, defaults,
                 max((b for _, b in ranges), default=len(prefix)))


def _copy_into(buffer: torch.Tensor, part: _Part, mine: list[_Region], plan: _Plan) -> None:
    """Copy the header and every region into ``buffer``; each region's tensor becomes its view there."""
    buffer[:len(part.prefix)].copy_(torch.frombuffer(bytearray(part.prefix), dtype=torch.uint8))
    with torch.no_grad():
        for region, (a, b) in zip(mine, part.ranges):
            assert region.tensor is not None
            view = buffer[a:b].view(plan.tensors[region.name][1]).view(region.box[1])
            view.copy_(region.tensor.detach())
            region.tensor = view


def _part_report(buffer: torch.Tensor, part: _Part) -> dict[str, Any]:
    """What ``_save._assemble`` needs of a rank's data file: size, region starts, chunk checksums, keys."""
    digests = []
    for a, b in part.ranges:
        digest = ChunkedChecksum(CHUNK_BYTES)
        digest.update(tensor_bytes(buffer[a:b]))
        digests.append(digest)
    return {"file": part.name, "bytes": part.size, "start": [a for a, _ in part.ranges], "chunk_bytes": CHUNK_BYTES,
            CHECKSUM_ALGORITHM: "".join(encode_chunks(d.values()) for d in digests),
            "keys": {str(i): k for i, (k, d) in enumerate(zip(part.keys, part.defaults)) if k != d}}


def _node() -> str:
    """This process's host as the launcher names it (torchrun's node rank), else its host name."""
    group_rank = os.environ.get("GROUP_RANK", "").strip()
    if group_rank:
        return f"node {group_rank}"
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local.isdigit() and int(local) > 0:
        return f"node {_comm.rank_and_world()[0] // int(local)}"
    return socket.gethostname()


def _map_copy(path: str) -> torch.Tensor:
    """The bytes of local file ``path`` as a uint8 tensor, mapped privately (nothing is copied until written)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    finally:
        os.close(fd)


def _sparse(path: str, size: int) -> torch.Tensor:
    """A new file of ``size`` bytes with no pages yet, mapped shared and writable (ranges are received into it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), dtype=torch.uint8)
    finally:
        os.close(fd)


def _verify_part(path: str, file: str, metadata: CheckpointMetadata) -> bool:
    """Whether the copy of data file ``file`` at ``path`` holds what its metadata records (size, header, checksums)."""
    regions = [(name, shard, entry.dtype) for name, entry in metadata.tensors.items()
               for shard in entry.shards if shard.file == file]
    reader = DataReader(LocalFileSystem())
    scratch = memoryview(bytearray(4 << 20))
    try:
        reader.check_data_file(path, metadata.files[file], regions)
        for name, shard, _ in regions:
            for _ in reader.region_pieces(path, shard, scratch, tensor=name):
                pass
    except (CheckpointError, OSError):
        return False
    finally:
        reader.close()
    return True


class MemoryTier:
    """The memory tier of one manager: created with it, set up by the first collective call.

    Args:
        root_url: the manager's root (names the memory folder, so a restarted job finds it).
        every: stage every step divisible by this.
        replicas: copies of each rank's part kept by ranks on other hosts.
        keep_last: committed memory steps each rank keeps (one more is being staged).
        memory_dir: where the files live (``None``: ``$SHARDKIT_MEMORY_DIR``, else ``/dev/shm``).
        group: the manager's process group.
        timeout: the manager's timeout.
    """

    def __init__(self, root_url: str, *, every: int, replicas: int, keep_last: int, memory_dir: str | None,
                 group: _comm.ProcessGroup, timeout: float | None) -> None:
        self.root_url, self.every, self.replicas, self.keep_last = root_url, every, replicas, keep_last
        self.memory_dir = os.fspath(memory_dir) if memory_dir is not None else None
        self.group, self.timeout = group, timeout
        self._ready = False
        self._handle: AsyncSaveHandle | None = None
        self._full = False  # this rank's memory was full at its last step (logged once)
        self._committed_any = False

    # -- set-up -------------------------------------------------------------------------------

    def _setup(self) -> None:
        """Collective, once: every rank's host, the life id, where replicas go, the background group."""
        if self._ready:
            return
        rank, world = _comm.rank_and_world(self.group)
        self.memory_dir = self.memory_dir or default_memory_dir()
        self.job = job_folder(self.memory_dir, self.root_url)
        self.host = host_identity(self.job, self.root_url)
        mine = {"host": self.host, "node": _node(), "life": secrets.token_hex(4)}
        everyone = _comm.all_gather_json(mine, self.group, timeout=self.timeout,
                                         what="CheckpointManager (setting up the memory tier)")
        self.life = str(everyone[0]["life"])
        self.hosts = [str(e["host"]) for e in everyone]
        domains = [f"{e['node']}|{e['host']}" for e in everyone]
        self.targets = replica_targets(domains, self.replicas)
        self.sources = [s for s in range(world) if rank in self.targets[s]]
        self.leader = self.hosts.index(self.host) == rank  # the first rank of this host tidies its folder
        if rank == 0 and self.replicas and world > 1 and len(set(domains)) == 1:
            _log.info("memory tier: all %d ranks share one host and memory folder (%s), so no replica is kept: "
                      "a lost host falls back to storage", world, self.job)
        self.folder = RankFolder(self.job, self.life, rank, spares=1 + len(self.sources))
        self.side = _comm.new_group(self.group, timeout=self.timeout)
        self._ready = True

    # -- saving ---------------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for the step in flight; raise its error (once)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.result()

    def save(self, step: int, state_dict: Mapping[str, Any], *,
             persist: Callable[[_Plan, _comm.ProcessGroup], None] | None,
             reduce_partial: bool = False) -> AsyncSaveHandle:
        """Stage ``state_dict`` as ``step`` in memory and start the background work; return its handle. Collective.

        ``persist(plan, group)``, when given, writes the step to storage from the staged bytes
        (on the background thread, after the memory commit).
        """
        called = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        self._setup()
        rank, world = _comm.rank_and_world(self.group)
        handle = AsyncSaveHandle(f"memory step {step} under {self.job}")
        problem: Exception | None = None
        plan = _Plan()
        try:
            views, _ = dtensor_views(state_dict, self.group)
            plan = _plan(views, rank, world, _reduce_partials(views, reduce_partial))
            plan.values = json.loads(json.dumps(plan.values))  # a snapshot of lists and dicts too
        except Exception as exc:  # reported to every rank's background work, so none waits for this one
            problem = exc
        generation = f"{self.life}{step:x}"
        mine = [r for r in plan.regions if r.writer == rank and r.tensor is not None]
        part = _layout(mine, plan, generation, rank)
        planned = time.perf_counter()
        buffer: torch.Tensor | None = None
        why = ""
        if problem is None and mine:
            try:
                buffer = self.folder.staging("own", part.size).tensor
            except OSError as exc:
                why = f"{type(exc).__name__}: {exc}"
                if persist is not None:  # storage still gets the step: staged in process memory instead
                    buffer = torch.empty(part.size, dtype=torch.uint8)
            if buffer is not None:
                try:
                    _copy_into(buffer, part, mine, plan)
                except Exception as exc:  # reported to every rank's background work, then raised here
                    self.folder.release("own")
                    problem, buffer, why = exc, None, ""
        staged = time.perf_counter()
        in_memory = problem is None and not why
        work = threading.Thread(target=self._background, name="shardkit-memory-tier", daemon=False,
                                args=(step, plan, part, buffer, in_memory, why, problem, persist, handle))
        self._handle = handle
        work.start()
        handle._blocked_parts = {"wait_previous": waited - called, "plan": planned - waited,
                                 "stage": staged - planned}
        if problem is not None:
            handle._reported = True  # raised here; wait() must not raise it again
            raise problem
        return handle

    def _background(self, step: int, plan: _Plan, part: _Part, buffer: torch.Tensor | None, in_memory: bool,
                    why: str, problem: Exception | None, persist: Callable[[_Plan, _comm.ProcessGroup], None] | None,
                    handle: AsyncSaveHandle) -> None:
        try:
            with _comm.operation("CheckpointManager.save (memory tier)", self.timeout):
                outcome = self._commit(step, plan, part, buffer, in_memory, why, problem)
                if outcome == "committed":
                    # Every rank committed this step: older ones may go.
                    self.folder.reclaim(self.keep_last)
                    if not self._committed_any and self.leader:
                        # The first step of this life is in memory everywhere: what earlier lives left goes.
                        reclaim_lives(self.job, keep={self.folder.name})
                    self._committed_any = True
                if persist is not None and outcome != "failed":
                    persist(plan, self.side)
        except BaseException as exc:  # raised by the next save or wait
            handle._error = exc
        finally:
            self.folder.release("own")  # a part not committed (the step skipped or failed)
            for source in self.sources:
                self.folder.release(f"r{source:05d}")
            handle._finished_at = time.perf_counter()
            handle._finished.set()

    def _commit(self, step: int, plan: _Plan, part: _Part, buffer: torch.Tensor | None, in_memory: bool,
                why: str, problem: Exception | None) -> Literal["committed", "skipped", "failed"]:
        """Reports, replication and the commit of one step (background thread).

        ``"committed"``: every rank committed its parts of the step. ``"skipped"``: some rank could
        not stage it, so no rank keeps it in memory. ``"failed"``: this rank's planning failed
        (raised on the training thread). Any other failure, here or on another rank, raises.
        """
        rank, world = _comm.rank_and_world(self.group)
        what = f"CheckpointManager.save (memory tier, step {step})"
        report: dict[str, Any] = {"error": None if problem is None else f"{type(problem).__name__}: {problem}",
                                  "digest": hashlib.sha256(json.dumps(plan.signature).encode()).hexdigest(),
                                  "memory": in_memory, "why": why, "part": None}
        own: Exception | None = None
        # Every rank's copy first: a rank that checksummed its part while another still copied
        # would take memory bandwidth from that copy, which the training thread waits for.
        _comm.barrier(self.side, timeout=self.timeout, what=f"{what}: staged")
        if problem is None and buffer is not None:
            try:
                report["part"] = _part_report(buffer, part)
            except Exception as exc:  # reported to every rank below, so none is left waiting
                own, report["error"] = exc, f"{type(exc).__name__}: {exc}"
        _hook("staged", step)
        everyone = _comm.all_gather_json(report, self.side, timeout=self.timeout, what=f"{what}: reports")
        failed = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
        if failed:
            if problem is not None:
                return "failed"
            if own is not None:
                raise own
            msg = f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed) + "."
            raise CheckpointError(msg)
        if len({e["digest"] for e in everyone}) > 1:
            differ = [r for r, e in enumerate(everyone) if e["digest"] != everyone[0]["digest"]]
            msg = (f"{what}: every rank must save a state_dict of the same structure (names, kinds, sizes, "
                   f"dtypes and layouts), but rank{'s' if len(differ) > 1 else ''} "
                   f"{', '.join(map(str, differ))} differ{'' if len(differ) > 1 else 's'} from rank 0.")
            raise ValueError(msg)
        skipped = [(r, e["why"]) for r, e in enumerate(everyone) if not e["memory"]]
        self._note_full(step, dict(skipped).get(rank, ""))
        if skipped:
            if rank == 0:
                _log.warning("memory tier: step %d is not kept in memory: rank%s %s could not stage %s (%s); training "
                             "goes on", step, "s" if len(skipped) > 1 else "", ", ".join(str(r) for r, _ in skipped),
                             "their parts" if len(skipped) > 1 else "its part", skipped[0][1])
            return "skipped"
        reports = [e["part"] if e["part"] is not None else {"file": None, "bytes": 0} for e in everyone]
        _, text = _assemble(plan, reports, part.generation, world, f"{self.job} (memory step {step})")
        receiving = self._receive_slots(step, everyone)
        ready = _comm.all_gather_json(sorted(receiving), self.side, timeout=self.timeout,
                                      what=f"{what}: replication")

        def replicate_and_commit() -> None:
            sends = {t: buffer for t in self.targets[rank] if buffer is not None and rank in ready[t]}
            _hook("replicating", step)
            _comm.start_exchange(sends, receiving, self.side, timeout=self.timeout,
                                 what=f"{what}: replication").wait()
            parts = {part.name: "own"} if buffer is not None else {}
            parts.update({everyone[s]["part"]["file"]: f"r{s:05d}" for s in receiving})
            self.folder.commit(step, parts, text)
            _hook("committed", step)

        # Each rank learns that every other committed: only then may the step before go (a peer
        # killed during the exchange leaves this step incomplete, and the one before is needed).
        _comm.agree(f"{what}: commit", replicate_and_commit, self.side, timeout=self.timeout, error=CheckpointError)
        return "committed"

    def _receive_slots(self, step: int, everyone: list[dict[str, Any]]) -> dict[int, torch.Tensor]:
        """Files for the replicas this rank holds; a replica that does not fit is skipped (logged)."""
        slots = {}
        for source in self.sources:
            part = everyone[source]["part"]
            if part is None:
                continue
            try:
                slots[source] = self.folder.staging(f"r{source:05d}", int(part["bytes"])).tensor
            except OSError as exc:
                _log.warning("memory tier: rank %d cannot hold the replica of rank %d's part of step %d (%s); that "
                             "part has one copy fewer", _comm.rank_and_world(self.group)[0], source, step, exc)
        return slots

    def _note_full(self, step: int, why: str) -> None:
        if why and not self._full:
            _log.warning("memory tier: rank %d cannot stage step %d in %s: %s; steps are not kept in memory while "
                         "this lasts (they are still written to storage when due)",
                         _comm.rank_and_world(self.group)[0], step, self.folder.path, why)
        elif not why and self._full:
            _log.warning("memory tier: rank %d stages steps in memory again from step %d",
                         _comm.rank_and_world(self.group)[0], step)
        self._full = bool(why)

    # -- recovering ------------------------------------------------------------------------------

    def choose(self, step: int | None, storage_steps: Callable[[], list[int]]) -> tuple[Choice, dict[Any, Held]]:
        """The step a load reads, agreed by every rank from what each host holds. Collective."""
        self.wait()
        self._setup()
        rank, _ = _comm.rank_and_world(self.group)
        held = scan(self.job)

        def report() -> dict[str, Any]:
            return {"host": self.host, "held": [h.report() for h in held],
                    "storage": storage_steps() if rank == 0 else []}

        _, everyone = _comm.agree("CheckpointManager.load (choosing the step)", report, self.group,
                                  timeout=self.timeout, share=lambda r: r, error=CheckpointError)
        return choose_step(everyone, everyone[0]["storage"], step), {(h.step, h.generation): h for h in held}

    def load(self, state_dict: Mapping[str, Any], step: int | None, *, strict: bool,
             storage_steps: Callable[[], list[int]],
             load_storage: Callable[[Mapping[str, Any], int], int]) -> LoadReport:
        """Fill ``state_dict`` from the newest step complete in some tier (or ``step``). Collective."""
        started = time.perf_counter()
        rank, _ = _comm.rank_and_world(self.group)
        for _attempt in range(4):
            choice, held = self.choose(step, storage_steps)
            if choice.tier == "none":
                msg = f"nothing to load under {self.root_url!r}: {choice.reason}."
                raise CheckpointError(msg)
            assert choice.step is not None
            if choice.tier == "storage":
                if choice.reason and rank == 0:  # a fallback deserves a warning; a step asked for, a note
                    _log.log(logging.WARNING if step is None else logging.INFO,
                             "memory tier: %s; loading step %d from storage (%s)", choice.reason, choice.step,
                             self.root_url)
                nbytes = load_storage(state_dict, choice.step)
                self._forget(choice)
                return LoadReport(choice.step, "storage", 0, 0, nbytes, time.perf_counter() - started,
                                  choice.reason or "memory holds no step")
            try:
                local, peer = self._load_memory(state_dict, choice, held, strict)
            except CheckpointError:
                if self._quarantine(choice, held):
                    continue  # a corrupt copy was removed: choose again (another copy, step or storage)
                raise
            self._forget(choice)
            if rank == 0:
                _log.info("memory tier: loaded step %d from memory (%s)", choice.step, self.job)
            return LoadReport(choice.step, "memory", local, peer, 0, time.perf_counter() - started)
        msg = f"CheckpointManager.load under {self.root_url!r}: corrupt memory copies kept turning up; load a step."
        raise CheckpointError(msg)

    def _load_memory(self, state_dict: Mapping[str, Any], choice: Choice, held: dict[Any, Held],
                     strict: bool) -> tuple[int, int]:
        """Load ``choice`` from memory: links to local parts, peers' byte ranges received, then ``load``."""
        assert choice.step is not None
        rank, world = _comm.rank_and_world(self.group)
        mine = held.get((choice.step, choice.generation))
        folder = os.path.join(self.job, f".recover-{self.life}-r{rank:05d}")
        step = f"CheckpointManager.load (memory step {choice.step})"

        text = None
        if mine is not None:
            with contextlib.suppress(OSError, UnicodeDecodeError):  # unreadable: the planning below says so
                with open(mine.metadata, "rb") as f:
                    text = f.read().decode()
        if len(choice.metadata_ranks) < world:  # some host holds no copy of the metadata: one is sent
            text = _comm.broadcast_json(text if rank == choice.metadata_ranks[0] else None, choice.metadata_ranks[0],
                                        self.group, timeout=self.timeout, what=f"{step}: its metadata")
        local_bytes = 0

        def plan() -> list[list[Any]]:
            nonlocal local_bytes
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            if not isinstance(text, str):
                msg = f"{step}: its metadata could not be read from {mine.metadata if mine else 'another host'!r}."
                raise CheckpointError(msg)
            metadata = parse_metadata(text, source=os.path.join(folder, METADATA_FILE))
            with open(os.path.join(folder, METADATA_FILE), "w") as f:
                f.write(text)
            requests = []
            for file, ranges in _wanted(state_dict, metadata, self.group).items():
                part = part_ranks([file])
                (owner,) = part
                if mine is not None and owner in mine.have:
                    os.link(mine.have[owner], os.path.join(folder, file))
                    local_bytes += sum(b - a for a, b in ranges)
                else:
                    holders = choice.holders[owner]
                    requests.append([holders[(rank + owner) % len(holders)], file, metadata.files[file], ranges])
            return requests

        try:
            requests, everyone = _comm.agree(f"{step}: planning the reads", plan, self.group, timeout=self.timeout,
                                             share=lambda r: r, error=CheckpointError)
            peer_bytes = self._fetch(choice, mine, folder, requests, everyone)
            _load(state_dict, folder, process_group=self.group, strict=strict, timeout=self.timeout)  # type: ignore[arg-type]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return local_bytes, peer_bytes

    def _fetch(self, choice: Choice, mine: Held | None, folder: str, requests: list[list[Any]],
               everyone: list[list[list[Any]]]) -> int:
        """Send the ranges others asked this rank for; receive the ranges it asked for into sparse files."""
        rank, _ = _comm.rank_and_world(self.group)
        sources: dict[str, torch.Tensor] = {}
        sends: dict[int, list[torch.Tensor]] = {}
        for requester, asked in enumerate(everyone):
            for holder, file, _, ranges in asked:
                if holder != rank:
                    continue
                if file not in sources:
                    assert mine is not None
                    (owner,) = part_ranks([file])
                    sources[file] = _map_copy(mine.have[owner])
                sends.setdefault(requester, []).extend(sources[file][a:b] for a, b in ranges)
        recvs: dict[int, list[torch.Tensor]] = {}
        received = 0
        for holder, file, size, ranges in requests:
            target = _sparse(os.path.join(folder, file), int(size))
            recvs.setdefault(holder, []).extend(target[a:b] for a, b in ranges)
            received += sum(b - a for a, b in ranges)
        if sends or recvs:
            _comm.start_exchange(sends, recvs, self.side, timeout=self.timeout,
                                 what=f"CheckpointManager.load (memory step {choice.step}): fetching parts").wait()
        return received

    def _quarantine(self, choice: Choice, held: dict[Any, Held]) -> bool:
        """After a failed load from memory: remove copies of its parts that fail their checksums. Collective.

        Whether any rank removed one (else the failure was not the memory's and is raised as it is).
        """
        found = False
        mine = held.get((choice.step, choice.generation))
        if mine is not None and self.leader:
            try:
                with open(mine.metadata, "rb") as f:
                    metadata = parse_metadata(f.read(), source=mine.metadata)
            except (OSError, CheckpointError):
                metadata = None
            for owner, path in mine.have.items():
                file = os.path.basename(path)
                if metadata is None or not _verify_part(path, file, metadata):
                    _log.warning("memory tier: the copy %s of rank %d's part of step %d is corrupt; removed", path,
                                 owner, choice.step)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    found = True
        everyone = _comm.all_gather_json(found, self.group, timeout=self.timeout,
                                         what="CheckpointManager.load (checking memory copies)")
        return any(everyone)

    def _forget(self, choice: Choice) -> None:
        """After a load: steps of earlier lives newer than the one loaded are another history; they go."""
        if self.leader:
            remove_steps(self.job, lambda s, g: s > (choice.step or 0) or (s == choice.step
                                                                          and g != choice.generation
                                                                          and choice.tier == "memory"))

    # -- the end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """The clean finish: wait, remove this rank's files, then the first rank of each host the rest. Collective."""
        self.wait()
        if not self._ready:
            return
        _comm.barrier(self.group, timeout=self.timeout, what="CheckpointManager.close")
        self.folder.remove()
        _comm.barrier(self.group, timeout=self.timeout, what="CheckpointManager.close")
        if self.leader:
            reclaim_lives(self.job)
            remove_job(self.job)
        # So that, on every rank, the host's memory folder is empty once close() returns.
        _comm.barrier(self.group, timeout=self.timeout, what="CheckpointManager.close")
        self._ready = False


def _wanted(state_dict: Mapping[str, Any], metadata: CheckpointMetadata,
            group: _comm.ProcessGroup) -> dict[str, list[tuple[int, int]]]:
    """Per data file, the byte ranges a load of ``state_dict`` reads (whole chunks, and the header), merged."""
    views, _ = dtensor_views(state_dict, group)
    wanted: dict[str, list[tuple[int, int]]] = {}
    for name, _, _, value in flatten_state_dict(views):
        entry = metadata.tensors.get(name)
        if entry is None:
            continue
        if not isinstance(value, (torch.Tensor, ShardedTensor)) or tuple(value.shape) != tuple(entry.size):
            # A None or number entry receives the whole tensor; a mismatch is reported by the load.
            for shard in entry.shards:
                wanted.setdefault(shard.file, []).append(shard.byte_range)
            continue
        for offsets, tensor in _targets(value):
            for task in _plan_block(Block(name, entry, offsets, tensor), ""):
                span = _span(task) if task.common[1] else task.shard.byte_range
                wanted.setdefault(task.shard.file, []).append(covering(task.shard, *span))
    header_end: dict[str, int] = {}
    for entry in metadata.tensors.values():
        for shard in entry.shards:
            if shard.file in wanted:
                header_end[shard.file] = min(header_end.get(shard.file, shard.byte_range[0]), shard.byte_range[0])
    return {file: merge_ranges([(0, header_end[file]), *ranges], gap=CHUNK_BYTES)
            for file, ranges in sorted(wanted.items())}
