"""The vLLM plugin: its torch sampler against the spec (numpy), and its processor against vLLM's own classes.

The tensor tests need torch (the ``plugin`` extra, in the README's install). The processor tests need vLLM's
Model Runner V2 interface, which the default install never has: they skip unless ``vllm`` imports. They were run
against vLLM 0.34.0 (``pip install --no-deps vllm==0.34.0`` beside torch 2.13.0 CPU and vLLM's pure-Python
dependencies; docs/pages/operators.md, "Miners on vLLM", says how) and pass there. This file imports nothing that
needs bittensor, so it also runs in such a venv with ``--noconftest``.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from gateway.protocol.sampling import GOLDEN, SEED_MAX, SamplingParams, gumbel, mix64, seeded_token

torch = pytest.importorskip("torch")

from neurons.miner.vllm_plugin.sampler import (  # noqa: E402
    GUMBEL_MAX,
    gumbel_at,
    hash53,
    keep_only,
    row_base,
    subnet_tokens,
)

_MASK = (1 << 64) - 1  # the spec's integer mix64 is checked against splitmix64 written out in test_audit_forcing


def test_the_hash_is_the_specs_bit_for_bit_and_the_variates_to_the_last_place() -> None:
    ids = torch.arange(262_144, dtype=torch.int64)
    for seed, position in ((0, 0), (42, 3), (SEED_MAX, 4095), (2**62 + 12345, 100_000)):
        bits = hash53(torch.tensor(row_base(seed, position)), ids).tolist()
        base = mix64(seed ^ mix64(position))
        for i in (0, 1, 7, 1000, 65_535, 262_143):  # the spec in plain integers
            assert bits[i] == mix64((base + i * GOLDEN) & _MASK) >> 11, (seed, position, i)
        spec = gumbel(seed, position, 262_144)
        got = gumbel_at(torch.tensor(row_base(seed, position)), ids).numpy()
        assert np.abs(got - spec).max() <= 4 * np.spacing(np.abs(spec)).max()  # numpy's log and torch's round apart
    # the spec's worked example
    h = mix64((mix64(42 ^ mix64(3)) + 7 * GOLDEN) & _MASK)
    u7 = ((h >> 11) + 0.5) / 2.0**53
    assert float(gumbel_at(torch.tensor(row_base(42, 3)), torch.tensor([7]))[0]) == pytest.approx(
        -math.log(-math.log(u7)), rel=1e-15)
    assert 35.0 < GUMBEL_MAX < 37.0


def test_the_torch_sampler_picks_the_specs_token_row_by_row_in_one_batch() -> None:
    """Rows of a batch with their own temperature, nucleus, seed and position: every token the spec's."""
    rng = np.random.default_rng(11)
    for trial in range(40):
        rows, vocab = int(rng.integers(1, 9)), int(rng.integers(2, 6000))
        spread = float(rng.choice([0.1, 3.0, 15.0, 60.0]))
        logits = rng.normal(0.0, spread, (rows, vocab)).astype(np.float32)  # vLLM hands float32 rows
        if trial % 5 == 0:
            logits[0, : vocab // 2] = logits[0, 0]  # ties: the lowest id wins, as in a full argmax
        temps = rng.choice([1e-4, 0.05, 0.3, 0.7, 1.0, 1.5], rows)
        top_ps = rng.choice([1.0, 0.95, 0.9, 0.5], rows)
        seeds = [int(s) for s in rng.integers(0, 2**62, rows)]
        positions = [int(p) for p in rng.integers(0, 4000, rows)]
        got = subnet_tokens(torch.from_numpy(logits), torch.from_numpy(temps), torch.from_numpy(top_ps),
                            torch.tensor([row_base(s, p) for s, p in zip(seeds, positions, strict=True)]))
        want = [seeded_token(logits[i], SamplingParams(float(temps[i]), float(top_ps[i]), seed=seeds[i]),
                             positions[i]) for i in range(rows)]
        assert got.tolist() == want, trial
        bases = torch.tensor([row_base(s, p) for s, p in zip(seeds, positions, strict=True)])
        every = subnet_tokens(torch.from_numpy(logits), torch.from_numpy(temps), torch.from_numpy(top_ps), bases,
                              prune=False)
        assert every.tolist() == want, trial


def test_the_torch_sampler_agrees_with_the_spec_on_the_real_models_logits() -> None:
    """Rows of Gemma 3 270M's own logits (262k vocabulary), as vLLM would hand them over."""
    pytest.importorskip("llama_cpp")
    from neurons.model.engine import LlamaEngine
    from neurons.model.packaged import model_path

    engine = LlamaEngine(model_path(), n_ctx=512, threads=1)
    prompt = engine.prompt_ids([{"role": "user", "content": "Name three rivers of Europe and say one thing "
                                                            "about each."}])
    engine.begin(prompt)
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(12):
        row = np.array(engine.next_logits(), dtype=np.float32)
        rows.append(row)
        engine.push(int(np.argmax(row)))
    logits = np.stack(rows)
    for temperature, top_p in ((0.3, 1.0), (0.7, 0.9), (1.0, 1.0), (1.2, 0.95)):
        seeds = [int(s) for s in rng.integers(0, 2**62, len(rows))]
        got = subnet_tokens(torch.from_numpy(logits), torch.full((len(rows),), temperature),
                            torch.full((len(rows),), top_p),
                            torch.tensor([row_base(s, j) for j, s in enumerate(seeds)]))
        want = [seeded_token(logits[j], SamplingParams(temperature, top_p, seed=s), j) for j, s in enumerate(seeds)]
        assert got.tolist() == want, (temperature, top_p)


def test_keep_only_leaves_one_finite_logit_per_chosen_row() -> None:
    logits = torch.randn(3, 10)
    before = logits[1].clone()
    keep_only(logits, torch.tensor([0, 2]), torch.tensor([4, 9]))
    for row, token in ((0, 4), (2, 9)):
        assert torch.isfinite(logits[row]).sum() == 1 and int(torch.argmax(logits[row])) == token
    assert torch.equal(logits[1], before)


# ---- the processor, against vLLM's own classes (only where vLLM is installed) ----------------------------------


def _vllm() -> types.SimpleNamespace:
    lp = pytest.importorskip("vllm.v1.worker.gpu.sample.logits_processor")
    vllm = pytest.importorskip("vllm")
    exceptions = pytest.importorskip("vllm.exceptions")
    return types.SimpleNamespace(lp=lp, SamplingParams=vllm.SamplingParams, Invalid=exceptions.VLLMValidationError)


def _processor(v: types.SimpleNamespace, prompt_lens: list[int], vocab: int, speculative: object = None):
    from neurons.miner.vllm_plugin import SubnetSampler

    state = v.lp.LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=len(prompt_lens), vocab_size=vocab,
                                        all_token_ids=None, prompt_len=types.SimpleNamespace(np=np.array(prompt_lens)),
                                        prefill_len=None, total_len=None)
    return SubnetSampler(types.SimpleNamespace(speculative_config=speculative), state)


def _ctx(v: types.SimpleNamespace, slots: list[int], seen: list[int]):
    idx = torch.tensor(slots)
    return v.lp.LogitsContext(expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=np.array(slots),
                              expanded_local_pos=torch.zeros(len(slots), dtype=torch.int64),
                              input_ids=torch.zeros(len(slots), dtype=torch.int64),
                              pos=torch.tensor(seen) - 1, seq_lens_upper_bound_np=np.array(seen))


def test_vllms_loader_takes_the_plugin_and_validates_its_seed() -> None:
    v = _vllm()
    validate = v.lp.build_custom_logits_processors_params_validator(["neurons.miner.vllm_plugin:SubnetSampler"])
    validate(v.SamplingParams(temperature=0.7, extra_args={"tensorgate_seed": 5}))
    validate(v.SamplingParams(temperature=0.7))  # not the sampler's: nothing to check
    for bad in (-1, "5", True, 2**63):
        with pytest.raises(v.Invalid, match="tensorgate_seed"):  # the frontend answers it with a 400
            validate(v.SamplingParams(temperature=0.7, extra_args={"tensorgate_seed": bad}))
    with pytest.raises(ValueError, match="speculative"):
        _processor(v, [3], 10, speculative=object())


def test_the_processor_draws_the_subnet_token_for_each_row_whatever_the_batch_order() -> None:
    """Four slots: two on the sampler (different seeds, one with a nucleus), one greedy, one without a seed. Over
    three decode steps with rows reordered, each sampler row keeps exactly the spec's token at its answer position;
    the others are untouched."""
    v = _vllm()
    vocab = 3000
    prompt_lens = [5, 9, 4, 7]
    proc = _processor(v, prompt_lens, vocab)
    params = {0: v.SamplingParams(temperature=0.8, extra_args={"tensorgate_seed": 11}),
              1: v.SamplingParams(temperature=0.4, top_p=0.9, extra_args={"tensorgate_seed": SEED_MAX}),
              2: v.SamplingParams(temperature=0.0, extra_args={"tensorgate_seed": 3}),
              3: v.SamplingParams(temperature=0.9)}
    assert [proc.add_request(s, p) for s, p in params.items()] == [True, True, False, False]
    rng = np.random.default_rng(3)
    for step, order in enumerate(([0, 1, 2, 3], [3, 1, 0, 2], [2, 0, 3, 1])):
        logits = torch.from_numpy(rng.normal(0, 4, (4, vocab)).astype(np.float32))
        before = logits.clone()
        seen = [prompt_lens[s] + step for s in order]  # tokens each row's sample sees: answer position = step
        out = proc.apply(logits, _ctx(v, order, seen))
        for row, slot in enumerate(order):
            p = params[slot]
            if slot in (0, 1):
                want = seeded_token(before[row].numpy(), SamplingParams(p.temperature, p.top_p,
                                                                        seed=p.extra_args["tensorgate_seed"]), step)
                assert torch.isfinite(out[row]).sum() == 1 and int(torch.argmax(out[row])) == want, (step, slot)
            else:
                assert torch.equal(out[row], before[row]), (step, slot)
    # a recycled slot forgets its previous request
    assert proc.add_request(0, v.SamplingParams(temperature=0.8)) is False
    logits = torch.randn(1, vocab)
    assert torch.equal(proc.apply(logits.clone(), _ctx(v, [0], [prompt_lens[0] + 3])), logits)


def test_rows_still_in_a_chunked_prefill_are_left_alone() -> None:
    v = _vllm()
    proc = _processor(v, [100], 50)
    proc.add_request(0, v.SamplingParams(temperature=0.8, extra_args={"tensorgate_seed": 1}))
    logits = torch.randn(1, 50)
    assert torch.equal(proc.apply(logits.clone(), _ctx(v, [0], [64])), logits)  # 64 of 100 prompt tokens seen


# ---- the V1 interface (Model Runner V1: every CPU build, and GPU builds whose V2 runner lacks a feature) --------


def _v1() -> types.SimpleNamespace:
    lp = pytest.importorskip("vllm.v1.sample.logits_processor")
    vllm = pytest.importorskip("vllm")
    exceptions = pytest.importorskip("vllm.exceptions")
    return types.SimpleNamespace(lp=lp, SamplingParams=vllm.SamplingParams, Invalid=exceptions.VLLMValidationError)


_FQCN = "neurons.miner.vllm_plugin:SubnetSampler"


def _v1_processor(v: types.SimpleNamespace, speculative: object = None):
    (cls,) = v.lp._load_custom_logitsprocs([_FQCN])  # what V1's build_logitsprocs loads and checks
    return cls(types.SimpleNamespace(speculative_config=speculative), torch.device("cpu"), False)


def test_vllms_v1_loader_takes_the_same_plugin_name_and_validates_its_seed() -> None:
    v = _v1()
    proc = _v1_processor(v)
    assert isinstance(proc, v.lp.LogitsProcessor) and proc.is_argmax_invariant() is False
    v.lp.validate_logits_processors_parameters([_FQCN], v.SamplingParams(temperature=0.7,
                                                                          extra_args={"tensorgate_seed": 5}))
    for bad in (-1, "5", True, 2**63):
        with pytest.raises(v.Invalid, match="tensorgate_seed"):
            v.lp.validate_logits_processors_parameters([_FQCN], v.SamplingParams(
                temperature=0.7, extra_args={"tensorgate_seed": bad}))
    with pytest.raises(ValueError, match="speculative"):
        _v1_processor(v, speculative=object())


def test_the_v1_processor_follows_the_persistent_batch_and_draws_the_specs_token() -> None:
    """Requests enter, grow, swap rows, move and leave as vLLM's persistent batch reports them; at each step every
    row of the sampler's (seeded, sampled, unpenalised) requests keeps exactly the spec's token at the position its
    output list gives, and every other row is untouched."""
    v = _v1()
    proc = _v1_processor(v)
    vocab = 2000
    params = {"a": v.SamplingParams(temperature=0.8, extra_args={"tensorgate_seed": 11}),
              "b": v.SamplingParams(temperature=0.4, top_p=0.9, extra_args={"tensorgate_seed": SEED_MAX}),
              "greedy": v.SamplingParams(temperature=0.0, extra_args={"tensorgate_seed": 3}),
              "plain": v.SamplingParams(temperature=0.9),
              "penalised": v.SamplingParams(temperature=0.9, presence_penalty=0.5, extra_args={"tensorgate_seed": 4}),
              "late": v.SamplingParams(temperature=0.9)}
    outputs: dict[str, list[int]] = {name: [] for name in params}
    ours = {"a", "b"}
    row_of: dict[str, int] = {}

    def update(removed=(), added=(), moved=()):
        for name, row in added:
            row_of[name] = row
        proc.update_state(v.lp.BatchUpdate(batch_size=len(row_of), removed=list(removed),
                                           added=[(row, params[name], [1, 2], outputs[name]) for name, row in added],
                                           moved=list(moved)))

    def step():
        rows = max(row_of.values()) + 1
        logits = torch.from_numpy(np.random.default_rng(len(outputs["a"])).normal(0, 4, (rows, vocab))
                                  .astype(np.float32))
        before = logits.clone()
        out = proc.apply(logits)
        for name, row in row_of.items():
            if name in ours:
                p = params[name]
                want = seeded_token(before[row].numpy(), SamplingParams(
                    p.temperature, p.top_p, seed=p.extra_args["tensorgate_seed"]), len(outputs[name]))
                assert torch.isfinite(out[row]).sum() == 1 and int(torch.argmax(out[row])) == want, name
            else:
                assert torch.equal(out[row], before[row]), name
            outputs[name].append(int(torch.argmax(out[row])))  # the runner appends to the list it handed over

    update(added=[("a", 0), ("greedy", 1), ("b", 2), ("plain", 3)])
    step()
    step()
    update(moved=[(0, 2, v.lp.MoveDirectionality.SWAP)])  # a <-> b
    row_of["a"], row_of["b"] = 2, 0
    step()
    update(removed=[1])  # greedy leaves; the runner condenses plain (3) into its row
    del row_of["greedy"]
    update(moved=[(3, 1, v.lp.MoveDirectionality.UNIDIRECTIONAL)])
    row_of["plain"] = 1
    step()
    update(added=[("penalised", 3)])  # the client's penalty would be lost under a one-hot row: left to vLLM
    step()
    update(removed=[0, 2])  # a and b leave; a new request on a's old row is not the sampler's
    del row_of["a"], row_of["b"]
    update(added=[("late", 0)])
    logits = torch.randn(4, vocab)
    assert torch.equal(proc.apply(logits.clone()), logits)
