"""``POST /v1/chat/completions`` and ``POST /v1/completions``: the client API's work.

Authorised from the head, before the body is read; the body refused (413) as soon as it is known to exceed the
limit; the request validated (:mod:`gateway.protocol.openai`) and refused by name when no miner serves what it asks
for; the key's limits admitted (this process's book, or every process's through Redis); then a short fair wait for
a slot and the relay (:class:`gateway.relay.Relay`), which owns the request from lease to last byte. The key is
charged what was served.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

from ..answer_headers import answer_headers
from ..asgi import BodyTimeout, ClientGone, MalformedBody, Receive, Scope, Send
from ..client_metrics import FirstByte
from ..protocol.errors import (
    GatewayError,
    bad_request,
    invalid_json,
    model_not_found,
    payload_too_large,
    rate_limited,
    shutting_down,
)
from ..protocol.openai import ChatRequest, SchemaLimits, parse_chat_request, parse_completion_request
from ..quota import KeyPolicy, Refusal, Ticket, ratelimit_headers

if TYPE_CHECKING:
    from ..app import Gateway


async def read_body(gw: Gateway, headers: dict[str, str], receive: Receive) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed ``max_body_bytes``."""
    limit = gw.config.max_body_bytes
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            message = await receive()
        except BodyTimeout as e:
            raise GatewayError(408, str(e), code="request_timeout") from None
        except MalformedBody as e:  # the framing broke: the connection closes after the 400
            raise GatewayError(400, str(e), code="bad_request") from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def prompt_tokens(gw: Gateway, policy: KeyPolicy, req: ChatRequest) -> int:
    """The prompt's tokens as a key's token limits count them: the model's tokenizer where the gateway has one and
    the key has a token limit (the estimate undercounts digits, emoji and CJK up to 4x), else the estimate. A
    tokenizer failure falls back to the estimate: it never costs the client its answer."""
    if gw.counter is None or (policy.tpm is None and policy.tpd is None):
        return req.prompt_tokens
    try:
        return await gw.counter.count(req.messages)
    except Exception as e:
        logger.error("counting a prompt with the {} failed ({}); the estimate is used", gw.counter.name, e)
        return req.prompt_tokens


def check_servable(gw: Gateway, req: ChatRequest) -> None:
    """404 for a model no routable miner serves now, 400 naming the first field no miner serving the model declared
    (``tools``, ``logprobs``, ...): refused by name, never sent to a miner that would ignore it."""
    router = gw.router
    if router.can_serve(req.model, req.needs):
        return  # the usual case, from a cache
    if not router.routable():
        return  # nothing known: the relay answers (429 or 503)
    if not router.can_serve(req.model):
        raise model_not_found(req.model)
    if req.needs and not router.can_serve(req.model, req.needs):
        field = next(f for f in sorted(req.needs) if not router.can_serve(req.model, {f}))
        raise bad_request(f"'{field}' is not served for {req.model} by any miner now", param=field,
                          code="unsupported_parameter")


async def _parsed(gw: Gateway, headers: dict[str, str], receive: Receive,
                  parse: Callable[[Any, SchemaLimits], ChatRequest]) -> ChatRequest:
    raw = await read_body(gw, headers, receive)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid_json() from None
    req = parse(body, gw.limits)
    check_servable(gw, req)
    return req


def _observe(gw: Gateway, req: ChatRequest) -> None:
    on_request = gw.hooks.on_request
    if on_request is None:
        return
    try:
        on_request(req)
    except Exception:  # an observer must never cost a client its answer
        logger.opt(exception=True).warning("request observer failed")


async def _claim_day(gw: Gateway, policy: KeyPolicy, ticket: Ticket | Any) -> None:
    """Write a key's claim on its day before its request is served, when it is due; a failed write never costs the
    client its answer."""
    row = gw.quota.mark_due(policy, ticket) if isinstance(ticket, Ticket) else None
    save = gw.hooks.save_usage
    if row is None or save is None:
        return
    try:
        await save(row)
    except Exception as e:
        logger.error("could not save API key {!r}'s usage before serving it: {}", policy.name, e)


async def chat(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send,
               parse: Callable[[Any, SchemaLimits], ChatRequest] = parse_chat_request) -> None:
    arrived = time.monotonic()
    if gw.stopping:  # a kept-alive connection asking during the drain: another replica should serve it
        raise shutting_down()
    policy = gw.authorize(headers)  # from the head: an unauthenticated client cannot make us read its body
    req = await _parsed(gw, headers, receive, parse)
    if gw.stopping:  # the body came in after the stop began
        raise shutting_down()
    counted = await prompt_tokens(gw, policy, req)
    if counted != req.prompt_tokens:  # the usage a client reads is what its key was charged
        req = dataclasses.replace(req, prompt_tokens=counted)
    reserve = counted + req.n * req.max_tokens
    shared = gw.hooks.key_limits
    ticket = (gw.quota.admit(policy, reserve, time.time(), streams=req.n) if shared is None
              else await shared.admit(policy, reserve, streams=req.n))
    if isinstance(ticket, Refusal):
        err = rate_limited(f"API key {policy.name!r} is over its {ticket.limit} limit: {ticket.detail}",
                           ticket.retry_after_s)
        err.headers.update(ratelimit_headers(policy, ticket.standing))
        raise err
    _observe(gw, req)
    used = ticket.reserved  # a client that leaves mid-answer is charged what it could have used
    with gw.serving():
        try:
            await _claim_day(gw, policy, ticket)
            await gw.admission.admit(policy.name)  # every slot busy: a short wait, fair across keys, or the 429
            first = FirstByte(send)
            used = counted + await gw.relay.serve(req, answer_headers(first, req, ratelimit_headers(
                policy, ticket.standing)))
            gw.clients.observe(req.model, policy.name, ttft_s=None if first.at is None else first.at - arrived,
                               latency_s=time.monotonic() - arrived, input_tokens=counted, output_tokens=used - counted)
        except GatewayError:
            used = 0  # no miner answered: nothing was served
            raise
        finally:
            if shared is not None:
                shared.settle(ticket, used)
            else:
                assert isinstance(ticket, Ticket)
                gw.quota.settle(ticket, used, time.time())


async def completions(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    await chat(gw, scope, headers, receive, send, parse=parse_completion_request)
