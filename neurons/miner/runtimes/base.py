"""The contract between the reference miner and an inference backend (simulated card, proxied runtime).

The miner owns HTTP, signatures, trust and slots; a runtime only turns one chat payload into SSE
frames. Keeping that seam a ``Protocol`` lets the simulated card, the proxy to vLLM/SGLang/llama-server
and any test double plug in without inheriting from anything.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class RuntimeHealth:
    """Whether the runtime can serve now, and a line that says why (shown on the miner's ``/health``)."""

    ok: bool
    detail: str


class RuntimeFailure(Exception):
    """The runtime could not serve a request; the miner maps it to a clean OpenAI-shaped error.

    Raised before the first frame it becomes an HTTP error with ``status``; raised mid-stream it
    becomes an SSE ``error`` event and the stream ends without ``[DONE]``.
    """

    def __init__(self, message: str, *, status: int = 502, type: str = "upstream_error",
                 code: str = "runtime_failed", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.headers = dict(headers or {})


class Runtime(Protocol):
    """What the miner needs from an inference backend (simulated or a proxied vLLM/SGLang/llama-server)."""

    name: str
    # The sampler sampled tokens are drawn with, declared to validators on every answer (SAMPLER_HEADER):
    # gateway.protocol.openai.SUBNET_SAMPLER, or None for the runtime's own RNG (free draws, not paid).
    sampler: str | None
    # What it serves beyond plain chat (gateway.protocol.openai.FEATURES: tools, response_format, logprobs, ...),
    # declared in the miner's signed /health so requests using one are routed to it (gateway.offers).
    features: frozenset[str]

    @property
    def active(self) -> int: ...

    def health(self) -> RuntimeHealth: ...

    def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]: ...
