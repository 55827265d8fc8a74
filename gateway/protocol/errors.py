"""OpenAI-shaped errors: one exception type the handlers raise, one JSON shape clients parse.

Official clients (``openai``) turn ``{"error": {"message", "type", "param", "code"}}`` into typed
exceptions, so every refusal the gateway makes uses exactly that shape and names the field at fault.

Example::

    err = bad_request("must be a positive integer", param="max_tokens")
    err.status          # 400
    err.body()          # {"error": {"message": ..., "type": "invalid_request_error", "param": "max_tokens", ...}}
    raise err           # the gateway answers it as JSON, with err.status and err.headers
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
UPSTREAM = "upstream_error"
TIMEOUT = "timeout_error"
SERVER = "server_error"


class GatewayError(Exception):
    """A request the gateway refuses or cannot serve, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object; also what a mid-stream SSE error event carries."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Codes a miner's 400 may carry to say the request cannot be served by the model (the client's fault):
# the context is too small (vLLM, llama-server, this project's llama.cpp runtime), or the reference
# miner's proxy passed on its runtime's own 400/404/413/422.
CLIENT_FAULT_CODES = frozenset({"context_length_exceeded", "runtime_rejected"})


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def invalid_json(message: str = "request body is not valid JSON") -> GatewayError:
    return GatewayError(400, message, code="invalid_json")


def unauthorized(message: str = "invalid or missing API key") -> GatewayError:
    return GatewayError(401, message, type=AUTHENTICATION, code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")


def payload_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body exceeds {limit} bytes", code="payload_too_large")


def no_capacity(message: str = "no miner has capacity for this request; retry shortly") -> GatewayError:
    return GatewayError(429, message, type=RATE_LIMIT, code="no_capacity", headers={"Retry-After": "1"})


def rate_limited(message: str, retry_after_s: float) -> GatewayError:
    """A key over one of its limits (OpenAI's ``rate_limit_exceeded``), with when to come back."""
    return GatewayError(429, message, type=RATE_LIMIT, code="rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def overloaded(message: str = "the gateway is out of resources; retry shortly") -> GatewayError:
    """The validator's own trouble (no file descriptors left, say): not any miner's failure."""
    return GatewayError(503, message, type=SERVER, code="gateway_overloaded", headers={"Retry-After": "1"})


def shutting_down(message: str = "the gateway is shutting down; retry shortly") -> GatewayError:
    """A request the gateway will not finish because it is stopping (SIGTERM): retry, on another replica say."""
    return GatewayError(503, message, type=SERVER, code="shutting_down", headers={"Retry-After": "1"})


def bad_gateway(message: str = "the miner failed to answer", code: str = "upstream_failed") -> GatewayError:
    return GatewayError(502, message, type=UPSTREAM, code=code)


def gateway_timeout(message: str = "the miner did not answer in time") -> GatewayError:
    return GatewayError(504, message, type=TIMEOUT, code="upstream_timeout")
