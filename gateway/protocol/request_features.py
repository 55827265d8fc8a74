"""A chat request's feature fields (tools, structured output, logprobs, logit bias, top_k, min_p): each checked and
rebuilt, and what a miner must declare to serve them.

A miner declares the features it serves beyond plain chat (``features`` in its signed /health, gateway.offers); a
request using one goes only to miners that declared it, and is refused by name when no routable miner did. A field
at its "off" value (``logprobs: false``, ``top_k: -1``, ``response_format: text``, an empty ``logit_bias``) is not
passed on and needs nothing: a client library's defaults never narrow the miners. One function a field, each
raising the OpenAI-shaped 400 that names it.

Example::

    options, needs = features({"tools": [...], "tool_choice": "required", "logprobs": True})
    needs                      # {"tools", "logprobs"}
"""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import bad_request
from .json_schema import SchemaError
from .structure import check_structure, structure_of

TOOLS, RESPONSE_FORMAT, LOGPROBS, LOGIT_BIAS, TOP_K, MIN_P = (
    "tools", "response_format", "logprobs", "logit_bias", "top_k", "min_p")
# Not a request field: the miner decodes JSON output and forced tool calls under the subnet's grammar
# (gateway.protocol.structure, neurons.model.grammar), so the audit forces them under the same one. Another runtime's
# grammar (vLLM's xgrammar allows other whitespace) would fail honest answers: theirs are not audited, not paid.
GRAMMAR = "subnet_grammar"
FEATURES = frozenset({TOOLS, RESPONSE_FORMAT, LOGPROBS, LOGIT_BIAS, TOP_K, MIN_P, GRAMMAR})
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function name, as OpenAI allows it


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    """``body[name]`` if it is a finite number in ``[lo, hi]``, None when absent; a 400 naming it otherwise."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"'{name}' must be a number between {lo:g} and {hi:g}", param=name)
    return v


def features(body: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The feature fields a request uses, checked and rebuilt, and the :data:`FEATURES` a miner needs to serve
    them."""
    out: dict[str, Any] = {}
    needs: set[str] = set()
    for field in (_tool_fields, _response_format, _logprobs, _logit_bias, _top_k_min_p):
        field(body, out, needs)
    _grammar_schemas(out)
    return out, needs


def _grammar_schemas(out: dict[str, Any]) -> None:
    """The schemas the answer will be decoded under, checked against the subnet's subset and bounds
    (:mod:`gateway.protocol.json_schema`) before any miner sees them: a schema a runtime cannot compile safely is the
    client's 400, never a miner's failure or crash."""
    structure = structure_of(out)
    if structure is None:
        return
    index = {t["function"]["name"]: i for i, t in enumerate(out.get("tools") or ())}
    try:
        check_structure(structure, lambda name: f"tools[{index[name]}].function.parameters")
    except SchemaError as e:
        raise bad_request(str(e), param=e.param, code="invalid_schema") from None


def _tool_fields(body: dict[str, Any], out: dict[str, Any], needs: set[str]) -> None:
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = tools_of(tools)
        needs.add(TOOLS)
    for name in ("tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None and tools is None:
            raise bad_request(f"'{name}' needs 'tools'", param=name)
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice, {t["function"]["name"] for t in out["tools"]})
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
        out["parallel_tool_calls"] = parallel


def _tool_choice(choice: Any, names: set[str]) -> str | dict[str, Any]:
    """``none``, ``auto``, ``required``, or the named function (one of ``names``), rebuilt."""
    if choice in ("none", "auto", "required"):
        return str(choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(fn, dict) and choice.get("type") == "function" and fn.get("name") in names:
        return {"type": "function", "function": {"name": fn["name"]}}
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                      "'function': {'name': <one of the tools>}}", param="tool_choice")


def _response_format(body: dict[str, Any], out: dict[str, Any], needs: set[str]) -> None:
    rf = body.get("response_format")
    if rf is None:
        return
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not NAME.fullmatch(js["name"]) \
                or not isinstance(js.get("schema", {}), dict) or not isinstance(js.get("strict", False), bool):
            raise bad_request("'json_schema' must be {'name': str, 'schema': object, 'strict': bool}",
                              param="response_format.json_schema")
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: js[k] for k in ("name", "description", "schema", "strict") if k in js}}
    elif kind != "text":
        raise bad_request("'response_format' type must be 'text', 'json_object' or 'json_schema'",
                          param="response_format")
    if "response_format" in out:
        needs.add(RESPONSE_FORMAT)


def _logprobs(body: dict[str, Any], out: dict[str, Any], needs: set[str]) -> None:
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("'logprobs' must be a boolean", param="logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if not logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if logprobs:
        out["logprobs"] = True
        if top is not None:
            out["top_logprobs"] = top
        needs.add(LOGPROBS)


def _logit_bias(body: dict[str, Any], out: dict[str, Any], needs: set[str]) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > 1024 or not all(
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 for k in bias):
        raise bad_request("'logit_bias' must map at most 1024 token ids (strings of digits) to numbers",
                          param="logit_bias")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and -100 <= v <= 100 for v in bias.values()):
        raise bad_request("'logit_bias' values must be numbers from -100 to 100", param="logit_bias")
    if bias:
        out["logit_bias"] = {k: bias[k] for k in bias}
        needs.add(LOGIT_BIAS)


def _top_k_min_p(body: dict[str, Any], out: dict[str, Any], needs: set[str]) -> None:
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise bad_request("'top_k' must be an integer: -1 or 0 for off, else at least 1", param="top_k")
        if top_k > 0:
            out["top_k"] = top_k
            needs.add(TOP_K)
    min_p = number(body, "min_p", 0.0, 1.0)
    if min_p:
        out["min_p"] = min_p
        needs.add(MIN_P)


def tools_of(value: Any) -> list[dict[str, Any]]:
    """A request's ``tools``, checked (unique names, schemas as objects) and rebuilt with only OpenAI's fields."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of 1 to {MAX_TOOLS} tools", param="tools")
    out, seen = [], set()
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise bad_request("a tool is {'type': 'function', 'function': {'name', 'description', 'parameters'}}",
                              param=p)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in seen:
            raise bad_request("a function needs a unique 'name' of letters, digits, '_' or '-' (at most 64)",
                              param=f"{p}.function.name")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("parameters", {}), dict) \
                or not isinstance(fn.get("strict", False), bool):
            raise bad_request("'description' must be a string, 'parameters' a JSON schema object, 'strict' a bool",
                              param=f"{p}.function")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters", "strict")
                                                      if k in fn}})
    return out
