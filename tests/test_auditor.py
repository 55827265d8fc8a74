"""The auditor off the hot path, with a scripted reference (the real one is in test_real_model.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest

from gateway.protocol.measurement import Answer, FailureReason, Measurement
from gateway.protocol.sampling import SEED_MAX, SamplingParams
from neurons.validator.auditor import Auditor
from scoring.audit import AuditBands, AuditFailure, StrikeBook, StrikePolicy, Verdict


class ScriptedReference:
    """Verdicts by hotkey: 'cheat' fails, 'boom' raises, 'long' cannot be replayed, others pass."""

    name = "scripted"
    grammars = False

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.seen: list[str] = []

    async def start(self) -> None:
        return None

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        await asyncio.sleep(self.delay)
        hk = answer.messages[0]["content"]
        self.seen.append(hk)
        if hk == "boom":
            raise RuntimeError("reference fell over")
        if hk == "long":
            return None
        if hk == "cheat":
            return Verdict(False, AuditFailure.WRONG_TOKENS, "scripted")
        return Verdict(True, tokens=len(answer.token_ids or ()))

    async def aclose(self) -> None:
        return None


def m(hotkey: str, *, probe: bool = False, ok: bool = True, uid: int = 1) -> Measurement:
    a = Answer(messages=[{"role": "user", "content": hotkey}], sampling=SamplingParams(), max_tokens=8, stop=(),
               text="abc", token_ids=(1, 2, 3), finish_reason="length")
    return Measurement(uid=uid, hotkey=hotkey, in_flight=0, prompt_tokens=4, max_tokens=8, ttft_s=0.1, latency_s=0.3,
                       completion_tokens=9, ok=ok, probe=probe, answer=a if ok else None,
                       failure=None if ok else FailureReason.DROPPED)


async def _settle(auditor: Auditor) -> list[Measurement]:
    task = asyncio.create_task(auditor.run())
    try:
        for _ in range(200):
            if auditor.backlog == 0 and auditor.counts["sampled"] == sum(
                    auditor.counts[k] for k in ("passed", "failed", "unauditable", "errors")):
                break
            await asyncio.sleep(0.01)
        return auditor.ready()
    finally:
        task.cancel()


async def test_probes_always_organic_by_rate_and_verdicts_decide_pay() -> None:
    ref = ScriptedReference()
    auditor = Auditor(ref, AuditBands(), StrikeBook(), rate=0.0, rng=random.Random(1))
    assert auditor.take(m("honest", probe=True))
    assert auditor.take(m("cheat", probe=True, uid=2))
    assert not auditor.take(m("honest", probe=True, ok=False))  # failures have no answer to audit
    done = {x.hotkey: x for x in await _settle(auditor)}
    assert done["honest"].ok and done["honest"].audited and done["honest"].completion_tokens == 3  # verified ids
    assert not done["cheat"].ok and done["cheat"].failure == FailureReason.AUDIT_FAILED
    assert [o.passed for o in auditor.outcomes] == [True, False]


async def test_organic_answers_are_sampled_eagerly_until_one_passes_in_the_round() -> None:
    """A passed organic audit is what releases a hotkey's unaudited pay (scoring.pay.PayWindow): until one
    has passed this round, its organic answers are sampled at EAGER_RATE, then at ``rate``."""
    from neurons.validator.auditor import EAGER_RATE

    auditor = Auditor(ScriptedReference(), AuditBands(), StrikeBook(), rate=0.0, rng=random.Random(2))
    assert auditor.take(m("honest", probe=True))
    await _settle(auditor)
    eager = sum(auditor.take(m("honest")) for _ in range(100))  # a passed probe confirms nothing of users
    assert abs(eager - 100 * EAGER_RATE) <= 20
    await _settle(auditor)
    assert not any(auditor.take(m("honest")) for _ in range(100))  # confirmed: organic at rate 0 from now on
    auditor.new_round()
    assert any(auditor.take(m("honest")) for _ in range(20))  # a new round: eager again until one passes


async def test_reference_trouble_is_never_the_miners() -> None:
    auditor = Auditor(ScriptedReference(), AuditBands(), StrikeBook(), rate=1.0)
    for hk in ("boom", "long"):
        assert auditor.take(m(hk))
    done = await _settle(auditor)
    assert all(x.ok and not x.audited for x in done) and len(done) == 2
    assert auditor.counts["errors"] == 1 and auditor.counts["unauditable"] == 1
    assert not auditor.book.records  # no strike, no pass: nothing was judged
    assert auditor.reference_errors == 0  # the reference answered after failing: errors in a row start over
    for _ in range(3):
        assert auditor.take(m("boom"))
    await _settle(auditor)
    assert auditor.reference_errors == 3 and "fell over" in auditor.reference_error  # what /ready reports


async def test_a_full_queue_pays_unaudited_and_counts_the_drop() -> None:
    auditor = Auditor(ScriptedReference(delay=0.05), AuditBands(), StrikeBook(), rate=1.0, max_queue=2)
    taken = [auditor.take(m("honest")) for _ in range(5)]
    assert taken == [True, True, False, False, False]
    assert auditor.counts["dropped"] == 3 and auditor.counts["sampled"] == 2


async def test_answers_waiting_at_stop_are_handed_back_to_be_paid_as_measured() -> None:
    auditor = Auditor(ScriptedReference(), AuditBands(), StrikeBook(), rate=1.0, max_queue=8)
    held = [m("a"), m("b", probe=True)]
    assert all(auditor.take(x) for x in held)
    assert auditor.abandon() == held and auditor.backlog == 0 and auditor.counts["abandoned"] == 2
    assert auditor.abandon() == []


async def test_strikes_quarantine_and_every_answer_of_a_quarantined_miner_is_audited() -> None:
    auditor = Auditor(ScriptedReference(), AuditBands(), StrikeBook(StrikePolicy(window=5, threshold=2)),
                      rate=0.0)
    for _ in range(2):
        assert auditor.take(m("cheat", probe=True))
    await _settle(auditor)
    assert auditor.book.quarantined() == {"cheat"} and auditor.quarantine_changed
    assert auditor.take(m("cheat"))  # organic, rate 0, but quarantined: audited


async def test_the_gateway_routes_around_a_quarantined_miner(make_gateway: Any, make_miner: Any) -> None:
    """Quarantine reaches routing: through the real gateway, a quarantined miner gets no organic request."""
    from tests.fakes import Script

    honest, cheat = await make_miner(Script("ok"), tag="h-"), await make_miner(Script("ok"), tag="c-")
    h = await make_gateway([honest, cheat])
    assert h.router is not None
    book = StrikeBook(StrikePolicy(window=5, threshold=1))
    book.record(cheat.hotkey, passed=False, at=1.0)
    h.router.set_quarantined(book.quarantined())
    served = set()
    for _ in range(12):
        async with h.chat({"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": 4}) as r:
            assert r.status == 200
            served.add(r.headers["X-Tensorgate-Miner-Uid"])
    assert served == {str(next(x.uid for x in h.router.miners() if x.hotkey == honest.hotkey))}
    async with h.client.get(h.base_url + "/v1/status", headers=h.auth) as r:
        flags = {s["hotkey"]: s["quarantined"] for s in (await r.json())["miners"]}
    assert flags == {honest.hotkey: False, cheat.hotkey: True}


async def test_reference_service_round_trip_key_and_bad_requests() -> None:
    """--audit.url: the same verdicts over HTTP; a bad body is a 400, a missing key a 401, never a crash."""
    import json

    import aiohttp

    from neurons.model.packaged import ModelUnavailable
    from neurons.reference.protocol import AUDIT_PATH, BadAuditRequest, decode_request, encode_request
    from neurons.reference.remote import RemoteReference
    from neurons.reference.server import start_reference_service

    runner, port = await start_reference_service(ScriptedReference(), key="k1")
    url = f"http://127.0.0.1:{port}"
    try:
        ref = RemoteReference(url, key="k1")
        await ref.start()
        try:
            ok = await ref.audit(m("honest").answer, AuditBands())  # type: ignore[arg-type]
            assert ok is not None and ok.passed and ok.tokens == 3
            bad = await ref.audit(m("cheat").answer, AuditBands(z_limit=7.0))  # type: ignore[arg-type]
            assert bad is not None and bad.failure == AuditFailure.WRONG_TOKENS
            assert await ref.audit(m("long").answer, AuditBands()) is None  # type: ignore[arg-type]
        finally:
            await ref.aclose()
        wrong_key = RemoteReference(url, key="nope")
        await wrong_key.start()  # /health needs no key
        try:
            try:
                await wrong_key.audit(m("honest").answer, AuditBands())  # type: ignore[arg-type]
                raise AssertionError("a wrong key was accepted")
            except RuntimeError as e:
                assert "401" in str(e)
        finally:
            await wrong_key.aclose()
        async with aiohttp.ClientSession() as s:
            for body in (b"{", b'{"answer": {"messages": "x"}}', b'{"answer": {"messages": [], "max_tokens": 0}}',
                         b"[" * 5000 + b"]" * 5000):
                async with s.post(url + AUDIT_PATH, data=body, headers={"Authorization": "Bearer k1"}) as r:
                    assert r.status == 400 and "message" in (await r.json())["error"]
            # issue 39 row 9: a lone surrogate (valid JSON, not text) was a 500 from the tokenizer; now a 400
            a0 = m("honest").answer
            assert a0 is not None
            lone = json.loads(encode_request(a0, AuditBands()))
            lone["answer"]["text"] = "ok \ud800"  # json.dumps writes it as the escape a client would send
            async with s.post(url + AUDIT_PATH, data=json.dumps(lone), headers={"Authorization": "Bearer k1"}) as r:
                assert r.status == 400 and "surrogate" in (await r.json())["error"]["message"]
        a = m("honest").answer
        assert a is not None
        assert decode_request(json.loads(encode_request(a, AuditBands(z_limit=5.0)))) == (a, AuditBands(z_limit=5.0))
        seeded = dataclasses.replace(a, sampling=SamplingParams(temperature=0.7, seed=SEED_MAX))
        assert decode_request(json.loads(encode_request(seeded, AuditBands())))[0].sampling.seed == SEED_MAX
        for bad_seed in (-1, 1.5, True, SEED_MAX + 1):
            raw = json.loads(encode_request(seeded, AuditBands()))
            raw["answer"]["seed"] = bad_seed
            with pytest.raises(BadAuditRequest, match="seed"):
                decode_request(raw)
    finally:
        await runner.cleanup()
    gone = RemoteReference(url)
    try:
        await gone.start()
        raise AssertionError("an unreachable service started")
    except ModelUnavailable:
        pass


async def test_reference_service_refuses_to_listen_open_beyond_loopback_and_reads_any_bearer() -> None:
    """Issue 24 item 10: the README started it on 0.0.0.0 with no key; a non-UTF-8 Authorization was a 500 with
    a traceback; ``bearer`` in lower case got 401."""
    import aiohttp

    from gateway.http.server import is_loopback
    from neurons.reference.__main__ import main as reference_main
    from neurons.reference.protocol import AUDIT_PATH, encode_request
    from neurons.reference.server import OpenReferenceRefused, start_reference_service

    for host in ("0.0.0.0", "::", "192.168.1.5", "gpu-box"):
        assert not is_loopback(host)
        with pytest.raises(OpenReferenceRefused, match="TENSORGATE_AUDIT_KEY"):
            await start_reference_service(ScriptedReference(), host=host, key=None)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert await asyncio.to_thread(reference_main, ["--host", "0.0.0.0", "--port", "0"]) == 2  # exits, says why
    # the vLLM reference where vLLM is not installed (the project's venv), or with no model folder: one line, exit 2
    assert await asyncio.to_thread(reference_main, ["--engine", "vllm", "--model", "/nonexistent", "--port", "0"]) == 2
    assert await asyncio.to_thread(reference_main, ["--engine", "vllm", "--port", "0"]) == 2

    runner, port = await start_reference_service(ScriptedReference(), key="k1")
    url = f"http://127.0.0.1:{port}{AUDIT_PATH}"
    a = m("honest").answer
    assert a is not None
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=encode_request(a, AuditBands()), headers={"Authorization": "bearer k1"}) as r:
                assert r.status == 200
            raw = b"Bearer k\xff\xfe"  # not UTF-8: a wrong key, not a crash
            async with s.post(url, data=encode_request(a, AuditBands()),
                              headers={"Authorization": raw.decode("latin-1")}) as r:
                assert r.status == 401
    finally:
        await runner.cleanup()


def test_a_reference_services_reply_with_bad_counts_is_a_reference_error_not_a_crash() -> None:
    """The strike book and pay add the reply's counts up: a count that is not a whole, non-negative number is refused
    (the auditor books a reference error; the miner is paid as measured)."""
    from neurons.reference.protocol import verdict_from_json

    good = verdict_from_json({"verdict": {"passed": True, "tokens": 5, "positions": 5, "misses": 1}})
    assert good is not None and (good.positions, good.misses) == (5, 1)
    for bad in ({"positions": "5"}, {"misses": -1}, {"tokens": 1.5}, {"positions": True},
                {"positions": 2, "misses": 3}):
        with pytest.raises(ValueError):
            verdict_from_json({"verdict": {"passed": True, **bad}})
