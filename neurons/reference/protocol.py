"""The validator <-> reference service wire: one answer in, one verdict out, as JSON.

The service is the operator's own, but it still parses what arrives as untrusted (it listens on a
socket): a malformed body is a 400 naming the field, never an exception in the audit loop.

Example::

    body = encode_request(answer, AuditBands())       # POST AUDIT_PATH
    answer, bands = decode_request(json.loads(body))    # on the service
    verdict_to_json(verdict) / verdict_from_json(obj)   # the reply (or {"verdict": null}: cannot replay)
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import SEED_MAX, SamplingParams, is_seed
from gateway.protocol.structure import Structure
from scoring.audit import AuditBands, AuditFailure, Verdict

AUDIT_PATH = "/v1/audit"
KEY_ENV = "TENSORGATE_AUDIT_KEY"  # a shared bearer key, when set on both sides


class BadAuditRequest(ValueError):
    """A request the service cannot read; the message names the field."""


def encode_request(answer: Answer, bands: AuditBands) -> bytes:
    return json.dumps({
        "answer": {"messages": answer.messages, "temperature": answer.sampling.temperature,
                   "top_p": answer.sampling.top_p, "penalised": answer.sampling.penalised,
                   "seed": answer.sampling.seed,
                   "max_tokens": answer.max_tokens, "stop": list(answer.stop), "text": answer.text,
                   "token_ids": None if answer.token_ids is None else list(answer.token_ids),
                   "finish_reason": answer.finish_reason,
                   "tool_calls": None if answer.tool_calls is None else [list(c) for c in answer.tool_calls],
                   "structure": None if answer.structure is None else answer.structure.to_json(),
                   "logprobs": None if answer.logprobs is None else list(answer.logprobs)},
        "bands": dataclasses.asdict(bands),
    }, allow_nan=False).encode()


def _num(obj: dict[str, Any], name: str) -> float:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise BadAuditRequest(f"answer.{name} must be a finite number")
    return float(v)


def decode_request(obj: Any) -> tuple[Answer, AuditBands]:
    if not isinstance(obj, dict) or not isinstance(obj.get("answer"), dict):
        raise BadAuditRequest("body must be an object with 'answer'")
    a = obj["answer"]
    messages = a.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadAuditRequest("answer.messages must be a list of objects")
    ids = a.get("token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in ids)):
        raise BadAuditRequest("answer.token_ids must be a list of integers or null")
    stop = a.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadAuditRequest("answer.stop must be a list of strings")
    max_tokens = a.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadAuditRequest("answer.max_tokens must be a positive integer")
    text, finish = a.get("text"), a.get("finish_reason")
    if not isinstance(text, str) or not (finish is None or isinstance(finish, str)):
        raise BadAuditRequest("answer.text must be a string and finish_reason a string or null")
    seed = a.get("seed")
    if seed is not None and not is_seed(seed):
        raise BadAuditRequest(f"answer.seed must be null or an integer in 0..{SEED_MAX}")
    sampling = SamplingParams(temperature=max(0.0, _num(a, "temperature")), top_p=min(1.0, max(0.0, _num(a, "top_p"))),
                              penalised=bool(a.get("penalised", False)), seed=seed)
    calls = a.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(
            isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in calls)):
        raise BadAuditRequest("answer.tool_calls must be null or a list of [name, arguments] strings")
    try:
        structure = None if a.get("structure") is None else Structure.from_json(a["structure"])
    except ValueError as e:
        raise BadAuditRequest(f"answer.structure: {e}") from None
    logprobs = a.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in logprobs)):
        raise BadAuditRequest("answer.logprobs must be null or a list of finite numbers")
    answer = Answer(messages=messages, sampling=sampling, max_tokens=max_tokens, stop=tuple(stop), text=text,
                    token_ids=None if ids is None else tuple(ids), finish_reason=finish,
                    tool_calls=None if calls is None else tuple((c[0], c[1]) for c in calls), structure=structure,
                    logprobs=None if logprobs is None else tuple(float(x) for x in logprobs))
    raw = obj.get("bands") or {}
    if not isinstance(raw, dict):
        raise BadAuditRequest("bands must be an object")
    known = {f.name for f in dataclasses.fields(AuditBands)}
    try:
        bands = AuditBands(**{k: v for k, v in raw.items() if k in known})
    except (TypeError, ValueError) as e:
        raise BadAuditRequest(f"bands: {e}") from None
    return answer, bands


def verdict_to_json(v: Verdict | None) -> dict[str, Any]:
    if v is None:
        return {"verdict": None}
    d = dataclasses.asdict(v)
    d["failure"] = None if v.failure is None else str(v.failure)
    return {"verdict": {k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in d.items()}}


def verdict_from_json(obj: Any) -> Verdict | None:
    """The service's reply; raises ValueError when it is not one (the auditor counts a reference error)."""
    if not isinstance(obj, dict) or "verdict" not in obj:
        raise ValueError("reply has no 'verdict'")
    v = obj["verdict"]
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("passed"), bool):
        raise ValueError("verdict is not an object with a boolean 'passed'")
    failure = v.get("failure")
    known = {f.name for f in dataclasses.fields(Verdict)}
    fields = {k: x for k, x in v.items() if k in known}
    fields["failure"] = None if failure is None else AuditFailure(failure)
    for name in ("tokens", "positions", "misses"):  # counts the strike book and pay add up: whole, not negative
        x = fields.get(name, 0)
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"verdict.{name} must be a non-negative integer, got {x!r}")
    if fields.get("misses", 0) > fields.get("positions", 0):
        raise ValueError("verdict.misses exceeds verdict.positions")
    return Verdict(**fields)
