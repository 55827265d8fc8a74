"""The validator's other gateway processes (``--gateway.workers N``): started, watched, restarted, stopped.

The validator serves the port itself and starts N-1 workers (``python -m neurons.validator.worker``) that bind it
too (``SO_REUSEPORT``). A worker that dies (a crash, an OOM kill, ``kill -9``) loses only its requests in flight,
whose leases expire in Redis; it is started again after a second, and the others serve meanwhile. On stop each
gets SIGTERM, drains its streams like the validator's own gateway, and sends its last measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys

from loguru import logger

from .config import ValidatorConfig, config_to_json

START_S = 60.0  # a worker that does not serve within this is killed and started again


class WorkerPool:
    def __init__(self, cfg: ValidatorConfig, port: int, *, api_keys: list[str] | None = None) -> None:
        self.cfg = dataclasses.replace(cfg, gateway_port=port, gateway_only=True)
        self.count = max(0, cfg.gateway_workers - 1)
        self.api_keys = api_keys
        self.procs: list[asyncio.subprocess.Process | None] = [None] * self.count
        self.started = 0  # processes started, restarts included
        self._stopping = False

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.returncode is None]

    async def start(self) -> None:
        """Start every worker and wait until each serves (in parallel)."""
        await asyncio.gather(*(self._spawn(i) for i in range(self.count)))
        logger.info("{} gateway worker processes serve port {} with this one: pids {}", self.count,
                    self.cfg.gateway_port, self.pids())

    async def _spawn(self, i: int) -> None:
        spec = json.dumps({"config": config_to_json(self.cfg), "api_keys": self.api_keys, "parent": os.getpid()})
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "neurons.validator.worker",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self.procs[i] = proc
        self.started += 1
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(spec.encode() + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
        try:
            async with asyncio.timeout(START_S):
                line = await proc.stdout.readline()
        except TimeoutError:
            line = b""
        if not line.startswith(b"listening"):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError(f"gateway worker {i + 1} did not start (exit {proc.returncode}); see its log above")

    async def watch(self) -> None:
        """Start again, a second later, each worker that exited (until stop)."""
        while not self._stopping:
            await asyncio.sleep(1.0)
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.returncode is not None and not self._stopping:
                    logger.error("gateway worker {} (pid {}) exited with {}: starting it again", i + 1, proc.pid,
                                 proc.returncode)
                    await self._spawn(i)

    async def stop(self) -> None:
        """SIGTERM to each (streams drain, measurements are sent); SIGKILL to any still there after the drain."""
        self._stopping = True
        live = [p for p in self.procs if p is not None and p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.cfg.drain_s + 10.0):
                await asyncio.gather(*(p.wait() for p in live))
        except TimeoutError:
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in live))
