"""``SubnetSamplerV2``: vLLM's custom logits processor (Model Runner V2 interface) that draws the subnet's token.

What vLLM gives a processor, and how this one uses it:

* ``add_request(slot, params)``: a request enters a persistent slot. It is the sampler's when its extra arguments
  (``vllm_xargs`` in the OpenAI request) carry ``tensorgate_seed`` and it samples (temperature at least
  :data:`~.sampler.GREEDY_BELOW`; greedy rows are vLLM's argmax already). The seed, temperature and ``top_p`` are
  kept on the host for the slot; every other request's slot is cleared (slots are recycled).
* ``apply(logits, ctx)``: one float32 row per request of this step. A row's answer position is the tokens it sees
  (``ctx.seq_lens_upper_bound_np``, exact without speculative decoding) less its prompt (``prompt_len``): no device
  sync. Rows still in a chunked prefill (negative position) are left alone; their sample is discarded.
* Speculative decoding gives a request one row per draft token; this processor refuses to load with it (untested:
  say so rather than draw wrong tokens that fail every audit).

``apply`` runs after vLLM's bias, penalty and grammar stages and before temperature and top-k/top-p, so it sees the
logits the spec scales, and its one-hot rows survive the rest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState

from gateway.protocol.sampling import GREEDY_BELOW

from . import requested_seed
from .sampler import keep_only, row_base, subnet_tokens


class SubnetSamplerV2(LogitsProcessor):
    """Keeps, in each row of a request that asked for it, only the subnet sampler's token."""

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("the subnet sampler does not support speculative decoding yet: start vLLM without it")
        self._prompt_len = req_states.prompt_len  # host copy (.np) is the runner's source of truth
        n = req_states.max_num_reqs
        self._seed: list[int | None] = [None] * n
        self._temperature = np.ones(n)
        self._top_p = np.ones(n)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        requested_seed(sampling_params)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        seed = requested_seed(sampling_params)
        temperature = float(sampling_params.temperature)
        if seed is None or temperature < GREEDY_BELOW:
            self._seed[req_idx] = None
            return False
        self._seed[req_idx] = seed
        self._temperature[req_idx] = temperature
        self._top_p[req_idx] = float(sampling_params.top_p)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots = np.asarray(ctx.idx_mapping_np)
        picked = [(row, int(slot)) for row, slot in enumerate(slots.tolist()) if self._seed[int(slot)] is not None]
        if not picked:
            return logits
        if logits.shape[0] != slots.shape[0]:
            raise RuntimeError("one logits row per request expected (speculative decoding is not supported)")
        prompt = np.asarray(self._prompt_len.np)
        rows: list[int] = []
        bases: list[int] = []
        for row, slot in picked:
            position = int(ctx.seq_lens_upper_bound_np[row]) - int(prompt[slot])
            seed = self._seed[slot]
            if position < 0 or seed is None:  # a chunk of a prefill: its sample is not used
                continue
            rows.append(row)
            bases.append(row_base(seed, position))
        if not rows:
            return logits
        slot_of = [slots[r] for r in rows]
        index = torch.tensor(rows, device=logits.device)
        tokens = subnet_tokens(logits[index], torch.from_numpy(self._temperature[slot_of]),
                               torch.from_numpy(self._top_p[slot_of]), torch.tensor(bases, dtype=torch.int64))
        return keep_only(logits, index, tokens)
