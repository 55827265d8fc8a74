"""Test doubles and client-side helpers: the scripted miner (shipped in :mod:`neurons.miner.scripted`, shared
with the benchmarks), a miner whose port refuses connections, and helpers to read what the gateway sent.

Example::

    miner = FakeMiner(Keypair.create_from_uri("//Bob"), trusted={alice.ss58_address},
                      script=Script("drop_after", tokens=8, after=3), tag="bob")
    await miner.start()
    miner.endpoint      # "127.0.0.1:PORT"
    await miner.stop()
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from neurons.miner.scripted import BEHAVIORS, FakeMiner, Script

__all__ = ["BEHAVIORS", "MODEL", "DeadMiner", "FakeMiner", "LoopbackMiner", "Script", "body", "closed_port",
           "contents", "error_of", "eventually", "read_sse"]

MODEL = "tensorgate/sim-5090"


class LoopbackMiner:
    """What the router needs of a test miner: its hotkey and its loopback endpoint."""

    keypair: Any
    port: int

    @property
    def hotkey(self) -> str:
        return str(self.keypair.ss58_address)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DeadMiner(LoopbackMiner):
    """A registered miner whose endpoint refuses connections."""

    keypair: Any
    tag: str = "dead"
    requests: int = 0
    active: int = 0

    def __post_init__(self) -> None:
        self.port = closed_port()


# -- client-side helpers -----------------------------------------------------------------------


def body(stream: bool = True, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "say something"}], "stream": stream,
            "max_tokens": max_tokens, **extra}


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """All data payloads of an SSE response (JSON decoded, "[DONE]" kept as a string)."""
    events: list[Any] = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"}
    assert err["request_id"] == resp.headers["X-Request-Id"]  # the same id in the body and the header
    return err


def contents(events: list[Any]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]["delta"].get("content")
            if c:
                out.append(c)
    return out


async def eventually(cond: Callable[[], bool], within_s: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True


BANNER = re.compile(r"gateway: (http://\S+)/v1\s+\(API key: (\S+)\)")


def start_local_job(args: list[str], cwd: Path, *, within_s: float = 90.0
                    ) -> tuple[subprocess.Popen[str], str, str, list[str]]:
    """``python -m neurons.validator`` with ``args`` as a child process, read until its banner names the gateway's
    URL and API key: (the process, the URL, the key, the stderr lines read so far). The caller stops the process."""
    proc = subprocess.Popen([sys.executable, "-m", "neurons.validator", *args], cwd=cwd,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = BANNER.search(line)
        if m:
            return proc, m.group(1), m.group(2), lines
    proc.kill()
    proc.wait()
    raise AssertionError("no banner from the local job:\n" + "".join(lines[-20:]))
