"""A real Redis server for the tests (Debian's ``redis-server``), on a free loopback port, in memory only.

Shared state across gateway processes is Redis's job (gateway.shared); a fake would test the fake. The server is
started here and by ``.ci/run``'s install; a machine without ``redis-server`` fails these tests with the command
that installs it (or skips them with ``TENSORGATE_SKIP_REDIS=1``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

INSTALL = "apt-get install -y redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``kill`` and ``start`` again on the same port (the Redis-down tests)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get("TENSORGATE_SKIP_REDIS") == "1":
                pytest.skip("no redis-server (TENSORGATE_SKIP_REDIS=1)")
            pytest.fail(f"these tests need Debian's redis-server: {INSTALL} (or TENSORGATE_SKIP_REDIS=1 to skip)")
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2.0) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)
