"""``python -m neurons.weights``: the weights on chain, read back through the SDK's read path."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from bittensor.sp_core import Keypair

from neurons.chain import LocalChain
from neurons.weights import main

NETUID = 3
VALI = Keypair.create_from_uri("//Alice")
MINERS = [Keypair.create_from_uri(f"//Miner{i}") for i in range(3)]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))


def make_chain(root: Path, **hp: object) -> tuple[LocalChain, list[int]]:
    """A chain laid out the way the local subnet does it: ``<state-dir>/chain``. 12 s blocks: no block
    passes during a test, so nothing reveals behind its back."""
    chain = LocalChain.open(root / "chain", NETUID, VALI, block_time=12.0, weights_rate_limit=1, **hp)
    chain.substrate.register(VALI.ss58_address, VALI.ss58_address, endpoint=None, validator_permit=True, stake=50.0)
    uids = [chain.substrate.register(m.ss58_address, m.ss58_address, endpoint=f"127.0.0.1:{9200 + i}")
            for i, m in enumerate(MINERS)]
    return chain, uids


def test_table_lists_each_weight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain, uids = make_chain(tmp_path)
    try:
        out = asyncio.run(chain.set_weights({uids[0]: 0.6, uids[2]: 0.4}))
        assert out.ok, out.message
        # The writer is still open: the command reads alongside it.
        assert main(["--state-dir", str(tmp_path), "--netuid", str(NETUID)]) == 0
    finally:
        asyncio.run(chain.close())
    text = capsys.readouterr().out
    assert f"netuid {NETUID}" in text and "4 neurons" in text and "commit-reveal off" in text
    lines = [ln.split() for ln in text.splitlines() if ln.strip().startswith("0 ")]
    assert [(int(p[2]), float(p[4])) for p in lines] == [(uids[0], pytest.approx(0.6, abs=1e-3)),
                                                          (uids[2], pytest.approx(0.4, abs=1e-3))]
    assert all(f"block {out.block}" in " ".join(p) for p in lines)
    assert VALI.ss58_address[:6] in text and MINERS[2].ss58_address[:6] in text
    assert "pending commits: 0" in text


def test_json_output_matches_what_was_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain, uids = make_chain(tmp_path)
    want = {uids[0]: 1.0, uids[1]: 2.0, uids[2]: 1.0}

    async def set_and_close() -> bool:
        ok = (await chain.set_weights(want)).ok
        await chain.close()
        return ok

    assert asyncio.run(set_and_close())
    assert main(["--state-dir", str(tmp_path / "chain"), "--netuid", str(NETUID), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["weights"]
    assert {r["validator_uid"] for r in rows} == {0}
    assert {r["miner_uid"]: r["weight"] for r in rows} == pytest.approx({u: w / 4 for u, w in want.items()}, abs=1e-4)
    assert {r["miner_hotkey"] for r in rows} == {m.ss58_address for m in MINERS}
    assert sum(r["weight"] for r in rows) == pytest.approx(1.0)
    assert data["pending_commits"] == [] and data["commit_reveal"] is False


def test_pending_commits_are_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain, uids = make_chain(tmp_path, commit_reveal=True, tempo=360)
    try:
        out = asyncio.run(chain.set_weights({uids[1]: 1.0}))
        assert out.ok and out.commit_reveal, out.message
        assert main(["--state-dir", str(tmp_path), "--netuid", str(NETUID), "--json"]) == 0
    finally:
        asyncio.run(chain.close())
    data = json.loads(capsys.readouterr().out)
    assert data["weights"] == [] and data["commit_reveal"] is True
    [pending] = data["pending_commits"]
    assert pending["validator_uid"] == 0 and pending["hotkey"] == VALI.ss58_address
    assert pending["commit_block"] == out.block and pending["reveal_round"] > 0


def test_missing_state_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state-dir", str(tmp_path / "nothing"), "--netuid", "1"]) == 1
    assert "no local chain" in capsys.readouterr().err


def test_unreachable_network_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--network", f"ws://127.0.0.1:{port}", "--netuid", "1", "--timeout", "10"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_unknown_netuid_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain, _ = make_chain(tmp_path)
    asyncio.run(chain.close())
    assert main(["--state-dir", str(tmp_path), "--netuid", "42"]) == 1
    assert "netuid 42 does not exist" in capsys.readouterr().err


def test_the_table_ends_with_the_last_epoch_after_the_pending_commits(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The pending commits' lines follow their count; the last epoch's Yuma columns close the table."""
    chain, uids = make_chain(tmp_path, commit_reveal=True, tempo=360)
    try:
        assert asyncio.run(chain.set_weights({uids[1]: 1.0})).ok
        assert main(["--state-dir", str(tmp_path), "--netuid", str(NETUID)]) == 0
    finally:
        asyncio.run(chain.close())
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("pending commits: 1"))
    assert "committed at block" in lines[at + 1]
    epoch = next(i for i, line in enumerate(lines) if line.startswith("last epoch at block"))
    assert epoch > at + 1 and any("validator uid 0" in line for line in lines[epoch:])
