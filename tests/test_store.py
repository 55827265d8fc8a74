"""The SQLite scoring state: round trip, corrupt / newer files reported, and crash safety."""

from __future__ import annotations

import dataclasses
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scoring.store import (
    DEFAULT_FILENAME,
    SCHEMA_VERSION,
    CorruptStateError,
    NewerSchemaError,
    ScoreStore,
    StoredMiner,
    StoredRound,
)

REPO = Path(__file__).resolve().parents[1]


def make_round(idx: int, n: int = 3, at: float = 1000.0) -> StoredRound:
    miners = [
        StoredMiner(hotkey=f"hk{i}", uid=i, score=(i + idx) % 10 / 10, requests=10 + i, measured=9 + i,
                    credit_sum=1.5 * i, ttft_p50=0.2 + i / 100, ttft_p95=None if i == 0 else 0.4,
                    failures={"timeout": i} if i else {}, work_s=2.5 * i, value=0.01 * i, unverified=0.1 * i,
                    audits_passed=i, audits_failed=i % 2, quarantined=i == 2, unmeasured=i == 1,
                    capacity=None if i == 0 else 0.25 * i)
        for i in range(n)
    ]
    return StoredRound(idx, at + idx, miners)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state" / "v.sqlite"
    with ScoreStore(path) as st:
        assert st.next_round_index() == 1
        assert st.load_rounds(12) == []
        assert st.last_round_at() is None
        assert st.routing_credits() == ({}, None)
        assert st.last_weights() is None and st.last_weights_block() is None
        for i in range(1, 5):
            st.save_round(make_round(i), routing={"hk0": 0.1 * i, "hk1": 0.5}, routing_uids={"hk0": 0})
        st.record_weights(123, {0: 0.25, 2: 0.75}, at=5000.0)
    with ScoreStore(path) as st:
        assert st.next_round_index() == 5
        rounds = st.load_rounds(3)
        assert [r.index for r in rounds] == [2, 3, 4]
        assert rounds == [make_round(i) for i in (2, 3, 4)]
        assert rounds[-1].scores() == {"hk0": 0.4, "hk1": 0.5, "hk2": 0.6}
        assert st.last_round_at() == pytest.approx(1004.0)
        routing, at = st.routing_credits()
        assert routing == {"hk0": pytest.approx(0.4), "hk1": 0.5}
        assert at == pytest.approx(1004.0)
        w = st.last_weights()
        assert w is not None and (w.block, w.at, w.weights) == (123, 5000.0, {0: 0.25, 2: 0.75})
        assert st.last_weights_block() == 123
        assert st._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert st._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_directory_path_uses_default_file(tmp_path: Path) -> None:
    with ScoreStore(tmp_path) as st:
        st.save_round(make_round(1), routing={})
    assert (tmp_path / DEFAULT_FILENAME).exists()
    with ScoreStore(tmp_path / DEFAULT_FILENAME) as st:
        assert [r.index for r in st.load_rounds(5)] == [1]


def test_history_is_pruned_to_keep_rounds(tmp_path: Path) -> None:
    with ScoreStore(tmp_path / "s.sqlite", keep_rounds=3) as st:
        for i in range(1, 8):
            st.save_round(make_round(i), routing={})
        assert [r.index for r in st.load_rounds(100)] == [5, 6, 7]
        n = st._conn.execute("SELECT COUNT(*) FROM round_miners").fetchone()[0]
        assert n == 3 * 3  # cascaded with their rounds


def test_failed_save_changes_nothing(tmp_path: Path) -> None:
    with ScoreStore(tmp_path / "s.sqlite") as st:
        st.save_round(make_round(1), routing={"hk0": 0.9})
        with pytest.raises(sqlite3.IntegrityError):
            st.save_round(make_round(1), routing={"other": 0.1})  # duplicate index
        assert st.routing_credits()[0] == {"hk0": 0.9}
        assert [r.index for r in st.load_rounds(5)] == [1]
        assert not st._conn.in_transaction


def test_garbage_file_is_reported_not_reset(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    junk = bytes(range(256)) * 64
    path.write_bytes(junk)
    with pytest.raises(CorruptStateError) as ei:
        ScoreStore(path)
    msg = str(ei.value)
    assert str(path) in msg and "aside" in msg
    assert ei.value.path == path
    assert path.read_bytes() == junk  # never silently reset


def test_damaged_database_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with ScoreStore(path) as st:
        for i in range(1, 40):
            st.save_round(make_round(i, n=20), routing={})
    data = bytearray(path.read_bytes())
    assert len(data) > 8192
    page = 4096
    data[page + 8: 3 * page] = b"\xa5" * (2 * page - 8)  # scribble over interior pages, keep the header
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError) as ei:
        ScoreStore(path)
    assert str(path) in str(ei.value)


def test_foreign_sqlite_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE photos (id INTEGER)")
    c.commit()
    c.close()
    with pytest.raises(CorruptStateError, match="unknown tables"):
        ScoreStore(path)


def test_missing_tables_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    ScoreStore(path).close()
    c = sqlite3.connect(path)
    c.execute("DROP TABLE routing")
    c.commit()
    c.close()
    with pytest.raises(CorruptStateError, match="missing"):
        ScoreStore(path)


def test_newer_schema_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with ScoreStore(path) as st:
        st.save_round(make_round(1), routing={})
    c = sqlite3.connect(path)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.commit()
    c.close()
    with pytest.raises(NewerSchemaError) as ei:
        ScoreStore(path)
    msg = str(ei.value)
    assert str(path) in msg and str(SCHEMA_VERSION + 1) in msg and "newer" in msg
    # The file is untouched: the newer release can still read it.
    c = sqlite3.connect(path)
    assert c.execute("SELECT COUNT(*) FROM rounds").fetchone()[0] == 1
    c.close()


def test_malformed_stored_value_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with ScoreStore(path) as st:
        st.save_round(make_round(1), routing={})
        st._conn.execute("UPDATE round_miners SET failures = 'not json' WHERE hotkey = 'hk1'")
        with pytest.raises(CorruptStateError, match="malformed"):
            st.load_rounds(5)


def _run(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_kill_9_mid_transaction_loses_only_that_round(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    code = f"""
        import os, signal
        from tests.test_store import make_round
        from scoring.store import ScoreStore
        st = ScoreStore({str(path)!r})
        for i in range(1, 4):
            st.save_round(make_round(i), routing={{"hk0": float(i)}})
        def trace(sql):
            if sql.startswith("INSERT INTO round_miners"):
                os.kill(os.getpid(), signal.SIGKILL)   # the round header is written, its miners are not
        st._conn.set_trace_callback(trace)
        st.save_round(make_round(4), routing={{"hk0": 4.0}})
        print("not killed")
    """
    proc = _run(code)
    assert proc.returncode == -9, proc.stderr
    assert "not killed" not in proc.stdout
    with ScoreStore(path) as st:
        assert [r.index for r in st.load_rounds(12)] == [1, 2, 3]
        assert st.load_rounds(12) == [make_round(i) for i in (1, 2, 3)]
        assert st.routing_credits() == ({"hk0": 3.0}, pytest.approx(1003.0))
        assert st.next_round_index() == 4


def test_kill_9_at_a_random_moment_keeps_every_committed_round_whole(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    code = f"""
        import sys
        from tests.test_store import make_round
        from scoring.store import ScoreStore
        st = ScoreStore({str(path)!r}, keep_rounds=100_000)
        for i in range(1, 20_001):
            st.save_round(make_round(i, n=25), routing={{"hk0": float(i)}})
            print(i, flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        seen = 0
        assert proc.stdout is not None
        while seen < 8 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen = int(line)
        assert seen >= 8, proc.stderr.read() if proc.stderr else ""
        proc.kill()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    assert proc.returncode == -9
    with ScoreStore(path) as st:
        rounds = st.load_rounds(100_000)
        last = rounds[-1].index
        assert last >= seen  # everything reported committed survived
        assert [r.index for r in rounds] == list(range(1, last + 1))
        for r in rounds:
            assert r == make_round(r.index, n=25)
        assert st.routing_credits()[0] == {"hk0": float(last)}  # routing matches the last whole round


def test_audits_and_strikes_round_trip_and_are_bounded(tmp_path: Path) -> None:
    from scoring.store import StoredAudit

    path = tmp_path / "v.sqlite"
    with ScoreStore(path, keep_audits=5) as st:
        assert st.load_strikes() == {} and st.recent_audits(10) == []
        rows = [StoredAudit(float(i), f"hk{i % 2}", i % 2, i % 3 == 0, i % 4 != 0, None if i % 4 else "wrong_tokens",
                            "d" * 600, 10 + i) for i in range(8)]
        st.save_audits(rows[:4], {"hk0": {"recent": [1, 0], "quarantined_at": None, "clean_run": 0}})
        st.save_audits(rows[4:], {"hk0": {"recent": [0, 0], "quarantined_at": 7.0, "clean_run": 0}})
    with ScoreStore(path) as st:
        kept = st.recent_audits(100)
        assert [a.at for a in kept] == [3.0, 4.0, 5.0, 6.0, 7.0]  # the last keep_audits, oldest first
        assert kept[1].failure == "wrong_tokens" and not kept[1].passed and kept[2].passed
        assert len(kept[0].detail) == 500  # details are capped
        assert [a.at for a in st.recent_audits(100, hotkey="hk1")] == [3.0, 5.0, 7.0]
        assert st.load_strikes() == {"hk0": {"recent": [0, 0], "quarantined_at": 7.0, "clean_run": 0}}


@pytest.mark.parametrize("old", [1, 2, 3, 4, 5])
def test_an_older_file_is_migrated_without_losing_rounds(tmp_path: Path, old: int) -> None:
    path = tmp_path / "v.sqlite"
    with ScoreStore(path) as st:
        st.save_round(make_round(1), routing={"hk0": 0.3})
        st._conn.execute("ALTER TABLE round_miners DROP COLUMN unmeasured")  # what schema 5 looks like
        st._conn.execute("ALTER TABLE round_miners DROP COLUMN capacity")
        # rounds stored before schema 6 read as measured, with no reading
        kept5 = [dataclasses.replace(m, unmeasured=False, capacity=None) for m in make_round(1).miners]
        if old == 5:
            st._conn.execute("PRAGMA user_version = 5")
            st.close()
            with ScoreStore(path) as again:
                assert again.load_rounds(5) == [dataclasses.replace(make_round(1), miners=kept5)]
                assert again._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
            return
        st._conn.execute("DROP TABLE intake")  # what schema 4 looks like
        st._conn.execute("DROP TABLE counted")
        if old == 4:
            st._conn.execute("PRAGMA user_version = 4")
            st.close()
            with ScoreStore(path) as again:
                assert again.load_rounds(5) == [dataclasses.replace(make_round(1), miners=kept5)]
                assert again.taken_in() == []
                assert again.counted_refs() == set()
            return
        for column in ("unverified", "audits_passed", "audits_failed", "quarantined"):  # what schema 3 looks like
            st._conn.execute(f"ALTER TABLE round_miners DROP COLUMN {column}")
        if old <= 2:
            st._conn.execute("ALTER TABLE round_miners DROP COLUMN work_s")  # what schema 2 looks like
            st._conn.execute("ALTER TABLE round_miners DROP COLUMN value")
            st._conn.execute("DROP TABLE key_usage")
        if old == 1:
            st._conn.execute("DROP TABLE audits")  # and schema 1
        st._conn.execute(f"PRAGMA user_version = {old}")
    with ScoreStore(path) as st:
        assert st._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
        # schema 3 rounds keep their value, all of it verified (as it was paid); older rounds are worth 0
        kept = [dataclasses.replace(m, unverified=0.0, audits_passed=0, audits_failed=0, quarantined=False,
                                    unmeasured=False, capacity=None,
                                    work_s=m.work_s if old == 3 else 0.0, value=m.value if old == 3 else 0.0)
                for m in make_round(1).miners]
        assert st.load_rounds(5) == [dataclasses.replace(make_round(1), miners=kept)]
        assert st.recent_audits(5) == []


def test_an_empty_state_file_is_refused_not_restarted(tmp_path: Path) -> None:
    path = tmp_path / "v.sqlite"
    path.write_bytes(b"")  # a truncated copy: SQLite alone would call it a new, empty database
    with pytest.raises(CorruptStateError, match="empty"):
        ScoreStore(path)
    assert path.read_bytes() == b""  # left as it was for the operator


async def test_a_directory_in_place_of_the_state_file_is_refused(tmp_path: Path) -> None:
    from neurons.keys import dev_keypair
    from neurons.validator.build import build_parts
    from neurons.validator.config import ValidatorConfig
    from neurons.validator.neuron import Validator

    (tmp_path / "validator.sqlite").mkdir()
    cfg = ValidatorConfig(state_dir=tmp_path, gateway_port=0)
    v = Validator(cfg, chain=None, parts=build_parts(cfg, dev_keypair("Alice")))  # type: ignore[arg-type]
    with pytest.raises(CorruptStateError, match="directory"):
        await v.open_state()
    assert not (tmp_path / "validator.sqlite" / "scoring.sqlite").exists()


def test_the_migration_ladder_is_one_row_a_version() -> None:
    """The ladder is data (issue 59): rungs 2..SCHEMA_VERSION in order, each with its script and its purpose; the
    tables a file must hold are schema 1's and the rungs'."""
    from scoring.store_schema import MIGRATIONS, TABLES

    assert [m.to for m in MIGRATIONS] == list(range(2, SCHEMA_VERSION + 1))
    assert all(m.script.strip() and m.what for m in MIGRATIONS)
    assert {"audits", "key_usage", "intake", "counted"} <= TABLES
