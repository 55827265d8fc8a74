"""Durable scoring state in one SQLite file: settlement history, routing credits, last weights.

Why SQLite: each closed round is written in a single transaction (WAL, ``synchronous=FULL``), so a
``kill -9`` at any instant loses at most the round being written, never half of one and never the
history before it. The schema version lives in ``PRAGMA user_version``. A file that cannot be
read raises :class:`CorruptStateError` and a file from a newer release raises
:class:`NewerSchemaError`; both name the path and what to do. State is never reset silently:
losing settlement history changes what miners are paid.

Example::

    store = ScoreStore("/var/lib/tensorgate/validator.sqlite")   # or a directory: <dir>/scoring.sqlite
    idx = store.next_round_index()
    store.save_round(StoredRound(idx, ended_at=time.time(), miners=[StoredMiner("5F...", uid=3, score=0.9)]),
                     routing={"5F...": 0.9})
    store.load_rounds(limit=12)        # oldest first
    store.record_weights(block=4_200_000, weights={3: 1.0})
    store.close()
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from loguru import logger

from scoring.store_schema import MIGRATIONS, SCHEMA, SCHEMA_VERSION, TABLES
from scoring.stored import (
    CorruptStateError,
    NewerSchemaError,
    StateError,
    StoredAudit,
    StoredMiner,
    StoredRound,
    StoredWeights,
)

DEFAULT_FILENAME = "scoring.sqlite"
__all__ = ["SCHEMA_VERSION", "CorruptStateError", "NewerSchemaError", "ScoreStore", "StateError", "StoredAudit",
           "StoredMiner", "StoredRound", "StoredWeights"]  # the records and errors live in scoring.stored


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else 0.0


def _opt_float(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


class ScoreStore:
    """The scoring database: one connection, every call blocking.

    The validator makes every call from one worker thread of its own (never the event loop, where a
    ``synchronous=FULL`` commit would stall every stream), so calls are serialised; the connection is
    opened with ``check_same_thread=False`` because that thread is not the one tests use.

    ``path`` is the database file, or an existing directory (the file is then ``scoring.sqlite``
    in it). ``keep_rounds`` bounds the history kept on disk; only the last window is ever loaded.
    """

    def __init__(self, path: str | Path, *, keep_rounds: int = 2000, keep_audits: int = 100_000) -> None:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / DEFAULT_FILENAME
        p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p
        self.keep_rounds = max(1, keep_rounds)
        self.keep_audits = max(1, keep_audits)
        self._conn = self._open()

    # -- opening ---------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        # SQLite happily treats an empty file as a new database: a state file truncated to 0 bytes (a full
        # disk, a bad copy) would silently restart settlement from nothing, so it is refused instead.
        try:
            if self.path.exists() and self.path.stat().st_size == 0:
                raise CorruptStateError(self.path, "the file is empty (0 bytes): its history is gone")
        except OSError as e:
            raise CorruptStateError(self.path, f"cannot read it ({e})") from e
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=10.0, check_same_thread=False)
        except sqlite3.Error as e:
            raise CorruptStateError(self.path, f"cannot open the database ({e})") from e
        try:
            self._check_and_migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_and_migrate(self, conn: sqlite3.Connection) -> None:
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise NewerSchemaError(self.path, version, SCHEMA_VERSION)
            check = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
            if check != ["ok"]:
                raise CorruptStateError(self.path, f"integrity check failed: {'; '.join(check[:3])}")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as e:
            raise CorruptStateError(self.path, f"not a readable SQLite database ({e})") from e
        if version == 0:
            if tables:
                raise CorruptStateError(
                    self.path, f"an SQLite file with unknown tables {sorted(tables)} and no tensorgate schema"
                )
            with self._tx(conn):
                conn.executescript("BEGIN;" + SCHEMA + "".join(m.script for m in MIGRATIONS)
                                   + f"PRAGMA user_version = {SCHEMA_VERSION};")
            logger.info("scoring state: created {} (schema {})", self.path, SCHEMA_VERSION)
            return
        for m in MIGRATIONS:  # each rung in its own transaction: a kill between two leaves a consistent version
            if version == m.to - 1:
                with self._tx(conn):
                    conn.executescript("BEGIN;" + m.script + f"PRAGMA user_version = {m.to};")
                tables |= m.tables
                logger.info("scoring state: {} migrated from schema {} to {} ({})", self.path, version, m.to, m.what)
                version = m.to
        missing = TABLES - tables
        if missing:
            raise CorruptStateError(self.path, f"schema {version} but tables {sorted(missing)} are missing")

    @contextmanager
    def _tx(self, conn: sqlite3.Connection | None = None, begin: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction: committed on success, rolled back on any exception."""
        c = conn or self._conn
        if begin:
            c.execute("BEGIN IMMEDIATE")
        try:
            yield c
        except BaseException:
            if c.in_transaction:
                c.rollback()
            raise
        else:
            if c.in_transaction:
                c.commit()

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        try:
            yield self._conn
        except sqlite3.DatabaseError as e:
            raise CorruptStateError(self.path, f"unreadable while loading ({e})") from e
        except (ValueError, TypeError) as e:
            raise CorruptStateError(self.path, f"a stored value is malformed ({e})") from e

    # -- rounds ----------------------------------------------------------------------------------

    def next_round_index(self) -> int:
        with self._reading() as c:
            row = c.execute("SELECT MAX(idx) FROM rounds").fetchone()
        return 1 if row[0] is None else int(row[0]) + 1

    def save_round(
        self,
        rnd: StoredRound,
        routing: Mapping[str, float],
        routing_uids: Mapping[str, int] | None = None,
        *,
        intake: Sequence[int] = (),
        counted: Sequence[str] = (),
    ) -> None:
        """Persist one closed round and the routing credits republished with it, atomically.

        ``intake``: the journal ids (:meth:`take_in`) of the measurements the round holds, deleted with it;
        ``counted``: the shared stream's entries it holds, listed with it until :meth:`forget_counted`.
        """
        uids = routing_uids or {}
        rows = [
            (
                rnd.index, m.hotkey, int(m.uid), int(m.requests), int(m.measured), float(m.score),
                float(m.credit_sum), _opt_float(m.ttft_p50), _opt_float(m.ttft_p95),
                json.dumps(dict(m.failures), sort_keys=True), _finite(m.work_s), _finite(m.value),
                _finite(m.unverified), int(m.audits_passed), int(m.audits_failed), int(bool(m.quarantined)),
                int(bool(m.unmeasured)), _opt_float(m.capacity),
            )
            for m in rnd.miners
        ]
        with self._tx(begin=True) as c:
            c.execute("INSERT INTO rounds (idx, ended_at) VALUES (?, ?)", (rnd.index, float(rnd.ended_at)))
            c.executemany(
                "INSERT INTO round_miners (idx, hotkey, uid, requests, measured, score, credit_sum, ttft_p50, "
                "ttft_p95, failures, work_s, value, unverified, audits_passed, audits_failed, quarantined, "
                "unmeasured, capacity) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            c.execute("DELETE FROM routing")
            c.executemany(
                "INSERT INTO routing (hotkey, uid, score) VALUES (?, ?, ?)",
                [(hk, uids.get(hk), float(s)) for hk, s in routing.items()],
            )
            self._set_meta(c, "last_round_at", rnd.ended_at)
            self._set_meta(c, "routing_at", rnd.ended_at)
            c.execute("DELETE FROM rounds WHERE idx <= ?", (rnd.index - self.keep_rounds,))
            c.executemany("DELETE FROM intake WHERE id = ?", [(int(i),) for i in intake])
            c.executemany("INSERT OR IGNORE INTO counted (ref, idx) VALUES (?, ?)",
                          [(str(r), rnd.index) for r in counted])

    def load_rounds(self, limit: int) -> list[StoredRound]:
        """The last ``limit`` rounds, oldest first."""
        with self._reading() as c:
            heads = c.execute("SELECT idx, ended_at FROM rounds ORDER BY idx DESC LIMIT ?", (limit,)).fetchall()
            heads.reverse()
            if not heads:
                return []
            by_idx: dict[int, list[StoredMiner]] = {int(i): [] for i, _ in heads}
            for r in c.execute(
                "SELECT idx, hotkey, uid, requests, measured, score, credit_sum, ttft_p50, ttft_p95, failures, "
                "work_s, value, unverified, audits_passed, audits_failed, quarantined, unmeasured, capacity "
                "FROM round_miners "
                "WHERE idx >= ? ORDER BY idx, rowid",
                (heads[0][0],),
            ):
                failures = json.loads(r[9])
                if not isinstance(failures, dict):
                    raise ValueError(f"failures of round {r[0]} is not a mapping")
                by_idx[int(r[0])].append(
                    StoredMiner(
                        hotkey=str(r[1]), uid=int(r[2]), requests=int(r[3]), measured=int(r[4]),
                        score=float(r[5]), credit_sum=float(r[6]),
                        ttft_p50=None if r[7] is None else float(r[7]),
                        ttft_p95=None if r[8] is None else float(r[8]),
                        failures={str(k): int(v) for k, v in failures.items()},
                        work_s=float(r[10]), value=float(r[11]), unverified=float(r[12]),
                        audits_passed=int(r[13]), audits_failed=int(r[14]), quarantined=bool(r[15]),
                        unmeasured=bool(r[16]), capacity=None if r[17] is None else float(r[17]),
                    )
                )
            return [StoredRound(int(i), float(t), by_idx[int(i)]) for i, t in heads]

    def last_round_at(self) -> float | None:
        v = self._get_meta("last_round_at")
        return None if v is None else float(v)

    def routing_credits(self) -> tuple[dict[str, float], float | None]:
        """The routing credits saved with the last round, and when they were saved."""
        with self._reading() as c:
            scores = {str(hk): float(s) for hk, s in c.execute("SELECT hotkey, score FROM routing")}
        at = self._get_meta("routing_at")
        return scores, (None if at is None else float(at))

    # -- exactly once: the intake journal and the counted stream entries ---------------------------

    def take_in(self, blobs: Sequence[bytes]) -> list[int]:
        """Journal measurements (encoded by the caller) until a saved round holds them; returns their ids."""
        with self._tx(begin=True) as c:
            return [int(c.execute("INSERT INTO intake (m) VALUES (?)", (b,)).lastrowid or 0) for b in blobs]

    def taken_in(self) -> list[tuple[int, bytes]]:
        """The journaled measurements no saved round holds yet, oldest first: what a restart scores again."""
        with self._reading() as c:
            return [(int(i), bytes(b)) for i, b in c.execute("SELECT id, m FROM intake ORDER BY id")]

    def counted_refs(self) -> set[str]:
        """Stream entries saved rounds hold that Redis may not have acknowledged: never to be counted again."""
        with self._reading() as c:
            return {str(r[0]) for r in c.execute("SELECT ref FROM counted")}

    def forget_counted(self, refs: Sequence[str]) -> None:
        """Entries Redis acknowledged: it will not deliver them again."""
        with self._tx(begin=True) as c:
            c.executemany("DELETE FROM counted WHERE ref = ?", [(str(r),) for r in refs])

    # -- audits ----------------------------------------------------------------------------------

    def save_audits(self, audits: list[StoredAudit], strikes: Mapping[str, object]) -> None:
        """Append audit outcomes and replace the strike book, atomically; keeps the last ``keep_audits``."""
        with self._tx(begin=True) as c:
            c.executemany(
                "INSERT INTO audits (at, hotkey, uid, probe, passed, failure, detail, tokens) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(float(a.at), a.hotkey, int(a.uid), int(a.probe), int(a.passed), a.failure, a.detail[:500],
                  int(a.tokens)) for a in audits],
            )
            self._set_meta(c, "strikes", json.dumps(strikes, sort_keys=True))
            c.execute("DELETE FROM audits WHERE id <= (SELECT MAX(id) FROM audits) - ?", (self.keep_audits,))

    def load_strikes(self) -> dict[str, object]:
        """The strike book saved last (empty when none was)."""
        raw = self._get_meta("strikes")
        if raw is None:
            return {}
        with self._reading():
            book = json.loads(raw)
            if not isinstance(book, dict):
                raise ValueError("the strike book is not a mapping")
            return book

    def recent_audits(self, limit: int, hotkey: str | None = None) -> list[StoredAudit]:
        """The last ``limit`` audit outcomes (of one hotkey, or all), oldest first."""
        where, args = ("WHERE hotkey = ? ", (hotkey, limit)) if hotkey else ("", (limit,))
        with self._reading() as c:
            rows = c.execute("SELECT at, hotkey, uid, probe, passed, failure, detail, tokens FROM audits "
                             f"{where}ORDER BY id DESC LIMIT ?", args).fetchall()
        return [StoredAudit(float(r[0]), str(r[1]), int(r[2]), bool(r[3]), bool(r[4]),
                            None if r[5] is None else str(r[5]), str(r[6]), int(r[7])) for r in reversed(rows)]

    # -- weights ---------------------------------------------------------------------------------

    # -- API key usage -----------------------------------------------------------------------------

    def save_key_usage(self, rows: list[tuple[str, str, int, int]]) -> None:
        """``(name, day, requests, tokens)`` per key: the day's totals so far (replacing what was saved)."""
        with self._tx(begin=True) as c:
            c.executemany("INSERT OR REPLACE INTO key_usage (name, day, requests, tokens) VALUES (?, ?, ?, ?)",
                          [(str(n), str(d), int(r), int(t)) for n, d, r, t in rows])

    def load_key_usage(self, day: str) -> list[tuple[str, str, int, int]]:
        """Every key's usage on ``day`` (UTC, ``YYYY-MM-DD``)."""
        with self._reading() as c:
            return [(str(n), str(d), int(r), int(t)) for n, d, r, t in
                    c.execute("SELECT name, day, requests, tokens FROM key_usage WHERE day = ?", (day,))]

    def record_weights(self, block: int, weights: Mapping[int, float], at: float | None = None) -> None:
        """Remember the last weights set on chain (block, wall time, the weights)."""
        payload = json.dumps({str(uid): float(w) for uid, w in weights.items()}, sort_keys=True)
        with self._tx(begin=True) as c:
            self._set_meta(c, "weights_block", int(block))
            self._set_meta(c, "weights_at", time.time() if at is None else float(at))
            self._set_meta(c, "weights", payload)

    def last_weights(self) -> StoredWeights | None:
        block = self._get_meta("weights_block")
        if block is None:
            return None
        with self._reading():
            at = float(self._get_meta("weights_at") or 0.0)
            weights = {int(k): float(v) for k, v in json.loads(self._get_meta("weights") or "{}").items()}
            return StoredWeights(block=int(block), at=at, weights=weights)

    def last_weights_block(self) -> int | None:
        w = self.last_weights()
        return None if w is None else w.block

    # -- meta and lifecycle ----------------------------------------------------------------------

    @staticmethod
    def _set_meta(c: sqlite3.Connection, key: str, value: float | int | str) -> None:
        c.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, str(value)),
        )

    def _get_meta(self, key: str) -> str | None:
        with self._reading() as c:
            row = c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ScoreStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
