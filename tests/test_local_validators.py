"""The local subnet with several validators (issue 57): their own keys, stakes, state and gateways, the miners
shared, the traffic split, and the chain's Yuma 3 epoch over their weights, read back through the SDK."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import pytest

from neurons import weights as weights_cmd
from neurons.local_subnet import run_local_subnet
from neurons.validator.config import parse_args

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 8  # with three validators splitting the traffic, the first weights come after round 4 or 5


def readme_command() -> list[str]:
    """The README's command with several validators, as given (after ``python``)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "neurons.validator --local --local.validators" in ln)
    return shlex.split(line.strip())[1:]


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The README's command (stakes 50/30/20 %, traffic 0/30/70 %, eight rounds) run as given, in compressed time
    (5-second rounds, an epoch a round) and on free ports: its state directory and log."""
    from loguru import logger

    state = tmp_path_factory.mktemp("three")
    argv = readme_command()
    assert argv[:2] == ["-m", "neurons.validator"], argv
    cfg = parse_args([*argv[2:], "--state-dir", str(state), "--gateway.port", "0", "--local.round-seconds", "5",
                      "--local.block-time", "0.25", "--local.traffic-rps", "4", "--probes.per-round", "1",
                      "--seed", "11"])
    assert (cfg.local_validators, cfg.local_stakes, cfg.local_traffic_split) == (3, [50, 30, 20], [0, 30, 70])
    assert cfg.local_rounds == ROUNDS
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO", format="{message}")
    try:
        assert asyncio.run(run_local_subnet(cfg, seed=11)) == 0
    finally:
        logger.remove(sink)
    return state, "".join(lines)


def _chain(state: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert weights_cmd.main(["--state-dir", str(state), "--netuid", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_three_validators_set_weights_that_the_chains_epoch_turns_into_vtrust_and_incentive(
        three: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    state, log = three
    doc = _chain(state, capsys)
    epoch = doc["epoch"]
    validators = {v["uid"]: v for v in epoch["validators"]}
    assert sorted(validators) == [0, 1, 2]
    stakes = [validators[u]["stake"] for u in range(3)]
    assert [s / sum(stakes) for s in stakes] == pytest.approx([0.5, 0.3, 0.2])
    setters = {row["validator_uid"] for row in doc["weights"]}
    # the validators with users set weights; the one without has nothing to pay for today (issue 61's baseline)
    assert setters & {1, 2} and 0 not in setters, setters
    paid = [u for u in (1, 2) if validators[u]["validator_trust"] > 0 and validators[u]["dividends"] > 0]
    assert paid and validators[0]["validator_trust"] == 0, validators
    assert sum(v["dividends"] for v in validators.values()) == pytest.approx(1.0, abs=1e-3)
    incentive = {m["uid"]: m["incentive"] for m in epoch["miners"]}
    assert sum(incentive.values()) == pytest.approx(1.0, abs=1e-3)
    assert epoch["block"] > 0
    # the log: a gateway each, lines labelled by validator, the epoch tables, each validator's summary
    assert log.count("gateway: http://") == 3
    assert "epoch at block" in log and "vtrust" in log and "incentive" in log
    assert "validator uid 0 (stake 50%, traffic 0%):" in log and "validator uid 2 (stake 20%, traffic 70%):" in log
    assert "the chain's last epoch at block" in log
    # each validator keeps its own state beside the chain's
    assert (state / "validator.sqlite").exists()
    assert all((state / f"validator-{i}" / "validator.sqlite").exists() for i in (2, 3))


@pytest.mark.parametrize("argv, said", [
    (["--local.validators", "3", "--local.stakes", "50,50"], "--local.stakes gives 2 shares for 3 validators"),
    (["--local.validators", "2", "--local.traffic", "10,20,70"], "--local.traffic gives 3 shares for 2 validators"),
    (["--local.validators", "2", "--local.stakes", "0,0"], "every stake is 0"),
    (["--local.stakes", "50,abc"], "comma-separated percentages"),
    (["--local.stakes", "150"], "within [0, 100]"),
    (["--local.validators", "9"], "must be within [1, 8]"),
    (["--local.validators", "2", "--gateway.workers", "2", "--redis.url", "redis://127.0.0.1:1/0"],
     "without --gateway.workers and --redis.url"),
])
def test_bad_validator_settings_are_refused_in_one_line(argv: list[str], said: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--local", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
