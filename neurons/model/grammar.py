"""The subnet's grammars on llama.cpp: which tokens may come next in a constrained answer, for miner and audit alike.

A :class:`~gateway.protocol.structure.Structure` becomes a GBNF grammar by llama.cpp's own JSON-schema converter
(``llama_cpp.llama_grammar``; JSON mode is the schema ``{"type": "object"}``), so a llama.cpp miner and the
validator's reference read the same rules, and vLLM reads them too (``structured_outputs.grammar``: xgrammar takes
GBNF; llama.cpp's hand-written JSON grammar it refused); a tool call is the subnet's tool format
(:mod:`gateway.protocol.tools`) around a JSON object naming one of the functions and its arguments. llama.cpp's
grammar sampler answers which tokens a grammar allows after the tokens accepted so far; nothing here samples with
it. The subnet's sampler then picks among the allowed tokens (the others' logits set to :data:`MASKED`), exactly as
without a grammar: temperature and nucleus apply to the masked distribution, as in vLLM.

Asking the grammar about all 262k tokens costs 30-100 ms a position on this CPU. Greedy and seeded draws without a
nucleus pick the best score, so the grammar is first asked about the :data:`SHORTLIST` best-scored tokens: when one is
allowed, the best allowed token is among them and the rest need not be asked (the same token, bit for bit). A nucleus
needs the whole masked distribution, and is masked whole.

llama.cpp aborts the process when a token the grammar rejects is accepted, so :meth:`Grammar.accept` refuses one
first: a miner's token outside the grammar fails its answer, never the validator.

Example::

    with Grammar(engine.vocab, gbnf(structure), engine.vocab_size) as g:
        row = constrained(engine.next_logits(), g, sampling, position)   # then engine.choose(row, ...)
        g.accept(token)
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.protocol.json_schema import SchemaError
from gateway.protocol.sampling import SamplingParams, gumbel_at
from gateway.protocol.structure import JSON_OBJECT, JSON_SCHEMA, TOOL_CALL, Structure, check_structure
from gateway.protocol.tools import CLOSE, OPEN

# What llama.cpp is handed at most: its grammar parser recurses once a nested group, on the calling thread's stack
# (20,000 nested groups killed the miner and the reference with SIGSEGV, issue 56). The schema bounds
# (gateway.protocol.json_schema) keep an admitted schema's grammar far under both; these hold whatever reaches here.
MAX_GRAMMAR_BYTES = 512 * 1024
MAX_GRAMMAR_NESTING = 768
MASKED = np.float32(-1e30)  # a disallowed token's logit: finite (no NaN in any moment), and never drawn
SHORTLIST = 64  # best-scored tokens asked about first
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


class GrammarError(ValueError):
    """The request's structure cannot be written as a grammar (a schema llama.cpp's converter refuses): the
    client's request, answered 400."""


# A character of a JSON string: anything but a quote, a backslash or a control character, or an escape (RFC 8259,
# section 7; llama.cpp's own converter in C++ says the same). llama-cpp-python's converter allows any character but a
# quote or a backslash, so a raw newline inside a string. The same 400 seeded forced tool calls at the default
# temperature, side by side: 9 ended as a call no client parses (so the client got text, no tool call), 0 with this
# rule (11 and 9 ran into max_tokens=64 inside a string: the 270M model, either way).
JSON_CHAR = r'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


def gbnf(structure: Structure) -> str:
    """The grammar an answer of ``structure`` is decoded under, built only from a structure inside the subnet's
    schema subset and bounds (:func:`~gateway.protocol.structure.check_structure`, as the gateway checked it), and
    refused when its text is over what llama.cpp can safely parse (:func:`bounded`)."""
    try:
        check_structure(structure)
    except SchemaError as e:
        raise GrammarError(f"the response's schema is outside the subnet's subset: {e}") from None
    return bounded(_convert(structure))


def bounded(text: str) -> str:
    """``text`` when llama.cpp may parse it: at most :data:`MAX_GRAMMAR_BYTES`, its groups nested at most
    :data:`MAX_GRAMMAR_NESTING` deep (outside literals and character classes); else a :class:`GrammarError`."""
    if len(text) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {len(text)} bytes, over {MAX_GRAMMAR_BYTES}")
    if _nesting(text) > MAX_GRAMMAR_NESTING:
        raise GrammarError(f"the grammar nests groups over {MAX_GRAMMAR_NESTING} deep")
    return text


def _nesting(text: str) -> int:
    """How deep ``(`` groups nest in GBNF ``text``: quoted literals and ``[...]`` classes skipped, escapes too."""
    deepest = depth = 0
    quote: str | None = None  # '"' inside a literal, ']' inside a class
    escaped = False
    for c in text:
        if quote is not None:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
        elif c == '"':
            quote = '"'
        elif c == "[":
            quote = "]"
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == "\n":
            depth = 0
    return deepest


def _convert(structure: Structure) -> str:
    converter = _converter()
    try:
        if structure.kind in (JSON_OBJECT, JSON_SCHEMA):
            schema = json.loads(structure.schema or "{}") if structure.kind == JSON_SCHEMA else {"type": "object"}
            converter.visit(converter.resolve_refs(schema, "request"), "")
            return str(converter.format_grammar())
        assert structure.kind == TOOL_CALL
        # each function's own definitions, where its local $refs find them from the root ($defs and definitions
        # both: the schema subset allows either, and a name defined otherwise by two functions is refused there)
        defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
        calls = []
        for name, params in structure.functions:
            for key, found in defs.items():
                found.update(params.get(key) or {})
            arguments = {k: v for k, v in params.items() if k not in defs}
            calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                          "required": ["name", "arguments"]})
        call: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        call.update({key: found for key, found in defs.items() if found})
        converter.visit(converter.resolve_refs(call, "request"), "call")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, AssertionError) as e:
        raise GrammarError(f"the response's schema cannot be written as a grammar: {type(e).__name__}: {e}") from None
    block = f'{_literal(OPEN + chr(10))} call {_literal(chr(10) + CLOSE)}'
    root = f"root ::= {block} ({_literal(chr(10))} {block})*" if structure.parallel else f"root ::= {block}"
    return f"{root}\n{converter.format_grammar()}"


def _converter() -> Any:
    """llama-cpp-python's JSON-schema converter, with JSON's own string characters (:data:`JSON_CHAR`)."""
    from llama_cpp.llama_grammar import BuiltinRule, SchemaConverter

    class JsonConverter(SchemaConverter):
        def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
            return str(super()._add_primitive(name, BuiltinRule(JSON_CHAR, []) if name == "char" else rule))

        def _format_literal(self, literal: str) -> str:
            # JSON text as a GBNF literal: its backslashes escaped too (the converter escapes only CR, LF and the
            # quote, so an enum value or a property name holding a quote or a backslash made a grammar llama.cpp
            # refused: 21 of 392 admitted random schemas, issue 56)
            return '"' + "".join(_GBNF_ESCAPES.get(c, c) for c in literal) + '"'

    return JsonConverter(prop_order={"name": 0, "arguments": 1}, allow_fetch=False, dotall=False, raw_pattern=False)


_GBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r"}


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal escapes as JSON does, for this text


class Grammar:
    """llama.cpp's grammar sampler for one answer: which tokens may come next, and the tokens accepted so far."""

    def __init__(self, vocab: Any, text: str, vocab_size: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self._sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        if not self._sampler:
            raise GrammarError("llama.cpp refused the grammar")
        self.vocab_size = vocab_size
        self._every: npt.NDArray[np.int32] | None = None

    def __enter__(self) -> Grammar:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sampler:
            self._lib.llama_sampler_free(self._sampler)
            self._sampler = None

    def allows(self, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Which of ``ids`` the grammar allows next (an end-of-generation token: only where the text may end)."""
        wanted = np.asarray(ids, dtype=np.int32).reshape(-1)
        size = int(wanted.shape[0])
        if size == 0:
            return np.zeros(0, dtype=bool)
        data = np.zeros(size, dtype=_TOKEN_DATA)
        data["id"] = wanted
        lib = self._lib
        arr = lib.llama_token_data_array(data=data.ctypes.data_as(lib.llama_token_data_p), size=size,
                                         selected=-1, sorted=False)
        lib.llama_sampler_apply(self._sampler, ctypes.byref(arr))
        return np.asarray(np.isfinite(data["logit"]))

    def allowed(self) -> npt.NDArray[np.bool_]:
        """The whole vocabulary's mask."""
        if self._every is None:
            self._every = np.arange(self.vocab_size, dtype=np.int32)
        return self.allows(self._every)

    def accept(self, token: int) -> bool:
        """Move past ``token``; False (and nothing accepted) when the grammar does not allow it."""
        if not bool(self.allows([token])[0]):
            return False
        self._lib.llama_sampler_accept(self._sampler, token)
        return True


def constrained(logits: npt.NDArray[np.float32], grammar: Grammar, sampling: SamplingParams, position: int,
                keep: tuple[int, ...] = ()) -> npt.NDArray[np.float32]:
    """``logits`` with every token the grammar rejects at :data:`MASKED` (a copy): what the subnet's sampler draws
    from. Greedy and seeded draws without a nucleus get only the tokens that can win unmasked (the allowed ones of
    the shortlist, when it holds one) and ``keep``'s allowed ones (the audit keeps the miner's token, so its gap is
    measured); anything else is masked whole."""
    row = np.asarray(logits, dtype=np.float32)
    out = np.full_like(row, MASKED)
    if sampling.greedy or (sampling.seeded and sampling.top_p >= 1.0):
        scores = row.astype(np.float64)
        if sampling.seeded:
            assert sampling.seed is not None
            scores = scores / sampling.temperature + gumbel_at(sampling.seed, position, np.arange(row.shape[0]))
        top = np.argpartition(-scores, SHORTLIST)[:SHORTLIST] if row.shape[0] > SHORTLIST else np.arange(row.shape[0])
        ok = grammar.allows(top)
        if ok.any():
            kept = np.asarray(keep, dtype=np.int64)
            ids = np.concatenate([top[ok], kept[grammar.allows(kept)]])
            out[ids] = row[ids]
            return out
    mask = grammar.allowed()
    out[mask] = row[mask]
    return out


def masked_rows(grammar: Grammar, rows: npt.NDArray[np.float32], ids: tuple[int, ...] | list[int],
                sampling: SamplingParams, stop_ids: frozenset[int] | tuple[int, ...]) -> npt.NDArray[np.float32]:
    """Teacher forcing under a grammar: ``rows`` (one per answer token, then the row after it) masked as the miner
    drew from them, row ``j`` by the grammar after ``ids[:j]`` (in place). The first id the grammar rejects is masked
    in its own row (its gap fails the answer) and the rows after it are left as they were."""
    for j, token in enumerate(ids):
        rows[j] = constrained(rows[j], grammar, sampling, j, keep=(int(token),))
        if not grammar.accept(int(token)):
            return rows
    n = len(ids)
    rows[n] = constrained(rows[n], grammar, sampling, n, keep=tuple(sorted(stop_ids)))
    return rows
