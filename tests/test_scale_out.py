"""Several gateway processes on one Redis, as real processes: kill -9 of a gateway, of the scorer, and the local
subnet with two gateway workers (issue 28). Component behaviour against Redis is in test_shared.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from bittensor.sp_core import Keypair

from gateway.protocol.measurement import Measurement
from gateway.router import Candidate, Router
from gateway.shared.link import RedisLink
from gateway.shared.measurements import MeasurementPublisher, MeasurementReader
from gateway.shared.routing import publish, view
from neurons.keys import dev_keypair
from neurons.validator.build import build_parts, build_validator, shared_namespace
from neurons.validator.config import ValidatorConfig
from tests.fakes import MODEL, FakeMiner, Script
from tests.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
ALICE = dev_keypair("Alice").ss58_address
NS = shared_namespace(1, ALICE)  # the local subnet's validator (//Alice) on netuid 1


def _gateway_proc(redis_url: str, port: int, keys_file: Path, lease_s: float = 2.0) -> subprocess.Popen[bytes]:
    """``python -m neurons.validator --gateway.only``: one more gateway of the local subnet's validator."""
    return subprocess.Popen([sys.executable, "-m", "neurons.validator", "--local", "--gateway.only",
                             "--redis.url", redis_url, "--gateway.port", str(port), "--gateway.model", MODEL,
                             "--gateway.keys-file", str(keys_file), "--redis.lease-seconds", str(lease_s),
                             "--log-level", "WARNING"], cwd=ROOT, stdout=subprocess.DEVNULL)


async def _until(check: Any, within_s: float, every_s: float = 0.1) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while True:
        got = await check()
        if got or loop.time() > end:
            return got
        await asyncio.sleep(every_s)


async def _health(session: aiohttp.ClientSession, port: int) -> dict[str, Any] | None:
    try:
        async with session.get(f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            body: dict[str, Any] = await r.json()
            return body
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def test_kill_9_of_a_gateway_loses_only_its_own_streams(redis_url: str, alice: Keypair,
                                                              miner_keys: list[Keypair], tmp_path: Path) -> None:
    """Two gateway processes stream from one miner (2 slots) under one key (2 streams). kill -9 of one: its client
    loses its stream; the miner's slot and the key's stream it held free themselves within the lease; the other
    process's stream finishes and is measured; the freed slot serves a new request."""
    miner = FakeMiner(miner_keys[0], trusted={alice.ss58_address},
                      script=Script("ok", tokens=60, token_delay=0.05), slots=2, tag="slow")
    await miner.start()
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-scale-0123 name=scale streams=2\n")
    scorer_router = Router()
    scorer_router.sync([Candidate(uid=1, hotkey=miner.hotkey, endpoint=miner.endpoint, slots=2)])
    link = RedisLink(redis_url, NS)
    assert await publish(link, view(scorer_router))  # what the validator would publish
    ports = [free_port(), free_port()]
    procs = [_gateway_proc(redis_url, p, keys) for p in ports]
    r = aioredis.Redis.from_url(redis_url)
    lease_key = f"{NS}:lease:{miner.hotkey}"
    streams_key = f"{NS}:key:scale:streams"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 60}
    auth = {"Authorization": "Bearer sk-scale-0123"}
    try:
        async with aiohttp.ClientSession() as s:
            for port, gw in zip(ports, procs, strict=True):
                up = await _until(lambda port=port, gw=gw: _health(s, port) if gw.poll() is None else _true(), 60.0)
                assert gw.poll() is None and up, "a gateway process did not start"

            async def stream(port: int) -> tuple[int, str]:
                text = ""
                try:
                    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=auth,
                                      timeout=aiohttp.ClientTimeout(total=30)) as resp:
                        async for line in resp.content:
                            text += line.decode()
                        return resp.status, text
                except (aiohttp.ClientError, OSError):
                    return -1, text

            tasks = [asyncio.create_task(stream(p)) for p in ports]
            assert await _until(lambda: _eq(r.zcard(lease_key), 2), 10.0), "both streams hold a lease"
            assert await r.zcard(streams_key) == 2
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(timeout=10)
            killed = time.monotonic()
            assert await _until(lambda: _eq(r.zcard(lease_key), 1), 5.0), "the dead process's lease expires"
            assert await _live(r, streams_key) == 1  # expired holds are pruned at the key's next admission
            assert time.monotonic() - killed < 4.0  # within the 2 s lease (and the refresh), not minutes
            lost, done = await asyncio.gather(*tasks)
            assert lost[0] == -1 or "[DONE]" not in lost[1]  # its client lost the stream
            assert done[0] == 200 and "[DONE]" in done[1]  # the other finished
            status, text = await stream(ports[1])  # the freed slot and key stream serve a new request
            assert status == 200 and "[DONE]" in text
        reader = MeasurementReader(link)
        got: list[Measurement] = []

        async def two() -> bool:
            got.extend(await reader.pull())
            return len(got) >= 2

        await _until(two, 5.0)
        assert [m.ok for m in got] == [True, True]  # the survivor's two answers reached the scorer (the dead one's
        # stream was in flight when it died: lost with it, never acknowledged by anyone)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        await r.aclose()
        await link.aclose()
        await miner.stop()


async def _live(r: aioredis.Redis, key: str | bytes) -> int:
    """Members of an expiring set not yet expired (on Redis's clock)."""
    sec, usec = await r.time()
    return int(await r.zcount(key, sec * 1000 + usec // 1000, "+inf"))


async def _true() -> bool:
    return True


async def _eq(coro: Any, want: int) -> bool:
    return bool(await coro == want)


_READER = """
import asyncio, sys
from gateway.shared.link import RedisLink
from gateway.shared.measurements import MeasurementReader
async def main():
    link = RedisLink(sys.argv[1], sys.argv[2])
    got = await MeasurementReader(link).pull()
    print(len(got), flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


async def test_kill_9_of_the_scorer_loses_nothing_it_had_not_acknowledged(redis_url: str) -> None:
    """A scorer process reads every entry, then dies (kill -9) before saving a round: its successor reads them all
    again; once acknowledged (the round saved), none comes back."""
    link = RedisLink(redis_url, NS)
    pub = MeasurementPublisher(link)
    sent = [Measurement(uid=1, hotkey=f"hk{i}", in_flight=0, prompt_tokens=3, max_tokens=8, ttft_s=0.1,
                        latency_s=0.2, completion_tokens=8, ok=True) for i in range(40)]
    try:
        for m in sent:
            pub.record(m)
        assert await pub.send() == 40
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _READER, redis_url, NS, cwd=ROOT,
                                                    stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"40"
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        successor = MeasurementReader(link)
        back = await successor.pull()
        assert back == sent
        assert await successor.ack([m.ref for m in back if m.ref])
        assert await MeasurementReader(link).pull() == []
    finally:
        await link.aclose()


class _Chain:
    netuid = 1

    async def metagraph(self) -> list[Any]:
        return []


async def test_the_validator_acknowledges_only_what_a_saved_round_holds(redis_url: str, tmp_path: Path) -> None:
    cfg = ValidatorConfig(state_dir=tmp_path, gateway_port=0, redis_url=redis_url)
    v = build_validator(cfg, _Chain(), dev_keypair("Alice"))  # type: ignore[arg-type]
    link = RedisLink(redis_url, NS)
    pub = MeasurementPublisher(link)
    r = aioredis.Redis.from_url(redis_url)

    def m(i: int) -> Measurement:
        return Measurement(uid=1, hotkey="m1", in_flight=0, prompt_tokens=3, max_tokens=8, ttft_s=0.1,
                           latency_s=0.2, completion_tokens=8, ok=True, at=time.time() + i * 1e-3)

    async def pending() -> int:
        info = await r.xpending(f"{NS}:measurements", "scorer")
        return int(info["pending"])

    try:
        await v.open_state()
        for i in range(5):
            pub.record(m(i))
        await pub.send()
        await v._drain()
        assert await pending() == 5
        await v.close_round()
        assert await pending() == 0  # saved, then acknowledged
        for i in range(3):
            pub.record(m(10 + i))
        await pub.send()
        await v._drain()
        assert v.state.store is not None
        v.state.store.close()  # the save fails: nothing is acknowledged
        await v.close_round()
        assert await pending() == 3
        v.state.store = None
        # a restarted scorer reads the unsaved three first
        v2 = build_validator(cfg, _Chain(), dev_keypair("Alice"))  # type: ignore[arg-type]
        assert v2.state.reader is not None
        assert len(await v2.state.reader.pull()) == 3
        if v2.parts.shared is not None:
            await v2.parts.shared.link.aclose()
    finally:
        if v.parts.shared is not None:
            await v.parts.shared.link.aclose()
        await r.aclose()
        await link.aclose()


def test_the_local_subnet_runs_with_two_gateway_workers(redis_url: str, tmp_path: Path) -> None:
    """The README's main job with ``--gateway.workers 2``: both processes serve the port; the worker, killed with
    kill -9, is started again; rounds close, weights are set, every measurement reaches the scorer and is
    acknowledged, and no lease is left behind."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "neurons.validator", "--local", "--gateway.workers", "2",
                             "--redis.url", redis_url, "--local.rounds", "2", "--gateway.port", str(port),
                             "--state-dir", str(tmp_path / "state")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)

    async def pids() -> tuple[set[int], int | None]:
        """The pids answering the port; once both showed, kill -9 the worker and wait for its replacement."""
        seen: set[int] = set()
        killed: int | None = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            end = time.monotonic() + 90
            while time.monotonic() < end and proc.poll() is None:
                h = await _health(s, port)
                if h is not None:
                    seen.add(int(h["pid"]))
                if killed is None and len(seen) == 2:
                    killed = next(p for p in seen if p != proc.pid)
                    os.kill(killed, signal.SIGKILL)
                if killed is not None and len(seen) == 3:
                    break
                await asyncio.sleep(0.05)
        return seen, killed

    try:
        seen, killed = asyncio.run(pids())
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    # the validator and its worker both answered the port; the worker, killed, was replaced by a new one
    assert proc.pid in seen and killed is not None and len(seen) == 3, (seen, killed)
    assert "1 gateway worker processes serve port" in log and "weights set at block" in log
    assert f"gateway worker 1 (pid {killed}) exited with -9: starting it again" in log
    assert "Redis at" not in log  # no outage said

    async def stream_state() -> tuple[int, int, list[Any]]:
        r = aioredis.Redis.from_url(redis_url)
        try:
            group = (await r.xinfo_groups(f"{NS}:measurements"))[0]
            leases = [await _live(r, k) for k in await r.keys(f"{NS}:lease:*")]
            return int(group["entries-read"]), int(group["pending"]), leases
        finally:
            await r.aclose()

    read, unacknowledged, leases = asyncio.run(stream_state())
    assert read > 20 and unacknowledged == 0  # every measurement of both processes was scored and saved
    assert sum(leases) == 0  # every lease released


async def test_redis_down_the_gateway_serves_on_and_sends_its_measurements_when_it_is_back(
        make_miner: Any, alice: Keypair, tmp_path: Path) -> None:
    """Redis killed under a gateway: requests are still routed (local counts) and served, a limited key gets its
    local share of each limit, measurements wait in the buffer; Redis back: they all reach the scorer. Said once."""
    server = RedisServer().start()
    miner = await make_miner(Script("ok", tokens=4), slots=4)
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-limited-0123 name=limited rpm=10\n")
    cfg = ValidatorConfig(gateway_port=0, models=[MODEL], redis_url=server.url, gateway_workers=2)
    parts = build_parts(cfg, alice, env={}, keys_file=str(keys), freeze_heap=False)
    assert parts.shared is not None
    parts.router.sync([Candidate(uid=1, hotkey=miner.hotkey, endpoint=miner.endpoint, slots=4)])
    loops = [asyncio.create_task(fn()) for fn in parts.shared.loops().values()]
    await parts.gateway.start()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    statuses: list[int] = []
    try:
        async with aiohttp.ClientSession() as s:
            async def ask() -> None:
                async with s.post(f"http://127.0.0.1:{parts.gateway.port}/v1/chat/completions", json=body,
                                  headers={"Authorization": "Bearer sk-limited-0123"}) as r:
                    await r.read()
                    statuses.append(r.status)

            for _ in range(2):
                await ask()
            async with s.get(f"http://127.0.0.1:{parts.gateway.port}/v1/status",
                             headers={"Authorization": "Bearer sk-limited-0123"}) as r:
                key = (await r.json())["key"]
            assert (key["requests_today"], key["in_flight"]) == (2, 0)  # every process's use, as Redis counts it

            async def empty() -> bool:
                return len(parts.shared.publisher) == 0 if parts.shared else True  # noqa: B023

            # the 2 measurements so far go out first: the Redis killed next keeps nothing (its restart is empty), so
            # what the test can follow through the outage is what this process held meanwhile
            assert await _until(empty, 10.0), "the measurements were not sent while Redis was up"
            server.kill()
            for _ in range(8):
                await ask()
            # 2 with Redis; then this process's share of the 8 the key had left: 8 // 2 processes = 4 (issue 39 row 6:
            # the share of the whole limit, 5, ignored what the key had used)
            assert statuses == [200] * 6 + [429] * 4
            assert len(parts.shared.publisher) == 4  # the 4 served without Redis wait in the buffer
            server.start()
            link = parts.shared.link
            assert link.outages == 1  # said once, not once a request
            assert await _until(empty, 10.0), "the buffer was not sent when Redis came back"
            async with s.get(f"http://127.0.0.1:{parts.gateway.port}/metrics") as r:
                metrics = await r.text()
            assert "tensorgate_redis_outages_total 1.0" in metrics and "tensorgate_redis_up 1.0" in metrics
            assert "tensorgate_shared_limit_fallbacks_total 8.0" in metrics  # the 8 asked while Redis was away
        reader = MeasurementReader(RedisLink(server.url, NS))
        got = await reader.pull()
        assert len(got) == 4 and all(m.ok for m in got) and link.up  # every one held through the outage
        await reader.link.aclose()
    finally:
        await parts.aclose()
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        server.kill()


def test_a_worker_whose_validator_was_killed_stops(redis_url: str, tmp_path: Path) -> None:
    """kill -9 of the validator: its gateway worker stops by itself (it never serves with no one scoring)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "neurons.validator", "--local", "--gateway.workers", "2",
                             "--redis.url", redis_url, "--gateway.port", str(port), "--state-dir",
                             str(tmp_path / "state")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def worker_pid() -> int | None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            end = time.monotonic() + 90
            while time.monotonic() < end and proc.poll() is None:
                h = await _health(s, port)
                if h is not None and int(h["pid"]) != proc.pid:
                    return int(h["pid"])
                await asyncio.sleep(0.05)
        return None

    try:
        worker = asyncio.run(worker_pid())
        assert worker is not None, "no worker answered"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        end = time.monotonic() + 15
        while time.monotonic() < end and Path(f"/proc/{worker}").exists():
            time.sleep(0.1)
        gone = not Path(f"/proc/{worker}").exists()
        if not gone:
            os.kill(worker, signal.SIGKILL)
        assert gone, "the worker outlived its validator"
    finally:
        if proc.poll() is None:
            proc.kill()
