"""The validator's reference: the subnet's model on llama.cpp, held to replay miners' answers.

An audit renders the request's prompt with the subnet's chat template, checks the miner's token ids
spell what the client received, teacher-forces them in one batched pass (no generation) and judges
the result (:mod:`scoring.audit`). Everything model-bound runs on the reference's own thread, one
audit at a time, so audits cost the validator one core at most and never touch the event loop that
relays streams.

``LlamaReference`` loads a GGUF file into llama.cpp: by default the packaged Gemma 3 270M (the local
subnet's model); on a real subnet, the operator's copy of the subnet's model (``--audit.model``),
which llama.cpp runs on the CPU, or on a GPU with a CUDA build of ``llama-cpp-python``. The reference
service (:mod:`neurons.reference.server`) runs this same class.

Example::

    ref = LlamaReference()                  # the packaged model; or LlamaReference(Path("subnet-model.gguf"))
    await ref.start()
    verdict = await ref.audit(measurement.answer, AuditBands())   # None: too long to replay here
    await ref.aclose()
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from gateway.protocol.measurement import Answer
from neurons.model.engine import EngineThread
from neurons.model.grammar import GrammarError, gbnf, masked_rows
from neurons.model.packaged import MODEL_ID, ModelUnavailable, model_path
from scoring.audit import AuditBands, ForcedScores, Verdict, check_ids, check_logprobs, chosen_logprobs, force, judge

from .base import Constraining, ForcingEngine


class LlamaReference:
    """The subnet's model on llama.cpp, on a thread of its own.

    ``path`` None is the packaged model; either way the file is found (and the packaged one assembled)
    in :meth:`start`, on that thread, so building a validator does no I/O.
    """

    def __init__(self, path: Path | None = None, *, n_ctx: int = 4096, threads: int = 1) -> None:
        self.name = f"llama.cpp:{MODEL_ID if path is None else path.name}"
        self.grammars = True  # answers bound to a shape are forced under the subnet's grammar
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
        return await self._worker.run(replay, answer, bands)

    async def aclose(self) -> None:
        await self._worker.aclose()


def replay(engine: ForcingEngine, answer: Answer, bands: AuditBands) -> Verdict | None:
    """On the reference's thread: structure, then teacher forcing, then the verdict (any :class:`ForcingEngine`:
    llama.cpp's here, vLLM's in :mod:`.vllm`)."""
    scored = replay_scored(engine, answer, bands)
    return None if scored is None else scored[0]


def replay_scored(engine: ForcingEngine, answer: Answer, bands: AuditBands
                  ) -> tuple[Verdict, ForcedScores | None] | None:
    """:func:`replay`'s verdict with the per-position scores it was judged on (None when the answer failed its
    structure before any forcing), for the calibration that measures honest gaps; None: too long to replay, or bound
    to a shape this engine cannot mask by (or whose schema has no grammar).

    An answer bound to a shape is forced under the subnet's grammar: each row masked as the miner drew from it
    (:func:`neurons.model.grammar.masked_rows`), so a token outside the grammar fails, and the best allowed token is
    what the miner's is measured against."""
    checked = check_ids(answer, vocab_size=engine.vocab_size, piece=engine.piece, stop_ids=engine.stop_ids)
    if isinstance(checked, Verdict):
        return checked, None
    prompt = engine.prompt_ids(answer.messages)
    if len(prompt) + len(checked.ids) + 1 > engine.n_ctx:
        return None
    rows = engine.forced_logits(prompt, checked.ids)
    wrong = check_logprobs(answer, chosen_logprobs(rows, checked.ids), bands) if answer.logprobs is not None else None
    if wrong is not None:
        return dataclasses.replace(wrong, prompt_tokens=len(prompt)), None
    if answer.structure is not None:
        if not isinstance(engine, Constraining):
            return None
        try:
            grammar = engine.grammar(gbnf(answer.structure))
        except GrammarError:  # the request's schema, not the miner: nothing to judge it on
            return None
        with grammar:
            rows = masked_rows(grammar, rows, checked.ids, answer.sampling, engine.stop_ids)
    scores = force(rows, checked.ids, answer.sampling, engine.stop_ids, nucleus_slack=bands.seeded_nucleus_slack)
    verdict = judge(answer, checked, scores, bands)
    return dataclasses.replace(verdict, prompt_tokens=len(prompt)), scores
