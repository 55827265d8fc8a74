"""The validator's own logic: candidate filtering, probe plans, prompts, supervision, weight setting."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest

from gateway.protocol.tokens import estimate_prompt_tokens
from neurons.chain.base import ChainParams, NeuronInfo, WeightsOutcome
from neurons.keys import dev_keypair
from neurons.supervise import every, supervise
from neurons.validator.build import build_validator
from neurons.validator.config import ValidatorConfig, parse_args
from neurons.validator.neuron import Validator, candidates
from neurons.validator.probes import plan_round
from neurons.validator.prompts import PromptGenerator


def _n(uid: int, hotkey: str, *, endpoint: str | None = "127.0.0.1:1", permit: bool = False,
       vtrust: float = 0.0, stake: float = 0.0) -> NeuronInfo:
    return NeuronInfo(uid=uid, hotkey=hotkey, endpoint=endpoint, validator_permit=permit,
                      validator_trust=vtrust, stake=stake)


def test_candidates_exclude_self_validators_and_endpointless() -> None:
    neurons = [
        _n(0, "me", permit=True, stake=5000.0),
        _n(1, "miner-a"),
        _n(2, "miner-b", permit=True),  # small subnet: a permit alone does not make a validator
        _n(3, "other-vali", permit=True, vtrust=0.4),
        _n(4, "big-stake", permit=True, stake=2000.0),
        _n(5, "no-endpoint", endpoint=None),
    ]
    got = {c.uid for c in candidates(neurons, "me", min_validator_stake=1000.0)}
    assert got == {1, 2}


def test_probe_plan_covers_every_miner_inside_the_round() -> None:
    rng = random.Random(3)
    plan = plan_round([1, 2, 3, 4], per_miner=3, round_s=100.0, rng=rng)
    assert Counter(uid for _, uid in plan) == {1: 3, 2: 3, 3: 3, 4: 3}
    offsets = [o for o, _ in plan]
    assert offsets == sorted(offsets)
    assert all(0.0 <= o <= 90.0 for o in offsets)
    # Random moments, not a fixed grid a miner could learn: offsets differ between rounds.
    again = plan_round([1, 2, 3, 4], per_miner=3, round_s=100.0, rng=rng)
    assert [o for o, _ in again] != offsets


def test_prompt_generator_spans_a_sentence_to_thousands_of_tokens() -> None:
    gen = PromptGenerator(random.Random(11))
    payloads = [gen.payload("m") for _ in range(600)]
    sizes = [estimate_prompt_tokens(p["messages"]) for p in payloads]
    assert min(sizes) < 40
    assert max(sizes) > 1500
    assert sum(s > 400 for s in sizes) > 60  # a real tail of long prompts
    assert len({p["max_tokens"] for p in payloads}) >= 5
    assert all(p["messages"][-1]["role"] == "user" and p["stream"] is True for p in payloads)
    # Seeded: the same seed gives the same traffic.
    assert PromptGenerator(random.Random(11)).payload("m") == payloads[0]


async def test_supervised_task_is_restarted_after_a_crash() -> None:
    calls = 0
    done = asyncio.Event()

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise RuntimeError("boom")
        done.set()
        await asyncio.sleep(3600)

    restarts: dict[str, int] = {}
    task = supervise("flaky", flaky, min_backoff_s=0.01, restarts=restarts)
    await asyncio.wait_for(done.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 3
    assert restarts["flaky"] == 2


async def test_a_loop_whose_step_swallowed_the_cancellation_still_stops() -> None:
    """A step that catches the cancellation (as a library can, inside its own call) and returns: the supervised
    ``every`` loop still stops, where it went on for ever before (a validator's stop then waited on it)."""
    steps = 0

    async def swallowing() -> None:
        nonlocal steps
        steps += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return  # what a misbehaving client library does

    task = supervise("swallow", lambda: every(0.01, swallowing), min_backoff_s=0.01)
    while steps == 0:  # noqa: ASYNC110 - waits for the first step to begin
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait({task}, timeout=5)  # before: still stepping after 5 s (each step swallows the next cancel)
    assert task.cancelled() and steps == 1


NET = ["--netuid", "7", "--gateway.model", "org/model", "--audit.off"]  # what a real network needs at the least


def test_cli_flags_in_bittensor_conventions(tmp_path: Path) -> None:
    cfg = parse_args([
        *NET, "--network", "test", "--wallet.name", "vali", "--wallet.hotkey", "hk",
        "--wallet.path", str(tmp_path), "--gateway.port", "9001", "--state-dir", str(tmp_path / "s"),
        "--round.seconds", "60", "--settlement.rounds", "6", "--weights.interval", "50", "--weights.dry-run",
    ])
    assert (cfg.netuid, cfg.network, cfg.wallet_name, cfg.wallet_hotkey) == (7, "test", "vali", "hk")
    assert (cfg.gateway_port, cfg.round_s, cfg.settlement_rounds, cfg.weights_interval_blocks) == (9001, 60.0, 6, 50)
    assert cfg.weights_dry_run and cfg.state_dir == tmp_path / "s"
    assert cfg.gateway_host == "127.0.0.1"  # loopback by default


def test_audit_and_real_mode_flags(tmp_path: Path) -> None:
    cfg = parse_args(["--netuid", "7", "--gateway.model", "org/model", "--audit.model", str(tmp_path / "m.gguf"),
                      "--audit.rate", "0.25", "--audit.queue", "9", "--credit.profile", "cpu-gemma270m",
                      "--probes.mix", "cpu"])
    assert (cfg.audit_model, cfg.audit_rate, cfg.audit_queue) == (str(tmp_path / "m.gguf"), 0.25, 9)
    assert (cfg.credit_profile, cfg.prompt_mix) == ("cpu-gemma270m", "cpu")
    assert parse_args([*NET, "--gateway.drain-seconds", "12"]).drain_s == 12.0
    assert parse_args([*NET, "--gateway.first-byte-budget", "9"]).first_byte_budget_s == 9.0
    from neurons.validator.build import build_parts

    parts = build_parts(ValidatorConfig(drain_s=7.0, first_byte_budget_s=9.0, gateway_port=0), dev_keypair("Alice"))
    assert parts.gateway.config.shutdown_timeout == 7.0 and parts.gateway.config.first_byte_budget_s == 9.0
    real = parse_args(["--local", "--local.runtime", "real", "--local.cheat", "random", "--local.cheat", "hot",
                       "--local.miner-url", "127.0.0.1:8099"])
    assert real.local_cheats == ["random", "hot"] and real.local_miner_urls == ["127.0.0.1:8099"]
    for bad in (["--local", "--local.cheat", "random"],  # cheats need the real model
                ["--local", "--audit.model", "packaged"],  # simulated cards cannot pass an audit
                ["--local.cheat", "nonsense"],
                [*NET[:4], "--audit.model", "toy"]):  # the toy model is only the simulated cards'
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.parametrize(("argv", "says"), [
    (["--gateway.model", "org/model", "--audit.off"], "--netuid is required"),
    (["--netuid", "7", "--audit.off"], "--gateway.model is required"),
    (["--netuid", "7", "--gateway.model", "tensorgate/sim-5090", "--audit.off"], "simulated card"),
    (["--netuid", "7", "--gateway.model", "org/model"], "no reference to verify answers"),
    ([*NET, "--audit.model", "packaged"], "contradict"),
])
def test_a_real_network_needs_its_netuid_model_and_a_reference(argv: list[str], says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Safe defaults where weights are real (issue 23): nothing falls back to the local subnet's stand-ins."""
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    cfg = parse_args(["--netuid", "7", "--gateway.model", "org/model", "--audit.url", "http://127.0.0.1:9"])
    assert (cfg.netuid, cfg.models, cfg.audit_off) == (7, ["org/model"], False)
    local = parse_args(["--local"])  # the local subnet keeps its stand-ins
    assert (local.netuid, local.models, local.audit_model) == (1, ["tensorgate/sim-5090"], "none")


def test_real_mode_moves_defaults_to_the_cpu() -> None:
    from neurons.local_subnet import local_config

    cfg = local_config(ValidatorConfig(local=True, local_runtime="real"))
    assert (cfg.credit_profile, cfg.audit_model, cfg.prompt_mix, cfg.local_miners) == (
        "cpu-gemma270m", "packaged", "cpu", 2)
    assert cfg.models == ["gemma-3-270m-q4_k_m"] and cfg.local_traffic_rps == 0.3
    kept = local_config(ValidatorConfig(local=True, local_runtime="real", credit_profile="/x.json", local_miners=3))
    assert kept.credit_profile == "/x.json" and kept.local_miners == 3  # what the operator chose stays
    sim = local_config(ValidatorConfig(local=True))
    assert (sim.credit_profile, sim.audit_model, sim.prompt_mix) == ("rtx5090", "toy", "gpu")  # audited too


class FakeChain:
    """A scripted Chain for the weights loop: refusals first, then success."""

    netuid = 1

    def __init__(self, outcomes: list[WeightsOutcome]) -> None:
        self.outcomes = outcomes
        self.calls: list[dict[int, float]] = []
        self.height = 1000

    async def block(self) -> int:
        return self.height

    async def metagraph(self) -> list[NeuronInfo]:
        return [_n(0, dev_keypair("Alice").ss58_address, permit=True, stake=1e4), _n(1, "m1"), _n(2, "m2")]

    async def params(self) -> ChainParams:
        return ChainParams(tempo=360, weights_rate_limit=10, commit_reveal=False, max_weight_limit=1.0,
                           min_allowed_weights=1, block_time=12.0)

    async def blocks_since_last_update(self, uid: int) -> int:
        return 100

    async def set_weights(self, weights: dict[int, float]) -> WeightsOutcome:
        self.calls.append(weights)
        return self.outcomes.pop(0)

    async def close(self) -> None:
        return None


async def _validator_with_scores(tmp_path: Path, chain: FakeChain, **cfg_kw: object) -> Validator:
    cfg = ValidatorConfig(state_dir=tmp_path, weights_interval_blocks=100, gateway_port=0,
                          **cfg_kw)  # type: ignore[arg-type]
    v = build_validator(cfg, chain, dev_keypair("Alice"))
    await v.open_state()
    v.hotkey_to_uid = {"m1": 1, "m2": 2, v.hotkey: 0}
    v.my_uid = 0
    v.scorer.settled_values = lambda: {"m1": 0.9, "m2": 0.3}  # type: ignore[method-assign]
    v.rounds_closed = 1
    return v


async def test_weight_failure_is_logged_and_retried_never_fatal(tmp_path: Path) -> None:
    chain = FakeChain([WeightsOutcome(ok=False, message="RATE_LIMITED"), WeightsOutcome(ok=True, message="ok")])
    v = await _validator_with_scores(tmp_path, chain)
    await v.maybe_set_weights()
    assert len(chain.calls) == 1 and not v.weights.history
    chain.height += 1  # next opportunity: retried at once, not after a whole interval
    await v.maybe_set_weights()
    assert len(chain.calls) == 2 and len(v.weights.history) == 1
    block, weights = v.weights.history[0]
    assert block == 1001
    assert weights[1] == pytest.approx(0.75) and weights[2] == pytest.approx(0.25)
    chain.height += 50  # inside the weights interval: nothing is sent
    await v.maybe_set_weights()
    assert len(chain.calls) == 2
    assert v.state.store is not None and v.state.store.last_weights_block() == 1001
    await v.stop()


async def test_a_try_with_nothing_to_set_holds_the_interval_only_until_the_next_round(tmp_path: Path) -> None:
    """The first round with work to pay is paid at once: a try that found every miner at 0 does not make it wait a
    whole interval (a local subnet of a few rounds beside a CPU hog ended with no weights that way)."""
    chain = FakeChain([WeightsOutcome(ok=True, message="ok")])
    v = await _validator_with_scores(tmp_path, chain)
    values = {"m1": 0.0, "m2": 0.0}
    v.scorer.settled_values = lambda: dict(values)  # type: ignore[method-assign]
    await v.maybe_set_weights()  # nothing to set yet
    assert chain.calls == []
    chain.height += 5
    values.update(m1=0.9, m2=0.3)
    await v.maybe_set_weights()  # the same round: the interval holds (one "not setting" line an interval)
    assert chain.calls == []
    v.rounds_closed += 1
    await v.maybe_set_weights()  # a round closed since: set at once, 5 blocks into a 100-block interval
    assert len(chain.calls) == 1 and v.weights.history[0][0] == 1005
    chain.height += 5
    v.rounds_closed += 1
    await v.maybe_set_weights()  # after weights were set, the interval holds whatever the rounds
    assert len(chain.calls) == 1
    await v.stop()


async def test_dry_run_sets_nothing(tmp_path: Path) -> None:
    chain = FakeChain([])
    v = await _validator_with_scores(tmp_path, chain, weights_dry_run=True)
    await v.maybe_set_weights()
    assert chain.calls == [] and not v.weights.history
    await v.stop()


def test_operator_mistakes_exit_2_with_one_clear_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from neurons.validator import main

    assert main([*NET, "--wallet.name", "nope", "--wallet.path", str(tmp_path / "wallets"),
                 "--state-dir", str(tmp_path / "s1")]) == 2
    assert "btcli wallet new-hotkey" in capfd.readouterr().err

    state = tmp_path / "s2"
    state.mkdir()
    (state / "validator.sqlite").write_bytes(b"definitely not sqlite" * 300)
    assert main(["--local", "--state-dir", str(state), "--gateway.port", "0", "--local.rounds", "1"]) == 2
    err = capfd.readouterr().err
    assert "validator.sqlite" in err and "not reset" in err
    assert (state / "validator.sqlite").read_bytes().startswith(b"definitely not sqlite")  # left as it was

    keys = tmp_path / "keys"
    keys.write_text("sk-ok name=a\nsk-typo rpm=sixty\n")
    for path, says in ((keys, "line 2: rpm='sixty' must be a positive integer"), (tmp_path / "none", "cannot read")):
        assert main(["--local", "--state-dir", str(tmp_path / "s3"), "--gateway.port", "0", "--local.rounds", "1",
                     "--gateway.keys-file", str(path)]) == 2
        err = capfd.readouterr().err
        assert says in err and "Traceback" not in err, err


def test_building_a_validator_does_no_io(tmp_path: Path) -> None:
    """Constructors open nothing: the state dir, SQLite and sockets come with start()."""
    state = tmp_path / "not-yet"
    v = build_validator(ValidatorConfig(state_dir=state, gateway_port=0), FakeChain([]), dev_keypair("Alice"))
    assert not state.exists() and v.state.store is None
    with pytest.raises(RuntimeError):
        _ = v.gateway.port  # not listening


async def test_a_round_that_cannot_be_saved_does_not_stop_scoring(tmp_path: Path) -> None:
    v = await _validator_with_scores(tmp_path, FakeChain([]))
    assert v.state.store is not None
    v.state.store.close()  # every write now fails
    entry = await v.close_round()
    assert entry.index == 2 and v.rounds_closed == 2  # the round closed in memory all the same
    v.state.store = None
    await v.stop()


async def test_history_kept_in_memory_is_bounded(tmp_path: Path) -> None:
    from neurons.validator.neuron import RECENT

    v = await _validator_with_scores(tmp_path, FakeChain([]))
    for _ in range(RECENT + 5):
        await v.close_round()
    assert len(v.recent_rounds) == RECENT and v.rounds_closed == RECENT + 6
    await v.stop()


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    from neurons.validator.process import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:  # already at the ceiling (a CI runner may be): lower it to see it raised
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    before, after = raise_open_files_limit()
    now_soft, now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert now_hard == hard and now_soft == after
    assert after == (hard if hard != resource.RLIM_INFINITY else max(before, 1 << 16)) and after >= before


async def test_api_key_usage_of_the_day_survives_a_restart(tmp_path: Path) -> None:
    import time

    from gateway.quota import KeyPolicy, Refusal, Ticket

    policy = KeyPolicy("capped", tpd=1000)
    v = await _validator_with_scores(tmp_path, FakeChain([]))
    ticket = v.gateway.quota.admit(policy, 900, time.time())
    assert isinstance(ticket, Ticket)
    v.gateway.quota.settle(ticket, 900, time.time())
    await v.close_round()  # the day's usage is saved with the round
    await v.stop()
    again = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0), FakeChain([]), dev_keypair("Alice"))
    await again.open_state()
    refused = again.gateway.quota.admit(policy, 200, time.time())
    assert isinstance(refused, Refusal) and refused.limit == "tokens per day"
    await again.stop()


async def test_the_round_in_progress_is_saved_at_stop(tmp_path: Path) -> None:
    """SIGTERM/Ctrl-C end in ``stop``: what the round measured so far is scored and saved, not lost."""
    from gateway.protocol.measurement import Measurement
    from scoring.store import ScoreStore

    v = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0), FakeChain([]), dev_keypair("Alice"))
    await v.open_state()
    v.parts.measurements.record(Measurement(uid=3, hotkey="hk-3", in_flight=0, prompt_tokens=10, max_tokens=32,
                                            ttft_s=0.3, latency_s=0.4, completion_tokens=32, ok=True,
                                            finish_reason="length"))
    await v.stop()
    with ScoreStore(tmp_path / "validator.sqlite") as st:
        rounds = st.load_rounds(5)
    assert len(rounds) == 1 and [m.hotkey for m in rounds[0].miners] == ["hk-3"]
    assert rounds[0].miners[0].work_s > 0 and rounds[0].miners[0].value > 0
    quiet = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0), FakeChain([]), dev_keypair("Alice"))
    await quiet.open_state()
    await quiet.stop()  # nothing measured: no empty round is added
    with ScoreStore(tmp_path / "validator.sqlite") as st:
        assert len(st.load_rounds(5)) == 1


async def test_a_refusal_the_chain_repeats_backs_off_to_one_attempt_an_interval() -> None:
    """Issue 15 item 10: a stale version key must not be retried every block for ever. The weights setter alone: no
    validator, no state file."""
    from neurons.validator.weights_setter import WeightsSetter

    chain = FakeChain([WeightsOutcome(ok=False, message="IncorrectWeightVersionKey")] * 50)
    recorded: list[int] = []

    async def record(block: int, weights: dict[int, float]) -> None:
        recorded.append(block)

    setter = WeightsSetter(chain, hotkey="vali", interval_blocks=100, dry_run=False,
                           weigh=lambda: ({1: 0.75, 2: 0.25}, ""), record=record)
    attempts: list[int] = []
    for _ in range(300):
        before = len(chain.calls)
        await setter.maybe_set(rounds_closed=1, my_uid=0)
        if len(chain.calls) > before:
            attempts.append(chain.height)
        chain.height += 1
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling ...
    assert all(g == 100 for g in gaps[7:]) and gaps[7:]  # ... to one attempt an interval
    assert not setter.history and not recorded and setter.failures == len(attempts)
    chain.outcomes = [WeightsOutcome(ok=True, message="")]
    chain.height = attempts[-1] + 100
    await setter.maybe_set(rounds_closed=1, my_uid=0)  # accepted: recorded, and the refusals forgotten
    assert setter.history[-1] == (chain.height, {1: 0.75, 2: 0.25}) and recorded == [chain.height]
    assert setter.failures == 0 and setter.submitted == 1


async def test_running_without_a_reference_is_said_every_round_and_in_status(tmp_path: Path) -> None:
    """``--audit.off`` (issue 23): the operator chose it, and every round and ``/v1/status`` keep saying so."""
    import aiohttp

    key = "sk-status-test-000"
    (tmp_path / "keys").write_text(key + "\n")
    v = await _validator_with_scores(tmp_path, FakeChain([]), audit_off=True, api_keys_file=str(tmp_path / "keys"))
    await v.gateway.start()
    try:
        for _ in range(2):
            entry = await v.close_round()
            assert "audits: OFF (--audit.off)" in entry.table
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{v.gateway.port}/v1/status",
                                                       headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
            assert (await r.json())["audits"].startswith("off")
    finally:
        await v.stop()
    on = build_validator(ValidatorConfig(state_dir=tmp_path / "on", gateway_port=0, audit_model="toy"), FakeChain([]),
                         dev_keypair("Alice"))
    assert on.gateway.config.audits


async def test_a_keys_claim_on_its_day_is_in_the_state_file_before_its_request_is_served(tmp_path: Path) -> None:
    """Issue 24 item 9: nothing saved at round close (a kill -9), and the next process still refuses the key."""
    import time

    from gateway.quota import KeyPolicy, Refusal, Ticket

    policy = KeyPolicy("capped", tpd=1000)
    v = await _validator_with_scores(tmp_path, FakeChain([]))
    assert v.gateway.hooks.save_usage is not None  # plugged by open_state
    ticket = v.gateway.quota.admit(policy, 900, time.time())
    assert isinstance(ticket, Ticket)
    row = v.gateway.quota.mark_due(policy, ticket)
    assert row is not None
    await v.gateway.hooks.save_usage(row)  # what the gateway awaits before it serves the request
    # killed here: no round closed, no stop
    again = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0), FakeChain([]), dev_keypair("Alice"))
    await again.open_state()
    refused = again.gateway.quota.admit(policy, 200, time.time())
    assert isinstance(refused, Refusal) and refused.limit == "tokens per day"
    await again.stop()
    await v.stop()


def test_a_busy_gateway_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Issue 26: a busy port was a 30-line traceback."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "neurons.validator", "--local", "--local.rounds", "1",
                              "--gateway.port", str(port), "--state-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2, out.stderr[-1000:]
    assert f"ERROR   cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr
    assert "Traceback" not in out.stderr
