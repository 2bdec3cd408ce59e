"""Every call into ``torch.distributed`` goes through here.

Keeping communication in one module makes it easy to count (``CommCounter``) and keeps the
rest of the package pure. Tensors travel on their own device: Gloo for CPU, NCCL for CUDA.

Every wait here is bounded. A collective that does not complete within its timeout, or
that fails because a peer's connection closed (the peer crashed or was killed), raises
``CollectiveError`` naming the operation and, where they can be told, the ranks that did
not answer. A rank of the group that exits, crashes or is killed makes every wait on that
group raise within moments, whatever the timeout (``_shardkit.liveness``): the timeout
bounds only a wait for a peer that is alive but silent. The timeout of a call is, in order:
the ``timeout`` passed to it, the one of the enclosing entry point (``operation`` /
``collective``), the environment variable ``SHARDKIT_TIMEOUT`` (seconds, read at each
call), and ``DEFAULT_TIMEOUT``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from . import liveness as _liveness
from . import standalone as _standalone
from . import teardown  # binds torch's default-group arguments before any group exists; exit hook

_standalone.install()  # init_process_group() without a launcher: a world of one, with a warning

__all__ = ["CommCounter", "rank_and_world", "default_device", "exchange", "start_exchange", "all_gather_json",
           "broadcast_json", "all_gather_tensor", "CollectiveError",
           "broadcast_int", "all_reduce", "all_reduced", "all_reduce_values", "barrier", "ProcessGroup", "agree",
           "new_group",
           "DEFAULT_TIMEOUT",
           "TIMEOUT_ENV", "LIVENESS_ENV", "resolve_timeout", "operation", "operation_name", "collective"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group
"""A ``torch.distributed.ProcessGroup``; ``None`` means the default group."""

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective waits for its peers before raising ``CollectiveError``, unless a
``timeout=`` argument or the ``SHARDKIT_TIMEOUT`` environment variable says otherwise."""

TIMEOUT_ENV = "SHARDKIT_TIMEOUT"
"""Environment variable (seconds) that replaces ``DEFAULT_TIMEOUT`` for calls given no ``timeout=``."""

LIVENESS_ENV = "SHARDKIT_LIVENESS"
"""Environment variable: ``0`` turns off the detection of gone peers (``_shardkit.liveness``),
e.g. where rank 0 cannot accept a TCP connection from the other ranks; waits then end on
Gloo's own connection errors or the timeout."""

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_active: list[CommCounter] = []
_lock = threading.Lock()

# Tests set this to ``fn(operation, step)``; it runs at the start of every collective, before
# this rank announces its arrival, so a test can stop a rank at a chosen point.
_test_hook: Callable[[str, str], None] | None = None


@dataclass
class CommCounter:
    """Count collectives and the bytes this rank sends inside a ``with`` block.

    Every communication shardkit does passes through one module, so the counts are exact.

    Args:
        counts: filled in by the block: operations by name (``"send/recv"``, ``"all_reduce"``,
            ...), one per message or call; start empty.
        bytes_by_op: filled in by the block: bytes this rank sent, per operation.

    Example:
        >>> with CommCounter() as comm:
        ...     t.reshard(spec)  # doctest: +SKIP
        >>> comm.counts, comm.bytes_sent  # doctest: +SKIP
        (Counter({'send/recv': 1}), 8388608)
    """

    counts: Counter[str] = field(default_factory=Counter)
    bytes_by_op: Counter[str] = field(default_factory=Counter)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank put on the wire (payloads only)."""
        return sum(self.bytes_by_op.values())

    def __enter__(self) -> CommCounter:
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _active.remove(self)

    def __str__(self) -> str:
        ops = ", ".join(f"{op}: {n} ({self.bytes_by_op[op]} B)" for op, n in sorted(self.counts.items()))
        return f"CommCounter({ops or 'no communication'})"


def _record(op: str, nbytes: int) -> None:
    for counter in _active:
        counter.counts[op] += 1
        counter.bytes_by_op[op] += nbytes
    for observer in _observers:
        observer(op, nbytes)


_observers: list[Callable[[str, int], None]] = []


@contextlib.contextmanager
def observed(observer: Callable[[str, int], None]) -> Iterator[None]:
    """Call ``observer(operation, bytes this rank sends)`` for every collective inside the block, as
    ``CommCounter`` counts it (for a report that attributes each to where it happened)."""
    with _lock:
        _observers.append(observer)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(observer)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: ProcessGroup = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` with no process group.

    Raises:
        RuntimeError: no process group, but a launcher (torchrun) started this process as one
            of several ranks: every rank would act as rank 0 of a world of one.
    """
    if not _initialized():
        _check_not_launched()
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_not_launched() -> None:
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        rank = os.environ.get("RANK", "?")
        msg = (f"torch.distributed has no process group, but a launcher started this process as rank {rank} "
               f"of {world} (WORLD_SIZE={world}); call torch.distributed.init_process_group(\"gloo\") "
               f"(\"nccl\" on GPUs) at the start of the script, before shardkit is used, and "
               f"destroy_process_group() only after its last call. To run as one process instead, start "
               f"the script without torchrun (or unset WORLD_SIZE).")
        raise RuntimeError(msg)


def default_device(group: ProcessGroup = None) -> torch.device:
    """The device that collectives of ``group`` use for small tensors."""
    if _initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: ProcessGroup, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def exchange(sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
             group: ProcessGroup = None, *, timeout: float | None = None, what: str = "exchange") -> None:
    """Send ``sends[peer]`` to each peer and receive into ``recvs[peer]``, all at once.

    Collective over the peers named: the two sides of each transfer must name each other with
    tensors of equal byte size. Tensors must be contiguous. Raises ``CollectiveError`` naming
    the peers that did not answer within ``timeout`` (see ``resolve_timeout``) or died.
    """
    start_exchange(sends, recvs, group, timeout=timeout, what=what).wait()


# Messages travel in pieces of at most this many bytes, so that a sender can put the first
# piece of a message on the wire while it is still packing the rest.
_PIECE_BYTES = 8 << 20


def _pieces(wire: torch.Tensor) -> list[torch.Tensor]:
    # The same rule on both sides of a transfer, so piece k meets piece k (tag k).
    return [wire[start:start + _PIECE_BYTES] for start in range(0, max(wire.numel(), 1), _PIECE_BYTES)]


class PendingExchange:
    """Transfers posted by ``start_exchange`` or ``send_ready``; ``wait()`` returns once all are complete.

    Every wait ends by the exchange's deadline (its start plus the timeout). A transfer that
    fails or is still incomplete then makes ``wait()`` raise ``CollectiveError`` naming its
    peer; where the backend gives one handle for the whole batch (NCCL), every peer of the
    exchange is a suspect.
    """

    __slots__ = ("_works", "_group", "_posted", "_recv_works", "_deadline", "_timeout", "_started", "_what",
                 "_failed", "_first_error", "_peers", "_bounded")

    def __init__(self, group: ProcessGroup, timeout: float, what: str) -> None:
        # (group rank of the peer, or None for a handle covering every peer; the work)
        self._works: list[tuple[int | None, Any]] = []
        self._group = group
        self._posted: dict[int, int] = {}
        self._recv_works: dict[int, list[Any]] | None = {}
        self._timeout = timeout
        self._started = time.monotonic()
        self._deadline = self._started + timeout
        self._what = what
        self._failed: set[int] = set()
        self._first_error: BaseException | None = None
        self._peers: set[int] = set()
        self._bounded = True  # False for one NCCL batch (see ``_wait_work``)

    def _post(self, peer: int, post: Callable[[], Any]) -> Any:
        self._peers.add(peer)
        try:
            return post()
        except Exception as exc:  # the peer's connection is already known to be closed
            self._note(peer, exc)
            self._raise()

    def _note(self, peer: int | None, exc: BaseException) -> None:
        self._failed.update(self._peers if peer is None else {peer})
        if self._first_error is None:
            self._first_error = exc

    def _raise(self) -> None:
        exc = self._first_error
        assert exc is not None
        ranks = {_global(self._group, p) for p in self._failed}
        if not isinstance(exc, _liveness.PeerGone):
            # A transfer failed on Gloo's own error: name the ranks that are gone too.
            ranks.update(_gone_ranks(self._group, min(self._deadline - time.monotonic(), _SETTLE_SECONDS)))
        raise _fail(self._what, exc, self._started, self._timeout, sorted(ranks)) from exc

    def _finish(self, works: list[tuple[int | None, Any]]) -> None:
        liveness = _watchdog() if self._bounded and works else None
        if liveness is None:
            self._wait_each(works, self._note)
            return
        # A Gloo send or receive can be waited on only by blocking: a pool thread does that,
        # while this one also watches for a rank of the group being gone.
        failures: list[tuple[int | None, BaseException]] = []
        done, wake = threading.Event(), threading.Event()

        def wait_all() -> None:
            try:
                self._wait_each(works, lambda peer, exc: failures.append((peer, exc)))
            finally:
                done.set()
                wake.set()

        _liveness.run_in_background(wait_all)
        try:
            _liveness.wait_until(done.is_set, wake, self._deadline + 1.0, liveness, _members(self._group))
        except _liveness.PeerGone as gone:
            for rank in gone.ranks:
                self._note(_group_rank(self._group, rank), gone)
            return
        for peer, exc in failures:
            self._note(peer, exc)

    def _wait_each(self, works: list[tuple[int | None, Any]],
                   note: Callable[[int | None, BaseException], None]) -> None:
        failed: set[int] = set()
        for peer, work in works:
            if peer is not None and (peer in self._failed or peer in failed):
                continue  # its pair is closed: its other transfers fail too
            try:
                _wait_work(work, self._deadline, self._bounded)
            except Exception as exc:  # noted; the transfers with the other peers are still waited for
                if peer is not None:
                    failed.add(peer)
                note(peer, exc)

    def wait_recv(self, peer: int) -> None:
        """Wait until the message from ``peer`` has arrived (others may still be in flight).

        Lets a caller use messages in a fixed order as they come, e.g. to reduce partial
        values in rank order while later ones are still on the wire. Where the backend gives
        one handle for the whole batch (NCCL), this waits for everything.
        """
        if self._recv_works is None:
            self.wait()
            return
        done = self._recv_works.pop(peer, [])
        # A Gloo work must be waited for once only (a second wait waits for another message).
        self._works = [(p, w) for p, w in self._works if all(w is not d for d in done)]
        self._finish([(peer, work) for work in done])
        if self._failed:
            self._finish(self._works)  # name every peer that is gone, not only this one
            self._works = []
            self._raise()

    def send_ready(self, peer: int, message: torch.Tensor, ready: int) -> None:
        """Send the pieces of ``message`` that lie within its first ``ready`` bytes and are not sent yet.

        For a message being packed: call it as the packed prefix grows, and with
        ``ready = message.nbytes`` at the end. The receiver posts the whole message in
        ``start_exchange`` as usual. CPU (Gloo) only: on NCCL, sends posted one by one could
        queue behind receives on the same stream, so there the whole message goes in
        ``start_exchange``.
        """
        wire = _wire(message)
        pieces = _pieces(wire)
        done = self._posted.get(peer, 0)
        while done < len(pieces) and done * _PIECE_BYTES + pieces[done].numel() <= ready:
            work = self._post(peer, functools.partial(dist.isend, pieces[done], _global(self._group, peer),
                                                      self._group, done))
            self._works.append((peer, work))
            done += 1
            if done == len(pieces):
                _record("send/recv", wire.numel())
        self._posted[peer] = done

    def wait(self) -> None:
        """Wait for every transfer; raise ``CollectiveError`` naming the peers that failed or did not answer."""
        works, self._works = self._works, []
        self._finish(works)
        if self._failed:
            self._raise()


def start_exchange(sends: Mapping[int, torch.Tensor | Sequence[torch.Tensor]],
                   recvs: Mapping[int, torch.Tensor | Sequence[torch.Tensor]],
                   group: ProcessGroup = None, *, timeout: float | None = None,
                   what: str = "exchange", counted: bool = True) -> PendingExchange:
    """Post the transfers of ``exchange`` and return at once; call ``wait()`` before using them.

    Collective like ``exchange``. A peer's entry may also be a sequence of tensors, sent (or
    received) in that order, each straight from (into) its own memory; the other side then
    names tensors of the same byte sizes in the same order. On NCCL every send and receive
    goes in one ``batch_isend_irecv`` group, so no pair of ranks can block on the order of
    posting; Gloo posts each one as it comes (what ``batch_isend_irecv`` does there too),
    which lets a failure be traced to its peer. The tensors must stay alive and untouched
    until ``wait()`` returns. More sends can follow with ``send_ready``. The deadline of every
    wait is the start plus ``timeout`` (see ``resolve_timeout``). ``counted=False``: the
    caller records the bytes in ``CommCounter`` under its own operation's name.
    """
    pending = PendingExchange(group, resolve_timeout(timeout), what)
    ops: list[tuple[int, Callable[..., Any], torch.Tensor, int]] = []
    for peer, tensors in recvs.items():
        pieces = [piece for tensor in _messages(tensors) for piece in _pieces(_wire(tensor))]
        ops.extend((peer, dist.irecv, piece, k) for k, piece in enumerate(pieces))
    for peer, tensors in sends.items():
        pieces = [piece for tensor in _messages(tensors) for piece in _pieces(_wire(tensor))]
        ops.extend((peer, dist.isend, piece, k) for k, piece in enumerate(pieces))
        if counted:
            _record("send/recv", sum(piece.numel() for piece in pieces))
    if not ops:
        return pending
    _check_alive(what, group, pending._timeout)
    _begin(what)
    if ops[0][2].device.type != "cpu":
        pending._peers.update(peer for peer, *_ in ops)
        try:
            works = dist.batch_isend_irecv([dist.P2POp(fn, piece, _global(group, peer), group, tag=k)
                                            for peer, fn, piece, k in ops])
        except Exception as exc:
            pending._note(None, exc)
            pending._raise()
        pending._works.extend((None, work) for work in works)
        pending._recv_works = None
        pending._bounded = False
        return pending
    for peer, fn, piece, k in ops:
        work = pending._post(peer, functools.partial(fn, piece, _global(group, peer), group, k))
        pending._works.append((peer, work))
        if fn is dist.irecv:
            pending._recv_works.setdefault(peer, []).append(work)  # type: ignore[union-attr]
    return pending


def _messages(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    # Bytes travel as uint8 so every dtype (bool, bfloat16, complex) takes the same path.
    return tensor.reshape(-1).view(torch.uint8)


# -- timeouts and the operation being run ---------------------------------------------------------

def _check_timeout(value: object, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        msg = f"{source}={value!r} is not a timeout; use a positive, finite number of seconds."
        raise ValueError(msg)
    return float(value)


def resolve_timeout(timeout: float | None = None) -> float:
    """The seconds a collective waits: ``timeout`` if given, else the enclosing operation's,
    else ``$SHARDKIT_TIMEOUT``, else ``DEFAULT_TIMEOUT``.

    Raises:
        ValueError: ``timeout`` or the environment variable is not a positive number.
    """
    if timeout is not None:
        return _check_timeout(timeout, "timeout")
    scopes = _scopes()
    for scope in reversed(scopes):
        if scope.timeout is not None:
            return scope.timeout
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = text  # type: ignore[assignment]
        return _check_timeout(value, TIMEOUT_ENV)
    return DEFAULT_TIMEOUT


@dataclass(frozen=True)
class _Scope:
    name: str
    timeout: float | None


_thread = threading.local()


def _scopes() -> list[_Scope]:
    stack: list[_Scope] | None = getattr(_thread, "scopes", None)
    if stack is None:
        stack = _thread.scopes = []
    return stack


@contextlib.contextmanager
def operation(name: str, timeout: float | None = None) -> Iterator[None]:
    """Run the block as the entry point ``name``: its collectives' errors name it, and wait ``timeout``.

    Scopes nest (per thread): errors name the outermost one, the one the user called, and an
    inner scope without a timeout keeps the outer one's.
    """
    scope = _Scope(name, None if timeout is None else _check_timeout(timeout, "timeout"))
    stack = _scopes()
    stack.append(scope)
    try:
        yield
    finally:
        stack.pop()


def collective(name: str) -> Callable[[F], F]:
    """Decorate a collective entry point: its body runs in ``operation(name, timeout)``.

    ``timeout`` is the call's ``timeout=`` keyword argument when it passes one.
    """
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with operation(name, kwargs.get("timeout")):
                return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate


def operation_name(default: str = "") -> str:
    """The entry point this thread is running (the outermost ``operation``), else ``default``."""
    scopes = _scopes()
    return scopes[0].name if scopes else default


def _describe(step: str) -> str:
    """``step`` prefixed with the entry point being run, unless it already names it."""
    scopes = _scopes()
    if not scopes:
        return step
    outer = scopes[0].name
    inner = [s.name for s in scopes[1:] if s.name != outer]
    detail = ", ".join([*inner, step]) if step and not step.startswith(outer) else ", ".join(inner)
    if step.startswith(outer):
        return f"{step} (in {detail})" if detail else step
    return f"{outer} ({detail})" if detail else outer


def _begin(step: str) -> None:
    if _test_hook is not None:
        _test_hook(operation_name(), step)


# -- who arrived: marks in the process group's store ---------------------------------------------

def _store() -> Any | None:
    """The default process group's key-value store, or ``None`` where torch offers none.

    The only use of a private ``torch.distributed`` API in shardkit: without it, errors still
    name the operation but cannot say which ranks never arrived.
    """
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # another torch version, or no default group
        return None


class _Arrivals:
    """Which ranks reached the n-th marked collective of a group.

    Before it waits in a marked collective, a rank stores, under one key per rank and group,
    how many marked collectives of that group it has entered. Every rank enters them in the
    same order, so when the n-th fails, the ranks whose count is below n never reached it.
    One overwritten key per rank: the store does not grow with the number of collectives.
    """

    def __init__(self) -> None:
        # By process group object: a group destroyed and created again starts over, like its peers.
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(group: ProcessGroup, global_rank: int) -> tuple[str, str]:
        name = getattr(group if group is not None else dist.group.WORLD, "group_name", "") or "world"
        return name, f"shardkit/arrived/{name}/{global_rank}"

    def arrive(self, group: ProcessGroup) -> int:
        _, key = self._key(group, dist.get_rank())
        which = id(group if group is not None else dist.group.WORLD)
        with self._lock:
            count = self._counts[which] = self._counts.get(which, 0) + 1
        store = _store()
        if store is not None:
            try:
                store.set(key, str(count))
            except Exception:  # the store's host died: the collective will fail and say so
                pass
        return count

    def missing(self, group: ProcessGroup, count: int, settle: float) -> list[int] | None:
        """Global ranks of ``group`` that have not entered its ``count``-th marked collective
        within ``settle`` seconds from now (``None``: unknown).

        A dead peer makes the ranks next to it fail at once, while live ranks may still be on
        their way (finishing their own writes): those are given ``settle`` to arrive, so that
        only the ranks that really never came are named.
        """
        store = _store()
        if store is None:
            return None
        peers = [_global(group, r) for r in range(dist.get_world_size(group))]
        keys = [self._key(group, peer)[1] for peer in peers]
        until = time.monotonic() + settle
        try:
            while True:
                absent = [peer for peer, key in zip(peers, keys)
                          if not store.check([key]) or int(store.get(key).decode()) < count]
                if not absent or time.monotonic() >= until:
                    return absent
                time.sleep(0.05)
        except Exception:  # the store is gone with its host: say "unknown" rather than guess
            return None


_arrivals = _Arrivals()


# -- who is gone: _shardkit.liveness ---------------------------------------------------------------

# The default group (by weak reference: holding it would keep it from being freed at exit)
# and this process's Liveness for it.
_watch_state: dict[str, Any] = {"world": None, "liveness": None}
_watch_lock = threading.Lock()


def _watchdog() -> _liveness.Liveness | None:
    """This process's ``Liveness`` for the current default group (started on first use), or ``None``."""
    if not _initialized() or os.environ.get(LIVENESS_ENV, "").strip() == "0":
        return None
    world_group = dist.group.WORLD
    with _watch_lock:
        current = _watch_state["liveness"]
        if _watch_state["world"] is not None and _watch_state["world"]() is world_group:
            return current  # type: ignore[no-any-return]
        if current is not None:
            current.stop()
        _watch_state["world"], _watch_state["liveness"] = weakref.ref(world_group), None
        store = _store()
        if store is None or dist.get_world_size() < 2:
            return None
        created = _liveness.Liveness(store, dist.get_rank(), dist.get_world_size())
        _watch_state["liveness"] = created
    # The first collective gives the connection to rank 0 a moment, so that a peer dying
    # right after it is seen.
    created.connected.wait(_liveness._CONNECT_WAIT)
    return created


def _stop_watching() -> None:
    with _watch_lock:
        current, _watch_state["liveness"], _watch_state["world"] = _watch_state["liveness"], None, None
    if current is not None:
        current.stop()


teardown.on_exit(_stop_watching)


def _members(group: ProcessGroup) -> list[int]:
    """The global ranks of ``group``."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _group_rank(group: ProcessGroup, global_rank: int) -> int:
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _gone_ranks(group: ProcessGroup, settle: float) -> list[int]:
    """Global ranks of ``group`` known to be gone, waiting up to ``settle`` s for the news of one."""
    liveness = _watchdog()
    if liveness is None:
        return []
    members = _members(group)
    until = time.monotonic() + settle
    while True:
        gone = liveness.gone(members)
        if gone or time.monotonic() >= until:
            return gone
        time.sleep(0.02)


def _check_alive(step: str, group: ProcessGroup, limit: float, liveness: _liveness.Liveness | None = None,
                 members: list[int] | None = None) -> None:
    """Raise ``CollectiveError`` at once when a rank of ``group`` is already known to be gone.

    ``liveness`` and ``members``: ``_watchdog()`` and ``_members(group)`` when the caller has them.
    """
    if liveness is None:
        liveness = _watchdog()
    if liveness is None:
        return
    gone = liveness.gone(_members(group) if members is None else members)
    if gone:
        raise _fail(step, _liveness.PeerGone(gone), time.monotonic(), limit, gone)

# After a failure, how long live ranks get to reach the failed collective before those still
# missing are named (never beyond the timeout).
_SETTLE_SECONDS = 1.0


# -- errors ---------------------------------------------------------------------------------------

Reason = Literal["closed", "timeout", "error"]


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer died, left, or did not answer within the timeout.

    Attributes:
        operation: what was running, e.g. ``"ShardedTensor.reshard (exchange)"``.
        reason: ``"closed"`` (a peer's connection closed: it crashed, was killed or exited),
            ``"timeout"`` (no answer within ``timeout`` seconds) or ``"error"`` (anything else
            the backend reported).
        ranks: the global ranks that did not answer, or ``None`` when they cannot be told.
        timeout: the seconds this rank was prepared to wait.
        elapsed: the seconds it waited.

    Args:
        operation: sets ``operation``.
        reason: sets ``reason``.
        ranks: sets ``ranks`` (sorted).
        timeout: sets ``timeout``.
        elapsed: sets ``elapsed``.
        detail: the backend's own words, quoted in the message when ``reason`` is ``"error"``.

    The process group cannot be used after this error: the job (or at least the group) must
    be restarted, e.g. from the last checkpoint.
    """

    def __init__(self, operation: str, reason: Reason, ranks: list[int] | None, *, timeout: float,
                 elapsed: float, detail: str = "") -> None:
        self.operation, self.reason, self.timeout, self.elapsed = operation, reason, timeout, elapsed
        self.detail = detail
        self.ranks = None if ranks is None else sorted(ranks)
        if reason == "closed":
            cause = (f"a peer closed its connection after {elapsed:.1f} s (it crashed, was killed or exited; "
                     f"timeout={timeout:g} s)")
        elif reason == "timeout":
            cause = (f"no answer within timeout={timeout:g} s (pass a larger timeout= or set {TIMEOUT_ENV} "
                     f"if the peers are only slow)")
        else:
            cause = f"failed after {elapsed:.1f} s: {detail}"
        if self.ranks is None:
            who = "which ranks did not answer is unknown"
        elif not self.ranks:
            who = "every rank had reached it, so one failed or died inside it"
        else:
            who = f"no answer from rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}"
        super().__init__(f"{operation} did not complete: {cause}; {who}.")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its fields (a rank's error sent to another process), not with the message alone.
        return (_collective_error, (self.operation, self.reason, self.ranks, self.timeout, self.elapsed, self.detail))


def _collective_error(operation: str, reason: Reason, ranks: list[int] | None, timeout: float, elapsed: float,
                      detail: str) -> CollectiveError:
    return CollectiveError(operation, reason, ranks, timeout=timeout, elapsed=elapsed, detail=detail)


def _classify(exc: BaseException, elapsed: float, timeout: float) -> tuple[Reason, str]:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else repr(exc)
    lower = text.lower()
    if "application timeout" in lower or ("timed out" in lower and elapsed >= 0.9 * timeout):
        return "timeout", first  # our own deadline (after it, Gloo closes the pair it timed out on)
    if any(s in lower for s in ("connection closed", "connection reset", "broken pipe", "connection refused",
                                "socket closed", "end of file")):
        return "closed", first
    return "error", first


def _fail(step: str, exc: BaseException, started: float, timeout: float,
          ranks: list[int] | None) -> CollectiveError:
    elapsed = time.monotonic() - started
    reason, detail = _classify(exc, elapsed, timeout)
    return CollectiveError(_describe(step), reason, ranks, timeout=timeout, elapsed=elapsed, detail=detail)


def _wait_work(work: Any, deadline: float, bounded: bool = True) -> None:
    if not bounded:
        # NCCL: a wait with a timeout would block this thread until the kernels finish, losing
        # the overlap of communication and compute; its watchdog aborts a collective after the
        # process group's timeout instead.
        work.wait()
        return
    # At least a moment, so that a message already in is taken even when the deadline has passed.
    remaining = max(deadline - time.monotonic(), 0.01)
    work.wait(timeout=datetime.timedelta(seconds=remaining))


def _future(work: Any) -> Any:
    """The work's future (Gloo collectives have one), or ``None``: then it is waited on directly."""
    try:
        return work.get_future()
    except RuntimeError:
        return None


def _run(step: str, group: ProcessGroup, timeout: float | None, post: Callable[[], Any],
         marked: bool = True) -> None:
    """Post a group-wide collective with ``post()`` and wait for it, within the timeout. Collective."""
    limit = resolve_timeout(timeout)
    # Looked up once per call (each costs a lock or a walk of torch's group tables).
    liveness = _watchdog()
    members = _members(group) if liveness is not None else []
    _check_alive(step, group, limit, liveness, members)
    if marked:
        _begin(step)
    count = _arrivals.arrive(group) if marked else None
    started = time.monotonic()
    try:
        work = post()
        cpu = default_device(group).type == "cpu"
        future = _future(work) if liveness is not None and cpu else None
        if future is not None and not future.done():
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            _liveness.wait_until(future.done, done, started + limit, liveness, members)
        _wait_work(work, started + limit, cpu)
    except _liveness.PeerGone as gone:
        raise _fail(step, gone, started, limit, gone.ranks) from None
    except Exception as exc:  # Gloo/NCCL raise RuntimeError or DistBackendError subclasses
        settle = min(max(started + limit - time.monotonic(), 0.0), _SETTLE_SECONDS)
        # A rank known to be gone is the one to name (it may have died inside the step, after
        # arriving); else the ranks that never arrived.
        ranks = _gone_ranks(group, settle) or (_arrivals.missing(group, count, settle) if count is not None else None)
        raise _fail(step, exc, started, limit, ranks) from exc


# -- traceable collectives ----------------------------------------------------------------------
# Under torch.compile the collectives of a forward or backward become nodes of the graph:
# torch's functional collectives, which the compiler orders and waits on itself. They replace
# the bounded wait (timeout, dead-peer detection) of the eager path, which a graph cannot run.

def _default(group: ProcessGroup) -> Any:
    return dist.group.WORLD if group is None else group


def _traced_all_reduce(tensor: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol
    reduced: torch.Tensor = funcol.wait_tensor(funcol.all_reduce(tensor, op, _default(group)))
    return reduced


def _traced_all_gather(tensor: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    from torch.distributed import _functional_collectives as funcol
    world = dist.get_world_size(group)
    stacked = funcol.wait_tensor(funcol.all_gather_tensor(tensor.unsqueeze(0), 0, _default(group)))
    return list(stacked.unbind(0))[:world]


def _encode_json(value: object, device: torch.device) -> torch.Tensor:
    """``value`` as JSON bytes in a uint8 tensor on ``device``."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)


def _decode_json(buffers: list[torch.Tensor], lengths: list[int]) -> list[Any]:
    """Inverse of ``encode_json`` for the first ``lengths[i]`` bytes of each buffer."""
    return [json.loads(bytes(b[:n].cpu().numpy()).decode()) for b, n in zip(buffers, lengths)]


def _gather_lengths(n: int, group: ProcessGroup, timeout: float | None, what: str) -> list[int]:
    """Every rank's ``n``, in group rank order (also a barrier). Collective."""
    device = default_device(group)
    length = torch.tensor([n], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size(group))]
    _run(what, group, timeout, lambda: dist.all_gather(lengths, length, group=group, async_op=True))
    return [int(x) for x in lengths]


# Bytes of each rank's slot in the first round of ``all_gather_json``: an 8-byte length, then
# the payload's start. Agreement reports (an error or a small value) fit, so they take one round.
_SLOT_BYTES = 512


def all_gather_json(value: object, group: ProcessGroup = None, *, timeout: float | None = None,
                    what: str = "all_gather") -> list[Any]:
    """Every rank's JSON-serializable ``value``, in group rank order. Collective.

    JSON rather than pickle: what one rank sends is only ever parsed as data. A rank that does
    not arrive within ``timeout`` seconds (see ``resolve_timeout``), or died, makes it raise
    ``CollectiveError`` naming ``what`` and the ranks that never arrived.

    One all-gather of fixed-size slots (the length and the first bytes of every payload) when
    every payload fits (``_SLOT_BYTES``); a second one, of the longest remainder, otherwise.
    Every rank learns every length in the first, so all take the second alike.
    """
    if not _initialized():
        return [json.loads(json.dumps(value))]
    limit = resolve_timeout(timeout)
    device = default_device(group)
    data = json.dumps(value).encode()
    room = _SLOT_BYTES - 8
    slot = bytearray(_SLOT_BYTES)
    slot[:8] = len(data).to_bytes(8, "little")
    slot[8:8 + min(len(data), room)] = data[:room]
    mine = torch.frombuffer(slot, dtype=torch.uint8).to(device)
    slots = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _run(what, group, limit, lambda: dist.all_gather(slots, mine, group=group, async_op=True))
    _record("all_gather", _SLOT_BYTES)
    firsts = [bytes(s.cpu().numpy()) for s in slots]
    lengths = [int.from_bytes(f[:8], "little") for f in firsts]
    payloads = [f[8:8 + min(n, room)] for f, n in zip(firsts, lengths)]
    longest = max(lengths) - room
    if longest > 0:
        rest = torch.zeros(longest, dtype=torch.uint8, device=device)
        tail = data[room:]
        if tail:
            rest[:len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8).to(device)
        gathered = [torch.empty_like(rest) for _ in lengths]
        _run(what, group, limit, lambda: dist.all_gather(gathered, rest, group=group, async_op=True), marked=False)
        _record("all_gather", longest)
        payloads = [p + bytes(g[:max(n - room, 0)].cpu().numpy()) for p, g, n in zip(payloads, gathered, lengths)]
    return [json.loads(p.decode()) for p in payloads]


def broadcast_int(value: int, src: int = 0, group: ProcessGroup = None, *, timeout: float | None = None,
                  what: str = "broadcast") -> int:
    """``value`` from group rank ``src`` on every rank. Collective; bounded like ``all_gather_json``."""
    if not _initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=default_device(group))
    _run(what, group, timeout, lambda: dist.broadcast(tensor, _global(group, src), group=group, async_op=True))
    _record("broadcast", 8)
    return int(tensor.item())


def all_reduce(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum",
               timeout: float | None = None, what: str = "all_reduce") -> torch.Tensor:
    """Reduce ``tensor`` over the group in place (``op``: ``"sum"`` or ``"max"``). Collective; bounded.

    Called in forward passes, so it announces its arrival (one store write) only inside an
    entry point (``operation``): elsewhere a failure cannot name the missing ranks.
    """
    if _initialized() and dist.get_world_size(group) > 1:
        if torch.compiler.is_compiling():
            return tensor.copy_(_traced_all_reduce(tensor, op, group))
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        _run(what, group, timeout, lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True),
             marked=bool(_scopes()))
        _record("all_reduce", tensor.numel() * tensor.element_size())
    return tensor


def all_reduced(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum",
                timeout: float | None = None, what: str = "all_reduce") -> torch.Tensor:
    """The reduction of ``tensor`` over the group as a new contiguous tensor; ``tensor`` is not written. Collective.

    For a tensor autograd (or the caller) may still read. Eager: one contiguous copy,
    reduced in place like ``all_reduce``. Under ``torch.compile``: one functional
    collective, which returns a new tensor itself, so the graph holds no copy around it.
    """
    if torch.compiler.is_compiling() and _initialized() and dist.get_world_size(group) > 1:
        return _traced_all_reduce(tensor, op, group)
    return all_reduce(tensor.clone(memory_format=torch.contiguous_format), group, op=op, timeout=timeout,
                      what=what)


_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce_values(tensor: torch.Tensor, group: ProcessGroup = None, *, op: str = "sum",
                      timeout: float | None = None, what: str = "all_reduce") -> torch.Tensor:
    """Reduce ``tensor`` in place over every rank of the group (``op``: sum, avg, max, min). Collective; bounded.

    For a partial tensor held by every rank. ``"avg"`` is a sum divided by the world size
    on each rank, so it behaves the same on every backend. ``CommCounter`` records the bytes a
    bandwidth-optimal all-reduce puts on the wire from each rank, 2 (w-1)/w of the tensor
    (a reduce-scatter then an all-gather; Gloo's ring on CPU sends exactly that).
    """
    if not _initialized() or dist.get_world_size(group) == 1:
        return tensor
    world = dist.get_world_size(group)
    reduce_op = getattr(dist.ReduceOp, _REDUCE_OPS.get(op, "SUM"))
    _run(what, group, timeout, lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True),
         marked=bool(_scopes()))
    _record("all_reduce", 2 * (world - 1) * tensor.numel() // world * tensor.element_size())
    if op == "avg":
        tensor.div_(world)
    return tensor


def barrier(group: ProcessGroup = None, *, timeout: float | None = None, what: str = "barrier") -> None:
    """Wait for every rank of the group. Collective; bounded like ``all_gather_json``."""
    if _initialized():
        _run(what, group, timeout, lambda: dist.barrier(group=group, async_op=True))


def new_group(group: ProcessGroup = None, *, timeout: float | None = None) -> ProcessGroup:
    """A new Gloo group over the ranks of ``group``, for collectives on another thread. Collective.

    Every rank of the default group calls it (creating a group is itself collective, even for
    ranks outside it), in the same order. Gloo and NCCL match collectives by issue order per
    group, so a background thread must not share the training thread's group: it gets its
    own. Its waits default to ``timeout`` (see ``resolve_timeout``). The group is destroyed at
    exit (``teardown.created``). Without a process group (a world of one) it returns ``None``.
    """
    if not _initialized():
        return None
    seconds = max(resolve_timeout(timeout), 1.0)
    return teardown.created(dist.new_group(_members(group), backend="gloo",
                                           timeout=datetime.timedelta(seconds=seconds)))


def all_gather_tensor(tensor: torch.Tensor, group: ProcessGroup = None, *, timeout: float | None = None,
                      what: str = "all_gather") -> list[torch.Tensor]:
    """Every rank's ``tensor``, in group-rank order. Collective; bounded like ``all_reduce``.

    All ranks pass tensors of the same shape and dtype (pad uneven pieces first); each rank
    receives every piece on ``tensor``'s own device. Without a process group (or in a world of
    one) the result is ``[tensor]``.
    """
    if not _initialized() or dist.get_world_size(group) == 1:
        return [tensor]
    tensor = tensor.contiguous()
    if torch.compiler.is_compiling():
        return _traced_all_gather(tensor, group)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _run(what, group, timeout, lambda: dist.all_gather(gathered, tensor, group=group, async_op=True),
         marked=bool(_scopes()))
    _record("all_gather", tensor.numel() * tensor.element_size())
    return gathered


def broadcast_json(value: object, src: int = 0, group: ProcessGroup = None, *, timeout: float | None = None,
                   what: str = "broadcast") -> Any:
    """Group rank ``src``'s JSON ``value`` on every rank (others pass anything). Collective; bounded."""
    if not _initialized():
        return json.loads(json.dumps(value))
    limit = resolve_timeout(timeout)
    device = default_device(group)
    rank = dist.get_rank(group)
    payload = _encode_json(value if rank == src else None, device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    _run(what, group, limit, lambda: dist.broadcast(length, _global(group, src), group=group, async_op=True))
    buffer = payload if rank == src else torch.empty(int(length), dtype=torch.uint8, device=device)
    _run(what, group, limit, lambda: dist.broadcast(buffer, _global(group, src), group=group, async_op=True),
         marked=False)
    _record("broadcast", 8 + buffer.numel() if rank == src else 0)
    return _decode_json([buffer], [buffer.numel()])[0]


def agree(step: str, fn: Callable[[], T], group: ProcessGroup = None, *, timeout: float | None = None,
          share: Callable[[T], object] | None = None, error: Callable[[str], Exception] = RuntimeError,
          lost: Callable[[CollectiveError], Exception] | None = None) -> tuple[T, list[Any]]:
    """Run ``fn`` on every rank, then make every rank learn every outcome. Collective.

    Each rank runs ``fn`` and reports either its failure or ``share(result)`` (JSON). A rank
    whose ``fn`` raised re-raises its own exception; every other rank raises
    ``error(message)`` naming ``step`` and each failed rank with its error, so no rank goes on
    while a peer has given up. A peer that does not report within ``timeout`` seconds (or
    died) makes every waiting rank raise ``CollectiveError`` naming ``step`` and the ranks that
    never reported, or ``lost(that error)`` when ``lost`` is given (so a caller can say what the
    lost peer means for its operation, in its own error type). ``timeout=None``: see
    ``resolve_timeout``.

    Returns ``(result, shared)``: this rank's result and every rank's shared value, in group
    rank order (``None`` entries without ``share``).
    """
    resolve_timeout(timeout)  # a bad timeout is refused before any work, in a world of one too
    result: Any = None
    failure: BaseException | None = None
    shared: object = None
    try:
        result = fn()
        shared = share(result) if share is not None else None
    except Exception as exc:  # reported to every rank below, so none is left waiting
        failure = exc
    report = {"error": None if failure is None else f"{type(failure).__name__}: {failure}", "value": shared}
    try:
        everyone = all_gather_json(report, group, timeout=timeout, what=step)
    except CollectiveError as exc:
        if failure is not None:
            raise failure from exc
        if lost is not None:
            raise lost(exc) from exc
        raise
    if failure is not None:
        raise failure
    failed = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
    if failed:
        raise error(f"{step} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))
    return result, [e["value"] for e in everyone]
