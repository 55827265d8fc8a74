"""The state file's schema (SQLite): the tables of schema 1 (``SCHEMA``) and the ladder of what each later version
added (:data:`MIGRATIONS`, one row a version), which :class:`scoring.store.ScoreStore` creates, checks and migrates
with one loop. A new schema is one more row."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA = """
CREATE TABLE rounds (
    idx INTEGER PRIMARY KEY,
    ended_at REAL NOT NULL
);
CREATE TABLE round_miners (
    idx INTEGER NOT NULL REFERENCES rounds(idx) ON DELETE CASCADE,
    hotkey TEXT NOT NULL,
    uid INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    measured INTEGER NOT NULL,
    score REAL NOT NULL,
    credit_sum REAL NOT NULL,
    ttft_p50 REAL,
    ttft_p95 REAL,
    failures TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (idx, hotkey)
);
CREATE TABLE routing (
    hotkey TEXT PRIMARY KEY,
    uid INTEGER,
    score REAL NOT NULL
);
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""
# Schema 2: audit outcomes (the strike book itself lives in meta, as JSON).
SCHEMA_2 = """
CREATE TABLE audits (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    hotkey TEXT NOT NULL,
    uid INTEGER NOT NULL,
    probe INTEGER NOT NULL,
    passed INTEGER NOT NULL,
    failure TEXT,
    detail TEXT NOT NULL,
    tokens INTEGER NOT NULL
);
CREATE INDEX audits_hotkey ON audits (hotkey, at);
"""
# Schema 3: pay for work (issue 14): each round line keeps its paid card-seconds and its value (rounds
# stored before are read as worth 0, like rounds in which nobody was paid); API key usage per UTC day.
SCHEMA_3 = """
ALTER TABLE round_miners ADD COLUMN work_s REAL NOT NULL DEFAULT 0;
ALTER TABLE round_miners ADD COLUMN value REAL NOT NULL DEFAULT 0;
CREATE TABLE key_usage (
    name TEXT NOT NULL,
    day TEXT NOT NULL,
    requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (name, day)
);
"""
# Schema 4: pay for verified work only (issue 23): ``value`` is now the verified part; next to it the
# unverified part (held until an audit of a user's answer in the window passes), the round's audits and
# the quarantine flag. Rounds stored before keep their whole value as verified, as they were paid.
SCHEMA_4 = """
ALTER TABLE round_miners ADD COLUMN unverified REAL NOT NULL DEFAULT 0;
ALTER TABLE round_miners ADD COLUMN audits_passed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE round_miners ADD COLUMN audits_failed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE round_miners ADD COLUMN quarantined INTEGER NOT NULL DEFAULT 0;
"""
# Schema 5: every measurement counted exactly once across kill -9 (issue 39). Without Redis, each measurement taken
# in is journaled (``intake``) until the round holding it is saved, which deletes it in the same transaction; with
# Redis, the stream entries a saved round holds are listed (``counted``) in that transaction until Redis
# acknowledges them, so entries read again after a kill between the save and the acknowledgement are not recounted.
SCHEMA_5 = """
CREATE TABLE intake (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    m BLOB NOT NULL
);
CREATE TABLE counted (
    ref TEXT PRIMARY KEY,
    idx INTEGER NOT NULL
);
"""
# Schema 6: capacity (issue 38): each round line keeps the capacity reading the round pushed (NULL: none), so a restart
# keeps what the checks measured, and whether the hotkey was routed before any check had read it (its pay then waits
# for one, scoring.pay.PayWindow). Rounds stored before read as measured, as they were paid, with no reading.
SCHEMA_6 = """
ALTER TABLE round_miners ADD COLUMN unmeasured INTEGER NOT NULL DEFAULT 0;
ALTER TABLE round_miners ADD COLUMN capacity REAL;
"""


@dataclass(frozen=True)
class Migration:
    """One rung: the script that makes schema ``to`` of schema ``to - 1``, the tables it creates, and what it is for
    (the log says it)."""

    to: int
    script: str
    tables: frozenset[str]
    what: str


MIGRATIONS = (
    Migration(2, SCHEMA_2, frozenset({"audits"}), "audit outcomes"),
    Migration(3, SCHEMA_3, frozenset({"key_usage"}), "paid work per round"),
    Migration(4, SCHEMA_4, frozenset(), "verified and held pay"),
    Migration(5, SCHEMA_5, frozenset({"intake", "counted"}), "measurements counted once"),
    Migration(6, SCHEMA_6, frozenset(), "capacity readings kept"),
)
SCHEMA_VERSION = MIGRATIONS[-1].to
TABLES = frozenset({"rounds", "round_miners", "routing", "meta"}).union(*(m.tables for m in MIGRATIONS))
