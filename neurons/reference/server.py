"""The reference service: ``POST /v1/audit`` replays one answer on the model, ``GET /health`` says if it can.

One model context, one audit at a time (the :class:`~neurons.reference.llama.LlamaReference`
thread); a validator's auditor sends one request at a time anyway. With ``TENSORGATE_AUDIT_KEY`` set,
requests must carry it as a bearer key (the scheme in any case, as HTTP says; a header that is not UTF-8
is a wrong key, never a 500). Without a key it serves loopback only: one audit of a 3,000-token answer
costs ~39 s of CPU, so an open service on a public address is a way to burn the operator's machine, and
:func:`start_reference_service` refuses to start that way (:class:`OpenReferenceRefused`).

Example::

    runner, port = await start_reference_service(LlamaReference(path), port=8100)
"""

from __future__ import annotations

import json
import os

from aiohttp import web
from loguru import logger

from gateway.auth import bearer_matches
from gateway.http.server import is_loopback
from gateway.protocol.untrusted import loads as untrusted_json

from .base import Reference
from .protocol import AUDIT_PATH, KEY_ENV, BadAuditRequest, decode_request, verdict_to_json

MAX_BODY = 8 * 1024 * 1024  # a long prompt and answer, as JSON


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def reference_app(reference: Reference, key: str | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    ready = {"ok": False}

    async def on_startup(_app: web.Application) -> None:
        await reference.start()
        ready["ok"] = True

    async def on_cleanup(_app: web.Application) -> None:
        await reference.aclose()

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if ready["ok"] else "loading", "reference": reference.name},
                                 status=200 if ready["ok"] else 503)

    async def audit(request: web.Request) -> web.Response:
        if key is not None:
            if not bearer_matches(request.headers.get("Authorization"), key):
                return _error(401, "missing or wrong bearer key")
        try:
            raw = untrusted_json(await request.read())
            json.dumps(raw, ensure_ascii=False).encode("utf-8")  # a lone surrogate is no text any tokenizer takes
            answer, bands = decode_request(raw)
        except UnicodeEncodeError:
            return _error(400, "a string in the body holds a lone surrogate (\\ud800-\\udfff escape): not text")
        except ValueError as e:  # BadAuditRequest, bad or too deeply nested JSON alike
            return _error(400, str(e) if isinstance(e, BadAuditRequest) else f"body is not valid JSON ({e})")
        try:
            verdict = await reference.audit(answer, bands)
        except Exception as e:
            logger.opt(exception=e).warning("reference failed on an answer")
            return _error(500, f"reference failed: {type(e).__name__}")
        return web.json_response(verdict_to_json(verdict))

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", health)
    app.router.add_post(AUDIT_PATH, audit)
    return app


class OpenReferenceRefused(ValueError):
    """The service was asked to listen beyond loopback without a key."""


async def start_reference_service(reference: Reference, *, host: str = "127.0.0.1", port: int = 0,
                                  key: str | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``reference`` (loaded before this returns); ``key`` defaults to ``$TENSORGATE_AUDIT_KEY``.

    Raises :class:`OpenReferenceRefused` for a non-loopback ``host`` without a key, before loading anything.
    """
    key = key if key is not None else os.environ.get(KEY_ENV) or None
    if key is None and not is_loopback(host):
        raise OpenReferenceRefused(f"the reference service would listen on {host} with no key: set {KEY_ENV} "
                                   f"(validators send it with --audit.url), or listen on 127.0.0.1")
    runner = web.AppRunner(reference_app(reference, key), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
