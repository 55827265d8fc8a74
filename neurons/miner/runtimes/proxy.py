"""Relay to a real OpenAI-compatible runtime on the miner's box (vLLM, SGLang, llama.cpp's llama-server).

The miner's job in front of a real card is to add nothing: bytes from the runtime go to the validator
as they arrive (``iter_any``, no line buffering), so the validator's TTFT is the card's TTFT plus one
loopback hop. Upstream refusals become clean :class:`RuntimeFailure` errors before the first byte;
a runtime that breaks off mid-stream raises :class:`RuntimeFailure` the miner turns into an SSE error event.

A vLLM started with the subnet's sampler (``--logits-processors neurons.miner.vllm_plugin:SubnetSampler``,
:mod:`neurons.miner.vllm_plugin`) draws seeded requests with it when asked through the request's extra arguments
(``vllm_xargs``, vLLM's name): with ``sampler=SUBNET_SAMPLER`` every request that carries a seed asks for it,
and the miner declares the sampler to validators, who then audit its sampled answers token by token and pay
for them. Without it the runtime draws with its own RNG: free draws, audited for plausibility and not paid.

With ``tools`` among its declared features the proxy writes tools and tool history into the turns itself and turns
a call the model wrote back into tool-call deltas (:mod:`.tool_relay`): the runtime renders the same prompt the
reference does, so its tool calls are audited and paid like any answer. With ``subnet_grammar`` (vLLM only) a
request for JSON output or a forced tool call asks vLLM to decode under the subnet's grammar
(``structured_outputs.grammar``), which the audit forces the answer under: such answers are audited and paid too.

Example::

    async with aiohttp.ClientSession() as session:
        rt = ProxyRuntime("http://127.0.0.1:8001", session, model="Qwen/Qwen2.5-7B-Instruct",
                          sampler=SUBNET_SAMPLER)  # only when vLLM runs the plugin
        async for chunk in rt.stream({"messages": [{"role": "user", "content": "hi"}], "stream": True}):
            print(chunk.decode(), end="")
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from loguru import logger

from gateway.protocol.openai import FEATURES, GRAMMAR, SUBNET_SAMPLER, TOOLS
from gateway.protocol.sampling import is_seed
from gateway.protocol.structure import structure_of

from ..vllm_plugin import SEED_ARG
from .base import RuntimeFailure, RuntimeHealth
from .tool_relay import may_call, relay_calls, tool_body

_MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class ProxyTimeouts:
    """``read_s`` bounds every gap between bytes, so it covers a hung prefill and a stalled decode alike."""

    connect_s: float = 5.0
    read_s: float = 120.0

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self.connect_s, sock_connect=self.connect_s,
                                     sock_read=self.read_s)


def _upstream_message(raw: bytes, status: int) -> str:
    """The runtime's own error message when it sent OpenAI's error shape (vLLM/SGLang/llama-server do)."""
    try:
        obj = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        if isinstance(msg, str) and msg:
            return msg[:500]
        if isinstance(obj.get("detail"), str):
            return obj["detail"][:500]
    return f"runtime answered HTTP {status}"


def map_status(status: int, message: str) -> RuntimeFailure:
    """Upstream HTTP errors in the miner's terms: the caller's fault stays 400, overload is 429, else 502."""
    if status == 429:
        return RuntimeFailure(message, status=429, type="busy", code="runtime_busy", headers={"Retry-After": "0"})
    if status in (400, 404, 413, 422):
        return RuntimeFailure(message, status=400, type="invalid_request_error", code="runtime_rejected")
    return RuntimeFailure(message, status=502, type="upstream_error", code="runtime_http_error")


class ProxyRuntime:
    """Forward chat completions to ``{base_url}/v1/chat/completions`` and relay the stream unbuffered."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, model: str | None = None,
                 timeouts: ProxyTimeouts | None = None, sampler: str | None = None,
                 features: frozenset[str] = frozenset()) -> None:
        if sampler not in (None, SUBNET_SAMPLER):
            raise ValueError(f"unknown sampler {sampler!r}: {SUBNET_SAMPLER!r} or None")
        if not features <= FEATURES:
            raise ValueError(f"unknown features {sorted(features - FEATURES)}: known {sorted(FEATURES)}")
        if GRAMMAR in features and importlib.util.find_spec("llama_cpp") is None:
            raise ValueError(f"{GRAMMAR} writes the subnet's grammars with llama.cpp's converter: install "
                             "llama-cpp-python (pip install -e '.[real]')")
        self.features = features  # what the runtime behind serves, as its operator declares (--runtime.features)
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/v1/chat/completions"
        self.name = f"proxy:{self.base_url}"
        self.sampler = sampler
        self._session = session
        self._model = model
        self._timeouts = timeouts or ProxyTimeouts()
        self._active = 0
        self._problem: str | None = "not checked yet"  # the last reason the runtime could not be reached

    @property
    def active(self) -> int:
        return self._active

    def health(self) -> RuntimeHealth:
        """Down from the last failure to reach the runtime until it next answers."""
        if self._problem is None:
            return RuntimeHealth(ok=True, detail=f"reachable at {self.base_url}")
        return RuntimeHealth(ok=False, detail=self._problem)

    async def start(self) -> None:
        """Check the runtime answers ``GET /v1/models`` (vLLM, SGLang and llama-server all do) before serving."""
        try:
            async with self._session.get(self.base_url + "/v1/models", timeout=self._timeouts.client_timeout()) as r:
                self._problem = None if r.status == 200 else f"GET /v1/models answered HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            self._problem = f"unreachable: {type(e).__name__}"

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        written = tool_body(payload) if TOOLS in self.features else None
        body = dict(payload) if written is None else written
        if self._model:
            body["model"] = self._model
        body["stream"] = True
        if GRAMMAR in self.features:
            _constrain(body, payload)
        if self.sampler == SUBNET_SAMPLER and is_seed(body.get("seed")):
            extra = body.get("vllm_xargs")
            body["vllm_xargs"] = {**(extra if isinstance(extra, dict) else {}), SEED_ARG: body["seed"]}
        self._active += 1
        started = False  # True once the runtime answered 200: later errors are mid-stream
        try:
            async with self._session.post(self.url, json=body, timeout=self._timeouts.client_timeout(),
                                          headers={"Accept": "text/event-stream"}) as resp:
                if resp.status != 200:
                    msg = _upstream_message(await resp.content.read(_MAX_ERROR_BODY), resp.status)
                    logger.warning("runtime {} answered {}: {}", self.url, resp.status, msg)
                    raise map_status(resp.status, msg)
                started = True
                self._problem = None
                source: AsyncIterable[bytes] = resp.content.iter_any()
                if written is not None and may_call(payload):
                    source = relay_calls(source, payload)
                async for chunk in source:
                    yield chunk
        except TimeoutError:
            if started:
                raise RuntimeFailure("runtime stalled mid-stream", status=504, type="timeout_error",
                                     code="runtime_timeout") from None
            raise RuntimeFailure("runtime did not answer in time", status=504, type="timeout_error",
                                 code="runtime_timeout") from None
        except aiohttp.ClientError as e:
            if started:
                raise RuntimeFailure(f"runtime stream broke: {type(e).__name__}", code="runtime_dropped") from None
            logger.warning("runtime {} unreachable: {}", self.url, e)
            self._problem = f"unreachable: {type(e).__name__}"
            raise RuntimeFailure("runtime unreachable", status=502, code="runtime_unreachable") from None
        finally:
            self._active -= 1


def _constrain(body: dict[str, Any], payload: dict[str, Any]) -> None:
    """A shaped request (JSON output, a forced tool call) asks vLLM to decode under the subnet's grammar
    (``structured_outputs.grammar``, GBNF, which xgrammar reads) instead of its own, so the answer is what the audit
    forces under the same grammar; a schema with no grammar is the client's request's fault (400)."""
    from neurons.model.grammar import GrammarError, gbnf

    structure = structure_of(payload)
    if structure is None:
        return
    try:
        body["structured_outputs"] = {"grammar": gbnf(structure)}
    except GrammarError as e:
        raise RuntimeFailure(str(e), status=400, type="invalid_request_error", code="invalid_value") from None
    body.pop("response_format", None)
