"""A local run's state directory is reused only by the same lineup of miners (``neurons.local_subnet.lineup``).

The local miners sign with the same development keys whatever they run: after the README's real-model run with a
cheat, the simulated main job's honest ``Miner3`` started quarantined and ended at weight 0. Another lineup now
sets the earlier state aside (renamed, nothing deleted) and starts fresh; the same lineup keeps it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from neurons.local_subnet import local_config, start_local_subnet, stop_local_subnet
from neurons.local_subnet.lineup import LINEUP_FILE, LineupRecordError, claim_state_dir, lineup_of
from neurons.validator.config import ValidatorConfig

NOW = 1_796_000_000.0


def _sim(state: Path) -> ValidatorConfig:
    return ValidatorConfig(local=True, state_dir=state, gateway_port=0, local_round_s=5.0, local_block_time=0.25,
                           local_miners=3, seed=7)


def _real_with_a_cheat(state: Path) -> ValidatorConfig:
    return replace(_sim(state), local_runtime="real", local_miners=2, local_cheats=["random"])


def test_the_real_run_with_a_cheat_and_the_main_job_are_different_lineups(tmp_path: Path) -> None:
    sim, real = lineup_of(local_config(_sim(tmp_path))), lineup_of(local_config(_real_with_a_cheat(tmp_path)))
    assert sim == lineup_of(local_config(_sim(tmp_path)))  # the same flags: the same lineup
    assert sim != real
    assert [m["runs"] for m in sim["miners"]] == ["rtx5090", "rtx5090", "rtx5090-slow"]
    assert real["miners"][2] == {"key": "Miner3", "runs": "cheat: random", "model": None}
    assert lineup_of(local_config(replace(_sim(tmp_path), local_miners=4))) != sim  # Miner3 no longer the slow card


def test_the_same_lineup_keeps_its_state(tmp_path: Path) -> None:
    state, lineup = tmp_path / "local", lineup_of(local_config(_sim(tmp_path)))
    assert claim_state_dir(state, lineup, now=NOW) is None  # a fresh directory
    (state / "validator.sqlite").write_bytes(b"rounds")
    assert claim_state_dir(state, lineup, now=NOW + 60) is None
    assert (state / "validator.sqlite").read_bytes() == b"rounds"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]


def test_another_lineup_sets_the_state_aside_and_loses_nothing(tmp_path: Path) -> None:
    state = tmp_path / "local"
    real, sim = lineup_of(local_config(_real_with_a_cheat(tmp_path))), lineup_of(local_config(_sim(tmp_path)))
    claim_state_dir(state, real, now=NOW)
    (state / "validator.sqlite").write_bytes(b"Miner3 quarantined")
    (state / "chain").mkdir()
    moved = claim_state_dir(state, sim, now=NOW)
    assert moved is not None and moved.parent == tmp_path and moved.name.startswith("local.")
    assert (moved / "validator.sqlite").read_bytes() == b"Miner3 quarantined" and (moved / "chain").is_dir()
    assert json.loads((moved / LINEUP_FILE).read_text()) == real
    assert sorted(p.name for p in state.iterdir()) == [LINEUP_FILE]
    assert json.loads((state / LINEUP_FILE).read_text()) == sim
    again = claim_state_dir(state, real, now=NOW)  # back in the same second: a second name, the first kept
    assert again is not None and again != moved and moved.is_dir()


def test_state_without_a_lineup_record_is_taken_as_it_is(tmp_path: Path) -> None:
    """A directory from before lineups were recorded (or made by hand) stays where it is, so what is in it is checked
    as before: a corrupt file still stops the run with its clear error (tests/test_validator.py,
    tests/test_chain_local.py) instead of being moved out of sight."""
    state, sim = tmp_path / "local", lineup_of(local_config(_sim(tmp_path)))
    state.mkdir()
    (state / "validator.sqlite").write_bytes(b"old")
    assert claim_state_dir(state, sim, now=NOW) is None
    assert (state / "validator.sqlite").read_bytes() == b"old"
    assert json.loads((state / LINEUP_FILE).read_text()) == sim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]


async def test_the_local_subnet_starts_fresh_after_another_lineup(tmp_path: Path) -> None:
    state = tmp_path / "local"
    claim_state_dir(state, lineup_of(local_config(_real_with_a_cheat(state))), now=NOW)
    (state / "validator.sqlite").write_bytes(b"not this lineup's")
    subnet = await start_local_subnet(_sim(state), seed=7)
    try:
        assert [label for _, _, label in subnet.miners] == ["rtx5090", "rtx5090", "rtx5090-slow"]
    finally:
        await stop_local_subnet(subnet)
    _assert_set_aside_once(tmp_path, state)


def _assert_set_aside_once(parent: Path, state: Path) -> None:
    aside = [p for p in parent.iterdir() if p.name.startswith("local.")]
    assert len(aside) == 1 and (aside[0] / "validator.sqlite").read_bytes() == b"not this lineup's"
    assert json.loads((state / LINEUP_FILE).read_text()) == lineup_of(local_config(_sim(state)))


def test_a_lineup_record_that_is_no_record_is_one_line_and_exit_2(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56: 100,000 nested brackets and a directory were tracebacks, a FIFO hung the start."""
    from neurons.validator.cli import main

    for i, make in enumerate((lambda p: p.write_text("[" * 100_000), lambda p: p.mkdir(),
                              lambda p: p.write_text('"a string"'))):
        state = tmp_path / f"s{i}"
        state.mkdir()
        make(state / LINEUP_FILE)
        assert main(["--local", "--local.rounds", "1", "--state-dir", str(state), "--gateway.port", "0"]) == 2
        err = capsys.readouterr().err
        assert "local lineup record" in err and "move it aside" in err and "Traceback" not in err, err[-2000:]
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LINEUP_FILE)
    failed: list[BaseException] = []
    reader = threading.Thread(target=lambda: _claim_into(fifo, failed), daemon=True)
    reader.start()
    reader.join(10.0)
    if reader.is_alive():  # the old code blocks on open(): unblock it, so the test fails instead of hanging
        with open(fifo / LINEUP_FILE, "w"):
            pass
    assert not reader.is_alive() and len(failed) == 1 and isinstance(failed[0], LineupRecordError), failed


def _claim_into(state: Path, failed: list[BaseException]) -> None:
    try:
        claim_state_dir(state, lineup_of(_sim(state)), now=NOW)
    except BaseException as e:  # noqa: BLE001 - the test reads what was raised
        failed.append(e)


def test_an_unreachable_miner_url_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neurons.validator.cli import main
    from tests.redis_server import free_port

    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["--local", "--local.rounds", "1", "--state-dir", str(tmp_path), "--gateway.port", "0",
                 "--local.miner-url", url]) == 2
    err = capsys.readouterr().err
    assert f"--local.miner-url {url}: no miner answers GET /health" in err and "Traceback" not in err, err[-2000:]
