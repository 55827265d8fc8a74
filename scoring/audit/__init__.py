"""Verified inference: teacher-forcing arithmetic, verdicts, sampling policy and strikes (all pure).

The reference runtime that produces the logits, and the queue that runs audits off the hot path,
live with the validator process (:mod:`neurons.reference`, :mod:`neurons.validator.auditor`).
"""

from scoring.audit.forcing import ForcedScores, chosen_logprobs, force
from scoring.audit.policy import apply_verdict, should_audit
from scoring.audit.strikes import StrikeBook, StrikePolicy, StrikeRecord
from scoring.audit.verdict import AuditBands, AuditFailure, CheckedIds, Verdict, check_ids, check_logprobs, judge

__all__ = [
    "AuditBands",
    "AuditFailure",
    "CheckedIds",
    "ForcedScores",
    "StrikeBook",
    "StrikePolicy",
    "StrikeRecord",
    "Verdict",
    "apply_verdict",
    "check_ids",
    "check_logprobs",
    "chosen_logprobs",
    "force",
    "judge",
    "should_audit",
]
