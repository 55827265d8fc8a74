"""The validator's reference runtime: the subnet's model, held by the validator to replay miners' answers.

An audit renders the request's prompt with the subnet's chat template, checks the miner's token ids
spell what the client received, teacher-forces them in one batched pass (no generation) and judges
the result (:mod:`scoring.audit`). Everything model-bound runs on the reference's own thread, one
audit at a time, so audits cost the validator one core at most and never touch the event loop that
relays streams.

``LlamaReference`` loads a GGUF file into llama.cpp: by default the packaged Gemma 3 270M (the local
subnet's model); on a real subnet, the operator's copy of the subnet's model (``--audit.model``),
which llama.cpp runs on the CPU, or on a GPU with a CUDA build of ``llama-cpp-python``.
``RemoteReference`` sends each answer to that same code run as a service elsewhere (``--audit.url``,
``python -m neurons.reference``). ``ToyReference`` replays the simulated cards' toy model
(:mod:`neurons.model.toy`) through the same checks and verdict, so the default local subnet and the
soak audit their simulated answers too.

Example::

    ref = LlamaReference()                  # the packaged model; or LlamaReference(Path("subnet-model.gguf"))
    await ref.start()
    verdict = await ref.audit(measurement.answer, AuditBands())   # None: too long to replay here
    await ref.aclose()
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import Protocol

import aiohttp

from neurons.model.engine import EngineThread, LlamaEngine
from neurons.model.packaged import MODEL_ID, ModelUnavailable, model_path
from neurons.model.toy import MODEL as TOY
from neurons.reference.protocol import AUDIT_PATH, KEY_ENV, encode_request, verdict_from_json
from scoring.audit import AuditBands, Verdict, check_ids, force, judge
from scoring.measurement import Answer


class Reference(Protocol):
    """What the auditor needs: a verdict on one answer, or None when it cannot be replayed (not the miner's fault)."""

    name: str

    async def start(self) -> None: ...

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None: ...

    async def aclose(self) -> None: ...


class LlamaReference:
    """The subnet's model on llama.cpp, on a thread of its own.

    ``path`` None is the packaged model; either way the file is found (and the packaged one assembled)
    in :meth:`start`, on that thread, so building a validator does no I/O.
    """

    def __init__(self, path: Path | None = None, *, n_ctx: int = 4096, threads: int = 1) -> None:
        self.name = f"llama.cpp:{MODEL_ID if path is None else path.name}"
        self.path = path  # None: the packaged model
        self._n_ctx = n_ctx
        self._threads = threads
        self._worker = EngineThread("reference")

    async def start(self) -> None:
        path = self.path if self.path is not None else await asyncio.to_thread(model_path)
        if not await asyncio.to_thread(path.is_file):
            raise ModelUnavailable(f"reference model {path}: no such file")
        await self._worker.load(path, n_ctx=self._n_ctx, threads=self._threads)

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        return await self._worker.run(_audit, answer, bands)

    async def aclose(self) -> None:
        await self._worker.aclose()


class ToyReference:
    """The simulated cards' model: rows built from the prompt's key, judged like the real model's."""

    name = "toy model of the simulated cards"

    async def start(self) -> None:
        return None

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        return await asyncio.to_thread(_toy_audit, answer, bands)  # rows of up to 4k x 441 floats: off the loop

    async def aclose(self) -> None:
        return None


def _toy_audit(answer: Answer, bands: AuditBands) -> Verdict:
    # The toy model draws freely (the subnet sampler's 441 hashes a token, in pure Python, would slow the
    # soak's tens of thousands of tokens a second): its sampled answers are judged by plausibility.
    answer = dataclasses.replace(answer, sampling=dataclasses.replace(answer.sampling, seed=None))
    model = TOY
    checked = check_ids(answer, vocab_size=model.vocab_size, piece=model.piece, stop_ids=model.stop_ids)
    if isinstance(checked, Verdict):
        return checked
    rows = model.rows(model.key(answer.messages), len(checked.ids), answer.max_tokens)
    return judge(answer, checked, force(rows, checked.ids, answer.sampling, model.stop_ids), bands)


class RemoteReference:
    """A reference service (``python -m neurons.reference``) at ``url``, e.g. on a GPU box of the operator's.

    Any failure to get a verdict (unreachable, timeout, a malformed reply) raises, which the auditor
    counts as a reference error: the answer is paid as measured, the miner never blamed.
    """

    def __init__(self, url: str, *, timeout_s: float = 120.0, key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = f"service at {self.url}"
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


def _audit(engine: LlamaEngine, answer: Answer, bands: AuditBands) -> Verdict | None:
    """On the reference's thread: structure, then teacher forcing, then the verdict."""
    checked = check_ids(answer, vocab_size=engine.vocab_size, piece=engine.piece, stop_ids=engine.stop_ids)
    if isinstance(checked, Verdict):
        return checked
    prompt = engine.prompt_ids(answer.messages)
    if len(prompt) + len(checked.ids) + 1 > engine.n_ctx:
        return None
    rows = engine.forced_logits(prompt, checked.ids)
    verdict = judge(answer, checked, force(rows, checked.ids, answer.sampling, engine.stop_ids), bands)
    return dataclasses.replace(verdict, prompt_tokens=len(prompt))
