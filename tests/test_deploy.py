"""The deployment files (issue 26): settings examples that parse, systemd units that verify, a dashboard that
asks only for metrics the validator exports, and (where a Docker daemon and a base image are at hand) the image.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "scripts" / "deploy"


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_else() -> None:
    """Issue 40: a Docker build sent a 1.7 GB context (.venv, .field, .git). ``.dockerignore`` lets through exactly the
    paths the Dockerfile copies from the context, so a new COPY without its line here fails this test."""
    copied: set[str] = set()
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            copied.update(w.rstrip("/") for w in words[1:-1])
    rules = [x.strip() for x in (DEPLOY.parent.parent / ".dockerignore").read_text().splitlines()]
    rules = [x for x in rules if x and not x.startswith("#")]
    assert rules[0] == "*"  # everything out, then the copied paths back in
    allowed = {x[1:].rstrip("/") for x in rules if x.startswith("!")}
    assert allowed == copied == {"pyproject.toml", "README.md", "gateway", "neurons", "scoring"}


def test_the_example_settings_files_are_valid_settings() -> None:
    from neurons.miner.cli import parse_args as miner_args
    from neurons.validator.config import parse_args

    cfg = parse_args(["--config", str(DEPLOY / "validator.example.toml")], env={})
    assert (cfg.netuid, cfg.gateway_host, cfg.models, cfg.wallet_name) == (7, "0.0.0.0", ["google/gemma-3-270m-it"],
                                                                           "vali")
    assert cfg.chain_fallbacks and cfg.log_access and cfg.audit_model.endswith(".gguf")
    args = miner_args(["--config", str(DEPLOY / "miner.example.toml")], env={})
    assert (args.slots, args.runtime_sampler, args.axon_port) == (8, "subnet", 8091)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine")
def test_the_systemd_units_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify``, with the units' interpreter pointed at this one (it must exist to verify)."""
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text().replace("/opt/tensorgate/.venv/bin/python", sys.executable)
        (tmp_path / unit.name).write_text(text)
        assert "--config" in text or "neurons.reference" in text
    units = sorted(str(p) for p in tmp_path.glob("*.service"))
    assert len(units) == 3
    done = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0 and not problems, problems


def _family(name: str) -> str:
    return re.sub(r"_(bucket|count|sum|total)$", "", name)


async def test_the_dashboard_asks_only_for_metrics_the_validator_exports(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from neurons.keys import dev_keypair
    from neurons.validator.build import build_validator
    from neurons.validator.config import ValidatorConfig
    from neurons.validator.metrics import validator_families
    from tests.test_validator import FakeChain

    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tensorgate.json").read_text())
    wanted = {_family(m) for panel in dashboard["panels"] for t in panel["targets"]
              for m in re.findall(r"\b(?:tensorgate|gen_ai|process)_\w+", re.sub(r"by \([^)]*\)", "", t["expr"]))}
    assert len(dashboard["panels"]) >= 10 and len(wanted) >= 10
    assert {"gen_ai_server_time_to_first_token_seconds", "gen_ai_client_token_usage", "process_cpu_seconds"} <= wanted
    v = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0, audit_model="toy"), FakeChain([]),
                        dev_keypair("Alice"))
    await v.sync_metagraph()
    v.weights.last_block = 100  # as after a first submission: until then the family is left out
    v.gateway.metrics.add(lambda: validator_families(v))  # as Validator.start plugs it
    # the gateway's families, the process's and the validator's, as /metrics serves them
    exported = {_family(f.name) for f in text_string_to_metric_families(generate_latest(v.gateway.registry).decode())}
    assert wanted <= exported, sorted(wanted - exported)


@pytest.mark.skipif(not os.environ.get("TENSORGATE_DOCKER_BASE") or shutil.which("docker") is None,
                    reason="set TENSORGATE_DOCKER_BASE to a local base image (and run a Docker daemon) to build")
def test_the_validator_image_builds_and_runs_a_local_round() -> None:
    """Builds the validator image (EXTRAS="": a minute) and runs one round of the simulated subnet in it."""
    root = DEPLOY.parent.parent
    tag = "tensorgate-validator:test"
    subprocess.run(["docker", "build", "--network", "host", "-f", str(DEPLOY / "Dockerfile"), "--target", "validator",
                    "--build-arg", f"BASE={os.environ['TENSORGATE_DOCKER_BASE']}", "--build-arg", "EXTRAS=", "-t", tag,
                    str(root)], check=True, timeout=1200)
    done = subprocess.run(["docker", "run", "--rm", "--network", "host", tag, "--local", "--local.rounds", "1",
                           "--local.round-seconds", "8", "--gateway.port", "0"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "round 1: 4 miners" in done.stderr and "last weights set at block" in done.stderr
