"""Scoring: per-request credit, rounds, trailing settlement, weights and their persistence.

Example::

    from scoring import CreditConfig, Scorer, ScoreStore
    scorer = Scorer(CreditConfig(), ScoreStore("/tmp/tensorgate-state"), window=12)
"""

from scoring.credit import CreditConfig, decode_credit, expected_rate, request_credit, ttft_credit
from scoring.profiles import PROFILES, ProfileError, load_profile, save_profile
from scoring.rounds import MinerRound, RoundAccumulator
from scoring.scorer import MinerReport, RoundReport, Scorer
from scoring.settlement import Settlement
from scoring.store import (
    CorruptStateError,
    NewerSchemaError,
    ScoreStore,
    StateError,
    StoredAudit,
    StoredMiner,
    StoredRound,
)
from scoring.weights import compute_weights, why_empty

__all__ = [
    "CorruptStateError",
    "CreditConfig",
    "MinerReport",
    "MinerRound",
    "NewerSchemaError",
    "PROFILES",
    "ProfileError",
    "RoundAccumulator",
    "RoundReport",
    "ScoreStore",
    "Scorer",
    "Settlement",
    "StateError",
    "StoredAudit",
    "StoredMiner",
    "StoredRound",
    "compute_weights",
    "decode_credit",
    "expected_rate",
    "load_profile",
    "request_credit",
    "save_profile",
    "ttft_credit",
    "why_empty",
]
