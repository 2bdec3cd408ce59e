"""Which processes of the job are gone, known within moments of their death.

Gloo notices a dead peer only on the connections a rank is using: a rank waiting for a
live peer that itself gave up (because a third rank died) would wait for its whole timeout.
Here every rank keeps one idle TCP connection to rank 0 for the life of the job. The kernel
closes a process's connections when it exits, crashes or is killed, so rank 0 learns of a
death at once and tells every other rank; the death of rank 0 every rank sees itself. A rank
that is alive but stuck keeps its connection: only the timeout bounds a wait for it.

Rank 0 listens on a port of its own choosing and publishes its addresses and a random token
in the default group's store (``shardkit/liveness``); the other ranks connect when they
first communicate and present the token. Where any of this is not possible (no store, no
route to rank 0), waits behave as before: Gloo's own errors and the timeout.

Every wait of ``_shardkit.comm`` on a CPU process group goes through ``wait_until``, which
returns when the work completes or its deadline passes, and raises ``PeerGone`` when a
rank of the group is gone and the work did not complete in the moment after.
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Liveness", "PeerGone", "wait_until", "run_in_background"]

_KEY = "shardkit/liveness"
# After a peer is known to be gone, how long a wait still gives its work to complete: a peer
# that exits right after finishing a collective must not fail the others' same collective.
GRACE_SECONDS = 0.5
# The first collective of a rank waits at most this long for its connection to rank 0.
_CONNECT_WAIT = 2.0


class PeerGone(Exception):  # noqa: N818 - an event, turned into CollectiveError by comm
    """Ranks of the group being waited on are gone (exited, crashed or killed)."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)
        super().__init__(f"connection closed: rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, self.ranks))} exited, crashed or was killed")


class Liveness:
    """This process's view of which global ranks are gone; see the module docstring."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._store = store
        self._gone: dict[int, float] = {}
        self._waiters: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self.connected = threading.Event()
        target = self._serve if rank == 0 else self._join
        self._thread = threading.Thread(target=target, name="shardkit-liveness", daemon=True)
        self._thread.start()

    # -- what waits see ----------------------------------------------------------------------------

    def gone(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` known to be gone."""
        with self._lock:
            return sorted(r for r in ranks if r in self._gone)

    def watch(self, event: threading.Event) -> None:
        """Set ``event`` whenever a rank is found gone (until ``unwatch``)."""
        with self._lock:
            self._waiters.add(event)

    def unwatch(self, event: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(event)

    def _declare(self, rank: int) -> bool:
        with self._lock:
            if rank in self._gone or self._stop.is_set():
                return False
            self._gone[rank] = time.monotonic()
            waiters = list(self._waiters)
        for event in waiters:
            event.set()
        return True

    def stop(self) -> None:
        """Close the connections (at exit, or when the process group is replaced)."""
        self._stop.set()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    # -- rank 0: accept every rank, tell everyone who is gone ----------------------------------------

    def _serve(self) -> None:
        try:
            listener = socket.create_server(("", 0), backlog=max(self.world, 16))
        except OSError:
            return
        self._sockets.append(listener)
        token = secrets.token_hex(16)
        info = {"hosts": _addresses(), "port": listener.getsockname()[1], "token": token}
        try:
            self._store.set(_KEY, json.dumps(info))
        except Exception:  # no usable store: waits fall back to Gloo's errors and the timeout
            return
        self._store = None
        self.connected.set()
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        members: dict[socket.socket, int] = {}
        hellos: dict[socket.socket, bytes] = {}

        def drop(sock: socket.socket) -> None:
            with contextlib.suppress(Exception):
                selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()
            hellos.pop(sock, None)
            rank = members.pop(sock, None)
            if rank is not None and self._declare(rank):
                for other in list(members):
                    try:
                        other.sendall(f"gone {rank}\n".encode())
                    except OSError:
                        continue  # its own closing is seen by the selector

        while not self._stop.is_set():
            try:
                events = selector.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    hellos[conn] = b""
                    self._sockets.append(conn)
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if sock in hellos:
                    hellos[sock] += data
                    if not data or len(hellos[sock]) > 256:
                        drop(sock)
                    elif b"\n" in hellos[sock]:
                        rank = _hello(hellos.pop(sock), token, self.world)
                        if rank is None:
                            drop(sock)
                            continue
                        members[sock] = rank
                        with self._lock:
                            gone = sorted(self._gone)
                        with contextlib.suppress(OSError):
                            sock.sendall(f"ok {','.join(map(str, gone))}\n".encode())
                elif not data:
                    drop(sock)  # the rank's process is gone

    # -- other ranks: one connection to rank 0 ---------------------------------------------------------

    def _join(self) -> None:
        sock = None
        while sock is None and not self._stop.is_set():
            sock = self._connect()
            if sock is None:
                self._stop.wait(0.2)
        if sock is None:
            return
        self._store = None  # not needed any more: do not keep it alive
        self.connected.set()
        buffer = b""
        while not self._stop.is_set():
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                self._declare(0)  # rank 0's process is gone (or stop() closed the socket)
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                word, _, rank = line.decode(errors="replace").partition(" ")
                if word == "gone" and rank.isdigit():
                    self._declare(int(rank))

    def _connect(self) -> socket.socket | None:
        try:
            if not self._store.check([_KEY]):
                return None
            info = json.loads(self._store.get(_KEY).decode())
            hosts, port, token = list(info["hosts"]), int(info["port"]), str(info["token"])
        except Exception:
            return None
        for host in hosts:
            try:
                sock = socket.create_connection((host, port), timeout=2.0)
            except OSError:
                continue
            self._sockets.append(sock)
            try:
                sock.sendall(f"{self.rank} {token}\n".encode())
                reply = b""
                while not reply.endswith(b"\n") and len(reply) < 65536:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
                word, _, gone = reply.decode(errors="replace").strip().partition(" ")
                if word != "ok":
                    raise OSError("refused")
                sock.settimeout(None)
                for rank in filter(None, gone.split(",")):
                    self._declare(int(rank))
                return sock
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    sock.close()
        return None


def _hello(line: bytes, token: str, world: int) -> int | None:
    """The rank a new connection announces, or ``None`` when it does not belong to this job."""
    rank, _, given = line.decode(errors="replace").strip().partition(" ")
    if not rank.isdigit() or not secrets.compare_digest(given, token) or not 0 < int(rank) < world:
        return None
    return int(rank)


def _addresses() -> list[str]:
    """Addresses the other ranks may reach this host by, the most specific first."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        found.extend(str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    found.append("127.0.0.1")
    return list(dict.fromkeys(found))


# -- waiting ------------------------------------------------------------------------------------------

def wait_until(finished: Callable[[], bool], wake: threading.Event, deadline: float,
               liveness: Liveness | None, ranks: Iterable[int]) -> None:
    """Block until ``finished()`` (``wake`` is set when it may have become true) or ``deadline``.

    ``wake`` is cleared here and also set on every death: it must not be what ``finished`` reads.

    Raises ``PeerGone`` when one of ``ranks`` is gone and the work has not finished within
    ``GRACE_SECONDS`` of that being known.
    """
    members = list(ranks)
    if liveness is not None:
        liveness.watch(wake)
    try:
        while True:
            wake.clear()
            if finished():
                return
            gone = liveness.gone(members) if liveness is not None else []
            if gone:
                until = time.monotonic() + GRACE_SECONDS
                while not finished() and time.monotonic() < until:
                    time.sleep(0.01)
                if finished():
                    return
                raise PeerGone(gone)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wake.wait(left)
    finally:
        if liveness is not None:
            liveness.unwatch(wake)


class _Pool:
    """Daemon threads that run blocking waits (a Gloo send or receive cannot be waited on otherwise).

    A thread whose wait was abandoned (its peer is gone) stays blocked until the wait's own
    deadline; a new thread is started whenever no idle one is left.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            threading.Thread(target=self._work, name="shardkit-wait", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            with contextlib.suppress(BaseException):
                job()
            with self._lock:
                self._idle += 1


_pool = _Pool()


def run_in_background(job: Callable[[], None]) -> None:
    """Run ``job`` on a daemon thread of the wait pool."""
    _pool.submit(job)
