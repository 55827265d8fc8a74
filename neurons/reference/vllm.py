"""A reference on the field's own engine: the subnet's model in vLLM, teacher-forcing miners' answers.

Why: miners run vLLM. A validator with a GPU can audit on the engine its miners run, so the honest spread the
bands must absorb is vLLM's against itself, not vLLM's against llama.cpp. It judges exactly as the llama.cpp
reference does (:func:`neurons.reference.llama.replay`: the same structure check, forcing and verdict); only
where the logits come from differs.

How the logits are taken: vLLM's API gives prompt logprobs only for the top k tokens, and the audit needs whole
rows (the seeded sampler's draw depends on every token's logit). So each answer is *generated* under a logits
processor (:class:`ForceAndCapture`, vLLM's V1 interface, the one the plugin uses) that copies the row it is
handed, which is the model's raw logits before any penalty, temperature or cut, and then leaves only the miner's
token at that position. One decode step per answer token: on this CPU that costs about what generating the answer
cost (the llama.cpp reference forces in one batched prefill, ~0.3x); on a GPU the forced requests batch like any
other traffic.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the processor can hand the rows back,
on a thread of its own as the llama.cpp reference does. This module needs vLLM, which the project's install never
has: run it from the field venv (``scripts/field_vllm.sh prepare``) as the reference service::

    PYTHONPATH=. .field/venv/bin/python -m neurons.reference --engine vllm --model .field/model --port 8100

and point validators at it with ``--audit.url``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.protocol.measurement import Answer
from neurons.model.chat_template import END_OF_TURN, render
from neurons.model.packaged import ModelUnavailable
from scoring.audit import AuditBands, Verdict

from .llama import replay

FORCE_ARG = "tensorgate_force"  # the extra argument naming a forcing job (set only by this module)
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class _Job:
    ids: list[int]
    rows: dict[int, npt.NDArray[np.float32]] = field(default_factory=dict)  # answer position -> raw logits


class _Jobs:
    """The forcing jobs of this process, shared by the processor the engine built and the caller that asked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._keys = itertools.count(1)

    def open(self, ids: list[int]) -> int:
        with self._lock:
            key = next(self._keys)
            self._jobs[key] = _Job(list(ids))
            return key

    def get(self, key: int) -> _Job | None:
        with self._lock:
            return self._jobs.get(key)

    def close(self, key: int) -> _Job:
        with self._lock:
            return self._jobs.pop(key)


JOBS = _Jobs()


def _processor_class() -> type:
    """The V1 logits processor, built on first use (vLLM is imported only where it is installed)."""
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

    from neurons.miner.vllm_plugin.processor_v1 import follow_batch

    @dataclass(slots=True)
    class _Row:
        job: _Job
        output: list[int]  # vLLM's running list of the request's output tokens: its length is the position

    def _adopt(params: Any, output: list[int]) -> _Row | None:
        extra = getattr(params, "extra_args", None) or {}
        job = JOBS.get(extra[FORCE_ARG]) if FORCE_ARG in extra else None
        return None if job is None else _Row(job, output)

    class ForceAndCapture(LogitsProcessor):
        """Copies each forcing request's row, then leaves it only the miner's token at that position.

        A row still in a chunked prefill is handed over with an empty output and its sample discarded; its copy
        is overwritten when the prefill completes, so each position keeps the row the model actually gave it.
        """

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self._rows: dict[int, _Row] = {}

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            return None

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            follow_batch(self._rows, batch_update, _adopt)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for index, row in self._rows.items():
                if index >= logits.shape[0]:
                    continue
                position = len(row.output)
                row.job.rows[position] = logits[index].to(torch.float32).cpu().numpy().copy()
                forced = row.job.ids[position] if position < len(row.job.ids) else int(logits[index].argmax())
                logits[index] = -float("inf")
                logits[index, forced] = 0.0
            return logits

    return ForceAndCapture


class VllmEngine:
    """The subnet's model in an in-process vLLM engine, with the teacher-forcing surface the audit replays on
    (as :class:`neurons.model.engine.LlamaEngine`'s): prompt ids, token pieces, stop ids and forced rows."""

    def __init__(self, model_dir: Path, *, n_ctx: int = 4096, **engine_kw: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the processor must live in this process
        try:
            from vllm import LLM, SamplingParams
        except ImportError as e:
            raise ModelUnavailable("the vLLM reference needs vLLM: run it from the field venv "
                                   "(bash scripts/field_vllm.sh prepare)") from e
        if not (model_dir / "config.json").is_file():
            raise ModelUnavailable(f"vLLM reference model {model_dir}: not a Hugging Face model folder")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ModelUnavailable("the vLLM reference needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (its processor hands "
                                   "rows back in process)")
        self._params = SamplingParams
        self._llm = LLM(model=str(model_dir), max_model_len=n_ctx, logits_processors=[_processor_class()],
                        **engine_kw)
        self._tok = self._llm.get_tokenizer()
        self.n_ctx = n_ctx
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        end_of_turn = self._tok.convert_tokens_to_ids(END_OF_TURN)
        self.stop_ids = frozenset({int(self._tok.eos_token_id), int(end_of_turn)})
        self._special = frozenset(int(i) for i in self._tok.all_special_ids)
        self._pieces: dict[int, bytes] = {}

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """BOS, then the subnet's template tokenized with special tokens parsed: what vLLM serving the shipped Jinja
        template conditions on (tests/test_field_vllm.py checks that equals the llama.cpp reference's ids)."""
        return [int(self._tok.bos_token_id), *self._tok.encode(render(messages), add_special_tokens=False)]

    def piece(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (SentencePiece: ``▁`` is a space, ``<0xNN>`` one byte)."""
        b = self._pieces.get(token_id)
        if b is None:
            if token_id in self._special:
                b = b""
            else:
                text = str(self._tok.convert_ids_to_tokens(token_id))
                byte = _BYTE.fullmatch(text)
                b = bytes([int(byte.group(1), 16)]) if byte else text.replace("\u2581", " ").encode("utf-8")
            self._pieces[token_id] = b
        return b

    def forced_logits_many(self, jobs: list[tuple[list[int], list[int] | tuple[int, ...]]]
                           ) -> list[npt.NDArray[np.float32]]:
        """:meth:`forced_logits` for several answers in one engine call (vLLM batches them)."""
        from vllm.inputs import TokensPrompt

        keys = [JOBS.open(list(ids)) for _, ids in jobs]
        try:
            prompts = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt, _ in jobs]
            params = [self._params(temperature=0.0, max_tokens=len(ids) + 1, ignore_eos=True, stop_token_ids=[],
                                   detokenize=False, extra_args={FORCE_ARG: key})
                      for key, (_, ids) in zip(keys, jobs, strict=True)]
            self._llm.generate(prompts, params, use_tqdm=False)
        finally:
            done = [JOBS.close(key) for key in keys]
        out = []
        for job in done:
            if sorted(job.rows) != list(range(len(job.ids) + 1)):
                raise RuntimeError(f"vLLM forced {len(job.rows)} of {len(job.ids) + 1} positions")
            out.append(np.stack([job.rows[i] for i in range(len(job.ids) + 1)]))
        return out

    def forced_logits(self, prompt_ids: list[int], completion_ids: list[int] | tuple[int, ...]
                      ) -> npt.NDArray[np.float32]:
        """Row ``j`` is the raw logits vLLM gave completion token ``j``; the last row what follows it."""
        return self.forced_logits_many([(prompt_ids, completion_ids)])[0]


class VllmReference:
    """:class:`VllmEngine` on a thread of its own, behind the :class:`~.base.Reference` seam."""

    def __init__(self, model_dir: Path, *, n_ctx: int = 4096, **engine_kw: Any) -> None:
        self.name = f"vllm:{model_dir.name}"
        self.grammars = False  # its forcing engine has no grammar mask
        self.path = model_dir
        self._n_ctx = n_ctx
        self._kw = engine_kw
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-reference")
        self._engine: VllmEngine | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._engine = await loop.run_in_executor(
                self._pool, lambda: VllmEngine(self.path, n_ctx=self._n_ctx, **self._kw))
        except BaseException:
            self._pool.shutdown(wait=False)
            raise

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        if self._engine is None:
            raise RuntimeError("vLLM reference not started")
        return await asyncio.get_running_loop().run_in_executor(self._pool, replay, self._engine, answer, bands)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._pool.shutdown, wait=True)
