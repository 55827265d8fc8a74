"""GET /metrics (issue 26): the gateway's and the validator's families after known traffic, and the access rule."""

from __future__ import annotations

import random
from collections.abc import MutableMapping
from typing import Any

from bittensor.sp_core import Keypair
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import Gateway, GatewayConfig
from gateway.http.client import MinerClient
from gateway.protocol.measurement import MeasurementQueue
from gateway.protocol.signing import RequestSigner
from gateway.router import Router
from gateway.upstream import Upstream
from tests.fakes import Script, body


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_after_known_traffic(make_miner, make_gateway, tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-named name=alice\n")
    ok = await make_miner(Script("ok", tokens=3), tag="ok-")
    bad = await make_miner(Script("garbage"), tag="bad-")
    h = await make_gateway([ok, bad], keys_file=str(keys), max_retries=0, seed=1)
    statuses = []
    for _ in range(6):
        async with h.chat(body(max_tokens=3), headers={"Authorization": "Bearer sk-named"}) as r:
            statuses.append(r.status)
            await r.read()
    h.router.set_quarantined({bad.hotkey})
    async with h.client.get(h.base_url + "/metrics") as r:  # a loopback client: no key needed
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        got = _samples(await r.text())
    assert got[("tensorgate_responses_total", (("outcome", "200"),))] == statuses.count(200)
    assert got.get(("tensorgate_responses_total", (("outcome", "502"),)), 0) == statuses.count(502)
    bad_uid, ok_uid = str(h.uids["bad-"]), str(h.uids["ok-"])
    assert got[("tensorgate_miner_requests_total", (("uid", ok_uid),))] == got[("tensorgate_miner_ok_total",
                                                                                 (("uid", ok_uid),))]
    if statuses.count(502):
        assert got[("tensorgate_miner_failures_total", (("reason", "garbage"), ("uid", bad_uid)))] >= 1
    assert got[("tensorgate_miner_quarantined", (("hotkey", bad.hotkey), ("uid", bad_uid)))] == 1
    # the models each miner serves, as an info series: declared, or the subnet's default for a miner that declared none
    ok_state = h.router.get(int(ok_uid))
    assert ok_state is not None
    h.router.learn_offer(ok_state, frozenset({"tensorgate/sim-5090", "other/model"}), frozenset())
    async with h.client.get(h.base_url + "/metrics") as r:
        served_models = {(labels, v) for (name, labels), v in _samples(await r.text()).items()
                         if name == "tensorgate_miner_model"}
    assert served_models == {((("hotkey", ok.hotkey), ("model", m), ("uid", ok_uid)), 1.0)
                             for m in ("other/model", "tensorgate/sim-5090")} | \
        {((("hotkey", bad.hotkey), ("model", "tensorgate/sim-5090"), ("uid", bad_uid)), 1.0)}
    assert got[("tensorgate_key_requests_today", (("key", "alice"),))] == 6
    assert ("tensorgate_in_flight", ()) in got
    # per-miner histograms: every completed 3-token answer of the good miner has a TTFT and a decode rate
    served = got[("tensorgate_miner_ok_total", (("uid", ok_uid),))]
    assert served >= 1
    for name in ("tensorgate_miner_ttft_seconds", "tensorgate_miner_decode_tokens_per_second"):
        assert got[(f"{name}_count", (("uid", ok_uid),))] == served
        assert got[(f"{name}_bucket", (("le", "+Inf"), ("uid", ok_uid)))] == served
        assert got[(f"{name}_sum", (("uid", ok_uid),))] > 0
    assert got[("tensorgate_miner_decode_tokens_per_second_count", (("uid", bad_uid),))] == 0  # garbage: no rate
    # what clients saw (issue 41): by the model asked for, organic only, in the GenAI conventions' names
    model = (("gen_ai_request_model", "tensorgate/sim-5090"),)
    answered = statuses.count(200)
    assert answered >= 1
    for name in ("gen_ai_server_time_to_first_token_seconds", "gen_ai_server_request_duration_seconds"):
        assert got[(f"{name}_count", model)] == answered
        assert got[(f"{name}_sum", model)] > 0
    assert got[("gen_ai_server_request_duration_seconds_sum", model)] >= \
        got[("gen_ai_server_time_to_first_token_seconds_sum", model)]
    usage = {kind: got[("gen_ai_client_token_usage_total", (("gen_ai_request_model", "tensorgate/sim-5090"),
                                                            ("gen_ai_token_type", kind), ("key", "alice")))]
             for kind in ("input", "output")}
    assert usage["output"] == 3 * answered and usage["input"] > 0
    assert got[("process_cpu_seconds_total", ())] > 0 and got[("process_resident_memory_bytes", ())] > 0
    lease = h.router.acquire_uid(int(ok_uid))  # a probe: the validator's own request, not a client's
    assert lease is not None
    probed = await h.upstream.probe(lease, body(max_tokens=3))
    h.router.release(lease, served=probed.ok)
    async with h.client.get(h.base_url + "/metrics") as r:
        again = _samples(await r.text())
    assert probed.ok and again[("tensorgate_miner_ok_total", (("uid", ok_uid),))] == served + 1
    for name in ("gen_ai_server_time_to_first_token_seconds_count", "gen_ai_server_request_duration_seconds_count"):
        assert again[(name, model)] == answered  # clients' series: the probe is not in them


def _call(app: Gateway, client: str, headers: list[tuple[bytes, bytes]]) -> Any:
    scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": "/metrics",
             "headers": [(b"host", b"gw"), *headers], "client": (client, 0)}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    async def run() -> int:
        await app(scope, receive, send)
        return int(sent[0]["status"])

    return run()


async def test_metrics_are_the_operators_a_key_of_their_own_or_loopback_only() -> None:
    def app(env: dict[str, str]) -> Gateway:
        upstream = Upstream(MinerClient(), RequestSigner(Keypair.create_from_uri("//Alice")), MeasurementQueue())
        cfg = GatewayConfig.from_sources(keys=["sk-client"], env=env, freeze_heap=False)
        return Gateway(cfg, Router(rng=random.Random(0)), upstream)

    open_app = app({})
    assert await _call(open_app, "127.0.0.1", []) == 200
    assert await _call(open_app, "10.1.2.3", [(b"authorization", b"Bearer sk-client")]) == 403  # a client key: no
    keyed = app({"TENSORGATE_METRICS_KEY": "m-secret"})
    assert await _call(keyed, "10.1.2.3", [(b"authorization", b"Bearer m-secret")]) == 200
    assert await _call(keyed, "127.0.0.1", []) == 401  # with a key set, loopback needs it too
    assert await _call(keyed, "10.1.2.3", [(b"authorization", b"Bearer sk-client")]) == 401


async def test_the_validators_families_show_audits_and_a_quarantine(tmp_path) -> None:
    from neurons.keys import dev_keypair
    from neurons.validator.build import build_validator
    from neurons.validator.config import ValidatorConfig
    from neurons.validator.metrics import validator_families
    from tests.test_validator import FakeChain

    v = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0, audit_model="toy"), FakeChain([]),
                        dev_keypair("Alice"))
    assert v.auditor is not None
    v.auditor.counts["failed"] += 2
    v.auditor.book.record("hk-cheat", passed=False, at=1.0)
    v.auditor.book.record("hk-cheat", passed=False, at=2.0)
    v.auditor.book.record("hk-shift", passed=True, at=3.0, positions=200, misses=30)  # the sequential test alarms
    await v.sync_metagraph()

    class Families:
        def collect(self) -> list[Metric]:
            return list(validator_families(v))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    got = _samples(generate_latest(registry).decode())
    assert got[("tensorgate_audits_total", (("outcome", "failed"),))] == 2
    assert got[("tensorgate_quarantined_miners", ())] == 2
    assert got[("tensorgate_sequential_alarms_total", (("hotkey", "hk-shift"),))] == 1
    assert got[("tensorgate_metagraph_age_seconds", ())] < 60


def test_buckets_count_by_upper_bound_cumulatively_and_ignore_non_measurements() -> None:
    from gateway.buckets import Buckets

    b = Buckets((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 2.0, float("nan"), -1.0, float("inf")):
        b.observe(x)
    assert b.cumulative() == [("0.1", 2.0), ("1", 3.0), ("+Inf", 4.0)] and b.count == 4
    assert b.total == 0.05 + 0.1 + 0.5 + 2.0
