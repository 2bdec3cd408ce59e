"""The memory tier's decisions, as pure functions: where replicas go, which step a restart loads, what it fetches.

No file system and no communication here: every rank runs these on the same inputs (what the
ranks told each other) and reaches the same answer, which is what makes the tier's collectives
line up. Unit-tested without a process group.

- ``replica_targets``: the ranks that hold each rank's replicas, on other hosts.
- ``choose_step``: the newest step that is complete in some tier, from what each host holds in
  memory and the steps committed in storage.
- ``merge_ranges``: the byte ranges a rank fetches from a peer, coalesced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["replica_targets", "Choice", "choose_step", "merge_ranges", "part_ranks"]


def replica_targets(domains: Sequence[str], replicas: int) -> list[list[int]]:
    """For each rank, the ranks that receive its replicas: one on each of the next ``replicas`` hosts.

    ``domains[r]`` names rank ``r``'s failure domain (its host and memory folder). Hosts are
    ordered by their first rank; rank ``r``, the ``i``-th rank of host ``h``, sends its ``j``-th
    replica to the ``i``-th rank (modulo its size) of host ``h + j``. So with hosts of equal size
    every rank receives as many replicas as it sends, and no replica shares its owner's host.
    With a single host there is nowhere else to go: no replicas (a lost host then falls back
    to storage). At most one replica per other host.

    Example:
        >>> replica_targets(["a", "a", "b", "b"], 1)
        [[2], [3], [0], [1]]
    """
    hosts: dict[str, list[int]] = {}
    for rank, domain in enumerate(domains):
        hosts.setdefault(domain, []).append(rank)
    order = list(hosts)
    targets: list[list[int]] = []
    for rank, domain in enumerate(domains):
        h, i = order.index(domain), hosts[domain].index(rank)
        peers = []
        for j in range(1, min(replicas, len(order) - 1) + 1):
            other = hosts[order[(h + j) % len(order)]]
            peers.append(other[i % len(other)])
        targets.append(peers)
    return targets


@dataclass(frozen=True, slots=True)
class Choice:
    """What a load reads: ``tier`` ``"memory"``, ``"storage"`` or ``"none"`` (nothing to load), and ``step``.

    For memory: the step's ``generation`` and metadata ``digest``; ``holders``, for each part
    (the rank that saved it), the ranks whose host holds a copy; ``metadata_ranks``, the ranks
    whose host holds the step's metadata. ``reason`` says why memory was not used (empty when it
    was, or when the tier holds nothing at all), or why there is nothing to load.
    """

    tier: Literal["memory", "storage", "none"]
    step: int | None = None
    generation: str = ""
    digest: str = ""
    holders: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    metadata_ranks: tuple[int, ...] = ()
    reason: str = ""


def _ranks(parts: Sequence[int]) -> str:
    return ", ".join(str(p) for p in sorted(parts))


def choose_step(reports: Sequence[Mapping[str, Any]], storage_steps: Sequence[int],
                step: int | None = None) -> Choice:
    """The step to load: the newest complete in memory or committed in storage (memory on a tie).

    ``reports[r]`` is rank ``r``'s ``{"host": <id>, "held": [...]}``, where each held step is
    ``{"step", "generation", "digest", "need": [parts], "have": [parts]}`` (what its host's memory
    folder holds: the parts of the step the metadata lists, and those present). Ranks with one
    host id read one folder, so a part is held by every rank of a host that has it. A memory
    step is complete when the union over hosts of ``have`` covers ``need`` and every host agrees
    on its metadata (the same ``digest``); a torn or half-replicated step is therefore never
    chosen. ``step``: that step only (memory first, else storage), or ``"none"``.
    """
    ranks_of: dict[str, list[int]] = {}
    for rank, report in enumerate(reports):
        ranks_of.setdefault(str(report["host"]), []).append(rank)
    # (step, generation) -> digest -> {"need": ..., "have": {part: [ranks]}, "ranks": [ranks with metadata]}
    found: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for ranks in ranks_of.values():
        for held in reports[ranks[0]]["held"]:
            key = (int(held["step"]), str(held["generation"]))
            entry = found.setdefault(key, {}).setdefault(str(held["digest"]), {
                "need": sorted(int(p) for p in held["need"]), "have": {}, "ranks": []})
            entry["ranks"].extend(ranks)
            for part in held["have"]:
                entry["have"].setdefault(int(part), []).extend(ranks)
    complete: dict[int, Choice] = {}
    lacking: dict[int, str] = {}
    for (saved, generation), by_digest in sorted(found.items()):
        if len(by_digest) > 1:
            lacking[saved] = f"the hosts hold different metadata for memory step {saved}"
            continue
        digest, entry = next(iter(by_digest.items()))
        missing = [p for p in entry["need"] if p not in entry["have"]]
        if missing:
            lacking[saved] = (f"memory step {saved} lacks the part{'s' if len(missing) > 1 else ''} of "
                              f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} (no memory folder "
                              f"holds {'them' if len(missing) > 1 else 'it'})")
            continue
        holders = {p: tuple(sorted(set(entry["have"][p]))) for p in entry["need"]}
        choice = Choice("memory", saved, generation, digest, holders, tuple(sorted(set(entry["ranks"]))))
        if saved not in complete or generation > complete[saved].generation:
            complete[saved] = choice
    committed = sorted(set(int(s) for s in storage_steps))
    if step is not None:
        if step in complete:
            return complete[step]
        if step in committed:
            why = lacking.get(step, f"memory holds no step {step}")
            return Choice("storage", step, reason=why)
        msg = (f"step={step!r} is neither complete in memory nor committed in storage; memory holds "
               f"{sorted(complete) or 'no complete step'}, storage {committed or 'no step'}.")
        return Choice("none", reason=msg)
    newest_memory = max(complete, default=None)
    newest_storage = committed[-1] if committed else None
    if newest_memory is not None and (newest_storage is None or newest_memory >= newest_storage):
        return complete[newest_memory]
    if newest_storage is not None:
        newer = [s for s in lacking if s > newest_storage]
        if newer:
            reason = lacking[max(newer)]
        elif found:
            reason = f"the newest step in memory ({max(s for s, _ in found)}) is older than storage's"
        else:
            reason = ""
        return Choice("storage", newest_storage, reason=reason)
    reason = "; ".join(lacking[s] for s in sorted(lacking, reverse=True)[:3])
    return Choice("none", reason=reason or "no step in memory and no committed step in storage")


def part_ranks(files: Sequence[str]) -> dict[int, str]:
    """``{saving rank: file name}`` for data file names ``data-<generation>-r<rank>.safetensors``."""
    parts = {}
    for name in files:
        stem = name.rsplit(".", 1)[0]
        parts[int(stem.rsplit("-r", 1)[1])] = name
    return parts


def merge_ranges(ranges: Sequence[tuple[int, int]], *, gap: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` ranges sorted and coalesced where they overlap or lie at most ``gap`` bytes apart.

    Example:
        >>> merge_ranges([(10, 20), (0, 8), (15, 30), (40, 41)], gap=2)
        [(0, 30), (40, 41)]
    """
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
