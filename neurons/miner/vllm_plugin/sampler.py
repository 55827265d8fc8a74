"""The subnet's sampler in torch, for rows of logits on any device: what the vLLM plugin draws with.

The spec is :mod:`gateway.protocol.sampling` (numpy): a sampled token is the argmax, over the asked nucleus, of
``logit / temperature + gumbel(seed, position, id)``, the variate hashed with splitmix64 from the three numbers.
This file computes the same tokens on rows of torch tensors, bit for bit on the hash (``tests/test_vllm_plugin.py``
checks it against the spec and its worked example; the logs after it agree to the last place or so). The spec's
constants and its integer ``mix64`` come from the spec itself, which needs only numpy (vLLM has it); nothing else of
this package is imported inside vLLM's worker.

Why int64: torch's uint64 supports few operations. The hash needs only addition, multiplication and xor modulo
2**64, which two's-complement int64 computes with the same bits, and logical right shifts, which are arithmetic
shifts masked to the bits a logical one keeps (:func:`_srl`).

Pruned as the spec's :func:`~gateway.protocol.sampling.contenders` is: a variate is at most
:data:`GUMBEL_MAX`, so a token whose scaled logit sits further than that under the best token's own score cannot
win and is never hashed. At temperature 0.3 that left 0.1 % of Gemma 3's 262k vocabulary; at 0.7-1.0 most of it
(``scripts/bench_sampler.py``).

Example::

    tokens = subnet_tokens(logits, temperature=torch.tensor([0.7]), top_p=torch.tensor([1.0]),
                           bases=torch.tensor([row_base(seed, position)]))
"""

from __future__ import annotations

import math

import torch

from gateway.protocol.sampling import GOLDEN, GUMBEL_MAX, MIX1, MIX2, PRUNE_SLACK, mix64


def _signed(x: int) -> int:
    """An unsigned 64-bit integer as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def row_base(seed: int, position: int) -> int:
    """The per-(seed, position) constant of the hash, as an int64: ``mix64(seed ^ mix64(position))``."""
    return _signed(mix64(seed ^ mix64(position)))


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits: the arithmetic shift, with the copied sign bits masked off."""
    return (x >> k) & ((1 << (64 - k)) - 1)


_GOLDEN_S, _M1_S, _M2_S = _signed(GOLDEN), _signed(MIX1), _signed(MIX2)


def hash53(bases: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The spec's 53 random bits (``h >> 11``, int64) of token ``ids`` at the rows whose :func:`row_base` is
    ``bases`` (int64, broadcast against ``ids``)."""
    x = ids.to(torch.int64) * _GOLDEN_S + bases + _GOLDEN_S  # mix64's first step folded in
    x = (x ^ _srl(x, 30)) * _M1_S
    x = (x ^ _srl(x, 27)) * _M2_S
    x = x ^ _srl(x, 31)
    return _srl(x, 11)


def gumbel_at(bases: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The spec's Gumbel variates (float64) of token ``ids``: ``-log(-log(u))``, ``u`` from :func:`hash53`. The bits
    are the spec's exactly; torch's ``log`` and numpy's round differently in the last place for ~0.3 % of values
    (8.9e-16 at most over a 262k row), which can move a token only on a tie closer than that, far inside the
    audit's near-tie band."""
    u = (hash53(bases, ids).to(torch.float64) + 0.5) * (1.0 / (1 << 53))
    return -torch.log(-torch.log(u))


def nucleus(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of each row lie in its ``top_p`` nucleus (float64 rows of scaled logits): the most likely
    tokens, in order, until their probability reaches ``top_p``, and every token as likely as the last of them
    (the spec's ``nucleus_edges``: the edge is a log-probability, so ties at it are in)."""
    lsm = torch.log_softmax(scaled, dim=-1)
    ordered, _ = torch.sort(lsm, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(torch.exp(ordered), dim=-1)
    cut = torch.searchsorted(cum, top_p.to(cum.dtype).unsqueeze(-1).contiguous(), right=False)
    cut = cut.clamp(max=scaled.shape[-1] - 1)
    edge = torch.gather(ordered, -1, cut)
    return lsm >= edge


def subnet_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  bases: torch.Tensor, *, prune: bool = True) -> torch.Tensor:
    """The subnet sampler's token for each row of ``logits`` ([rows, vocab], any float dtype), each row with its
    own ``temperature`` (>= :data:`GREEDY_BELOW`), ``top_p`` and :func:`row_base` (``bases``, int64).

    When more than a quarter of the batch's tokens can still win, all of them are hashed in one pass (gathering
    and scattering a subset would cost more than it saves, as in the spec); ``prune=False`` always does (the
    "before" of ``scripts/bench_sampler.py``)."""
    device = logits.device
    scaled = logits.to(torch.float64) / temperature.to(device=device, dtype=torch.float64).unsqueeze(-1)
    p = top_p.to(device=device, dtype=torch.float64)
    if bool((p < 1.0).any()):
        keep = nucleus(scaled, p.clamp(min=0.0))
        keep |= (p >= 1.0).unsqueeze(-1)  # rows without a nucleus keep every token
        scaled = scaled.masked_fill(~keep, -math.inf)
    b = bases.to(device=device, dtype=torch.int64)
    if prune:
        top = torch.argmax(scaled, dim=-1)
        first = scaled.gather(-1, top.unsqueeze(-1)).squeeze(-1) + gumbel_at(b, top)
        bound = first - GUMBEL_MAX - PRUNE_SLACK * first.abs().clamp(min=1.0)
        bound = torch.where(torch.isfinite(first), bound, -math.inf)  # as the spec: no bound known, hash every token
        keep = scaled >= bound.unsqueeze(-1)
        if 4 * int(keep.sum()) <= keep.numel():
            rows, ids = torch.nonzero(keep, as_tuple=True)
            score = torch.full_like(scaled, -math.inf)
            score[rows, ids] = scaled[rows, ids] + gumbel_at(b[rows], ids)
            return torch.argmax(score, dim=-1)
    every = torch.arange(scaled.shape[-1], device=device, dtype=torch.int64)
    return torch.argmax(scaled + gumbel_at(b.unsqueeze(-1), every), dim=-1)


def keep_only(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Leave each of ``rows`` one finite logit (0), at its ``tokens``: whatever the runtime does next (temperature,
    top-k/top-p, a random draw) can then only pick it. In place; returns ``logits``. (vLLM reports logprobs from
    the logits before any processor, so a client asking for them still gets the model's.)"""
    logits[rows] = -math.inf
    logits[rows, tokens] = 0.0
    return logits
