"""A real Prometheus scrapes the validator and every query of the shipped dashboard returns data (issue 41).

Debian's ``prometheus`` (``apt-get install prometheus``; ``.ci/run`` installs it as it does ``redis-server``) runs on
loopback against the local subnet's gateway, scraping ``/metrics`` every second while the test sends traffic through
the official SDK, one miner goes away (its failures have a panel) and the validator closes rounds and sets weights.
Without the binary the test fails naming the command; ``TENSORGATE_SKIP_PROMETHEUS=1`` skips it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

DASHBOARD = Path(__file__).resolve().parent.parent / "scripts" / "deploy" / "grafana" / "dashboards" / "tensorgate.json"

if shutil.which("prometheus") is None:
    if os.environ.get("TENSORGATE_SKIP_PROMETHEUS") == "1":
        pytest.skip("TENSORGATE_SKIP_PROMETHEUS=1", allow_module_level=True)
    raise RuntimeError("prometheus is not installed: apt-get install prometheus (or TENSORGATE_SKIP_PROMETHEUS=1)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _query(session: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    """The query's result vector (empty while Prometheus is still starting)."""
    try:
        async with session.get(f"{base}/api/v1/query", params={"query": expr}) as r:
            body = await r.json()
    except aiohttp.ClientConnectionError:
        return []
    assert r.status == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


async def test_a_real_prometheus_scrapes_the_validator_and_every_dashboard_query_returns_data(tmp_path: Path) -> None:
    from neurons.validator.config import ValidatorConfig
    from tests.subnets import running_subnet, sdk_client

    cfg = ValidatorConfig(local=True, state_dir=tmp_path / "state", gateway_port=0, local_round_s=3.0,
                          local_block_time=0.25, local_miners=2, capacity_check=False, audit_rate=1.0, seed=9)
    async with running_subnet(cfg, seed=9) as net:
        port = net.validator.gateway.port
        web = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                      "scrape_configs": [{"job_name": "tensorgate",
                                                          "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}))
        prom = await asyncio.create_subprocess_exec(
            "prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{web}"
        exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
        empty: list[str] = exprs
        try:
            async with sdk_client(net) as client, aiohttp.ClientSession() as session:
                for i in range(120):  # about a minute at most: traffic every tick until every panel has data
                    if i == 10:  # a miner goes away: the failures panel has something to show (the relay retries)
                        await net.runners[-1].cleanup()
                    await client.chat.completions.create(model=cfg.models[0], max_tokens=8, stream=bool(i % 2),
                                                         messages=[{"role": "user", "content": f"hello {i}"}])
                    if i % 10 == 9:
                        up = await _query(session, base, 'up{job="tensorgate"}')
                        if up and up[0]["value"][1] == "1":
                            empty = [e for e in exprs if not await _query(session, base, e)]
                            if not empty:
                                break
                    await asyncio.sleep(0.5)
                assert (await _query(session, base, 'up{job="tensorgate"}'))[0]["value"][1] == "1"  # scraped, no key
        finally:
            prom.terminate()
            await asyncio.wait_for(prom.wait(), timeout=30)
    assert not empty, f"{len(empty)} of {len(exprs)} dashboard queries returned no data: {empty}"
