"""Child processes that always die with the benchmark, and per-process CPU/RSS read from ``/proc``.

psutil is not a dependency, so CPU comes from ``/proc/PID/stat`` (utime+stime) and memory from
``/proc/PID/status`` (VmRSS, VmHWM). A proxy may fork workers (nginx, uvicorn), so figures are summed
over the process tree.

Example::

    with Child([sys.executable, "server.py"], name="upstream") as child:
        info = child.wait_ready()            # the child prints "READY {json}" once it listens
        cpu = cpu_seconds(tree(child.pid))
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_LIVE: set[subprocess.Popen[bytes]] = set()


def _kill_all_live() -> None:
    for proc in list(_LIVE):
        _kill(proc)


atexit.register(_kill_all_live)


def exit_on_signals() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so ``finally`` blocks and atexit kill the children.

    Without it a terminated benchmark would orphan nginx or LiteLLM (they do not watch their parent).
    """
    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def _kill(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(grace)
    _LIVE.discard(proc)


def free_port() -> int:
    """An ephemeral loopback port for servers that need the port in their config (nginx, LiteLLM)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A subprocess in its own process group, killed (group-wide) on exit, on error and at interpreter exit."""

    def __init__(self, argv: Sequence[str], *, name: str, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, log_path: str | Path | None = None) -> None:
        self.argv = list(argv)
        self.name = name
        self.env = env
        self.cwd = cwd
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Child:
        log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                         stderr=log if log is not None else subprocess.DEVNULL,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd, start_new_session=True)
        finally:
            if log is not None:
                log.close()
        _LIVE.add(self.proc)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        return self

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if len(self._lines) < 1000:
                self._lines.append(line)
            if line.startswith("READY ") and not self._ready.is_set():
                self._info = json.loads(line[6:])
                self._ready.set()

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        """The child's ``READY {json}`` line, parsed; raises if it exits or stays silent too long."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s: {self.tail()}")
        return self._info

    def tail(self) -> str:
        text = "\n".join(self._lines[-10:])
        if self.log_path and self.log_path.exists():
            text += "\n" + self.log_path.read_text(errors="replace")[-2000:]
        return text.strip()

    def stop(self) -> None:
        if self.proc is not None:
            _kill(self.proc)

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_port(port: int, timeout: float = 30.0, child: Child | None = None) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if child is not None and child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited early: {child.tail()}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f}s") from None
            time.sleep(0.1)


def start_redis(stack: ExitStack, exe: str, *, nice: int | None = None,
                log_path: str | Path | None = None) -> tuple[str, Child]:
    """Debian's ``redis-server`` (``exe``) on a free loopback port, in memory only (no snapshot, no append-only
    file), stopped with ``stack``; returns its URL once it accepts connections, and its process. ``nice``: run
    it at that nice level (does Redis's added latency come from waiting for a core?)."""
    port = free_port()
    prefix = ["nice", "-n", str(nice)] if nice is not None else []
    child = stack.enter_context(Child([*prefix, exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no"], name="redis", log_path=log_path))
    wait_port(port, 10.0, child)
    return f"redis://127.0.0.1:{port}/0", child


# -- /proc accounting ---------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from 3 (state) on; comm may contain spaces


def tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """User+system CPU seconds consumed so far by these processes (threads included)."""
    total = 0
    for pid in pids:
        f = _stat_fields(pid)
        if f is not None:
            total += int(f[11]) + int(f[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / _CLK_TCK


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_bytes(pids: Sequence[int]) -> int:
    """Current resident set size (VmRSS), summed."""
    return sum(_status_kb(p, "VmRSS") for p in pids) * 1024


def peak_rss_bytes(pids: Sequence[int]) -> int:
    """Peak resident set size since each process started (VmHWM), summed."""
    return sum(_status_kb(p, "VmHWM") for p in pids) * 1024


def pin(pids: Sequence[int], cpus: set[int]) -> None:
    """Keep these processes, every thread of each, on ``cpus`` (threads they start later inherit it)."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
