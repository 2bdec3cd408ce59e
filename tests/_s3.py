"""A real S3-protocol server on loopback for tests: moto's standalone server, started and stopped here.

Use it through the ``s3`` fixture (import it into a test module)::

    from tests._s3 import S3, s3  # noqa: F401 - the fixture is found by name

    def test_roundtrip(s3: S3) -> None:
        url = s3.url("ckpt")                    # s3://<fresh bucket>/ckpt
        checkpoint.save(sd, url, storage_options=s3.storage_options)

Each test gets its own empty bucket, so tests never see each other's objects. The server
listens on 127.0.0.1 on a free port chosen by the OS and lives for the whole test session;
nothing outside the test process is needed (no Docker, no network).
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

__all__ = ["S3", "S3Process", "s3", "s3_endpoint", "s3_process"]

_buckets = itertools.count()


@dataclass(frozen=True)
class S3:
    """One fresh bucket on the loopback S3 server and how to reach it with fsspec/s3fs."""

    endpoint_url: str
    bucket: str
    storage_options: dict[str, object] = field(hash=False)

    def url(self, key: str = "") -> str:
        """``s3://<bucket>/<key>``."""
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def filesystem(self):  # type: ignore[no-untyped-def]
        """A fresh (uncached) ``s3fs.S3FileSystem`` for this server, for direct inspection in tests."""
        import s3fs  # noqa: PLC0415

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start moto's threaded S3 server on 127.0.0.1 (free port) for the session; stop it after."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs (pip install shardkit[test])")
    server_mod = pytest.importorskip("moto.server", reason="S3 tests need moto[server]")
    # The requests go to loopback only; a proxy from the environment must not intercept them.
    saved = {k: os.environ.get(k) for k in ("NO_PROXY", "no_proxy")}
    for key in saved:
        os.environ[key] = ",".join(filter(None, [saved[key], "127.0.0.1", "localhost"]))
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3(s3_endpoint: str) -> S3:
    """A new empty bucket on the loopback S3 server, with s3fs ``storage_options`` to reach it."""
    options: dict[str, object] = {
        "endpoint_url": s3_endpoint, "key": "testing", "secret": "testing",
        # moto accepts any credentials; a fixed region keeps botocore from looking one up.
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    bucket = f"shardkit-test-{os.getpid()}-{next(_buckets)}"
    fs = S3(s3_endpoint, bucket, options).filesystem()
    fs.mkdir(bucket)
    return S3(s3_endpoint, bucket, options)


class S3Process:
    """A loopback S3 server in a process of its own, so a test can kill or pause it mid-save.

    ``kill()`` is a server crash (SIGKILL: its in-memory buckets are lost), ``pause()`` a
    stalled server (SIGSTOP: connections are accepted by the kernel but never answered) and
    ``resume()`` (SIGCONT) brings a paused one back with its objects.
    """

    _CODE = ("import sys, time\n"
             "from moto.server import ThreadedMotoServer\n"
             "server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
             "server.start()\n"
             "print(server.get_host_and_port()[1], flush=True)\n"
             "while True:\n"
             "    time.sleep(3600)\n")

    def __init__(self) -> None:
        import subprocess  # noqa: PLC0415
        import sys  # noqa: PLC0415

        env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        self.process = subprocess.Popen([sys.executable, "-c", self._CODE], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, env=env)
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port:
            self.process.kill()
            msg = f"the S3 server process exited with code {self.process.wait()} before listening"
            raise RuntimeError(msg)
        self.pid = self.process.pid
        self.endpoint_url = f"http://127.0.0.1:{int(port)}"

    def bucket(self, name: str) -> S3:
        """A new empty bucket ``name`` on this server."""
        options: dict[str, object] = {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing",
                                      "client_kwargs": {"region_name": "eu-west-1"}}
        s3 = S3(self.endpoint_url, name, options)
        s3.filesystem().mkdir(name)
        return s3

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.process.poll() is None:
            self.resume()
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def s3_process() -> Iterator[S3Process]:
    """A loopback S3 server in its own process (to kill or pause), stopped after the test."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs (pip install shardkit[test])")
    pytest.importorskip("moto.server", reason="S3 tests need moto[server]")
    server = S3Process()
    try:
        yield server
    finally:
        server.close()
