"""The vLLM reference's forcing processor against vLLM's own V1 classes (runs in the field venv, where vLLM is; in
the project's venv it skips, and ``tests/test_field_vllm.py`` runs it there and requires it to pass)."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
lp = pytest.importorskip("vllm.v1.sample.logits_processor")
vllm = pytest.importorskip("vllm")

from neurons.reference.vllm import FORCE_ARG, JOBS, _processor_class  # noqa: E402


def test_the_forcing_processor_copies_each_raw_row_and_leaves_only_the_miners_token() -> None:
    """A forcing request keeps the row it was handed at each answer position (a chunked-prefill row is overwritten
    when the prefill completes), then only the miner's token; it follows the persistent batch's swaps; other
    requests' rows are untouched; after the answer, one more row is kept (what follows it, the stop check)."""
    cls = _processor_class()
    proc = cls(types.SimpleNamespace(speculative_config=None), torch.device("cpu"), False)
    assert isinstance(proc, lp.LogitsProcessor) and proc.is_argmax_invariant() is False
    ids = [5, 7, 9]
    key = JOBS.open(ids)
    forced_out: list[int] = []
    plain_out: list[int] = []
    forcing = vllm.SamplingParams(temperature=0.0, max_tokens=4, extra_args={FORCE_ARG: key})
    proc.update_state(lp.BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, forcing, [1, 2], forced_out), (1, vllm.SamplingParams(temperature=0.7), [1, 2], plain_out)]))
    rng = np.random.default_rng(3)
    seen: dict[int, np.ndarray] = {}
    row = {"forced": 0, "plain": 1}

    def step(append: bool = True) -> None:
        logits = torch.from_numpy(rng.normal(0, 3, (2, 50)).astype(np.float32))
        before = logits.clone()
        out = proc.apply(logits)
        r = row["forced"]
        seen[len(forced_out)] = before[r].numpy().copy()
        want = ids[len(forced_out)] if len(forced_out) < len(ids) else int(before[r].argmax())
        assert torch.isfinite(out[r]).sum() == 1 and int(out[r].argmax()) == want
        assert torch.equal(out[row["plain"]], before[row["plain"]])
        if append:
            forced_out.append(want)
            plain_out.append(0)

    step(append=False)  # a chunked prefill: sampled and discarded, position 0 again next step
    step()
    proc.update_state(lp.BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, lp.MoveDirectionality.SWAP)]))
    row["forced"], row["plain"] = 1, 0
    step()
    step()
    step()
    job = JOBS.close(key)
    assert sorted(job.rows) == [0, 1, 2, 3] and forced_out[:3] == ids
    for position, raw in seen.items():
        assert np.array_equal(job.rows[position], raw), position
