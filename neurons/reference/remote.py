"""A reference service (``python -m neurons.reference``) reached over HTTP: ``--audit.url``."""

from __future__ import annotations

import json
import os

import aiohttp

from gateway.protocol.measurement import Answer
from neurons.model.packaged import ModelUnavailable
from scoring.audit import AuditBands, Verdict

from .protocol import AUDIT_PATH, KEY_ENV, encode_request, verdict_from_json


class RemoteReference:
    """A reference service (``python -m neurons.reference``) at ``url``, e.g. on a GPU box of the operator's.

    Any failure to get a verdict (unreachable, timeout, a malformed reply) raises, which the auditor
    counts as a reference error: the answer is paid as measured, the miner never blamed.
    """

    def __init__(self, url: str, *, timeout_s: float = 120.0, key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = f"service at {self.url}"
        self.grammars = False  # the service may run vLLM, which does not mask by the subnet's grammar
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._key = key if key is not None else os.environ.get(KEY_ENV) or None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(self.url + "/health") as r:
                if r.status != 200:
                    raise ModelUnavailable(f"reference service {self.url}: /health answered HTTP {r.status}")
        except (aiohttp.ClientError, TimeoutError) as e:
            await self.aclose()
            raise ModelUnavailable(f"reference service {self.url} unreachable: {e!r}") from None

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        if self._session is None:
            raise RuntimeError("reference service not started")
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        async with self._session.post(self.url + AUDIT_PATH, data=encode_request(answer, bands),
                                      headers=headers) as r:
            body = await r.read()
            if r.status != 200:
                raise RuntimeError(f"reference service answered HTTP {r.status}: {body[:200]!r}")
        return verdict_from_json(json.loads(body))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
