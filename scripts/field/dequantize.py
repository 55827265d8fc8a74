"""Turn the packaged GGUF into a Hugging Face folder vLLM loads on a CPU, with the subnet's chat template.

Why: vLLM's GGUF loader needs CUDA/Triton kernels, so a CPU vLLM cannot serve the packaged file directly. The
dequantized float32 weights are the same numbers llama.cpp multiplies (Q4_K_M blocks expanded), so an honest vLLM
on them answers what the llama.cpp reference expects within the audit's bands (measured in the closing note of
issue 37). The folder gets the subnet's template (``neurons/model/chat_template.jinja``) and Gemma's two stop ids
(``<eos>`` 1 and ``<end_of_turn>`` 106), which the GGUF's metadata does not carry into transformers' config.

Run with the field venv's Python (transformers, gguf and accelerate; never the project's own venv)::

    .field/venv/bin/python scripts/field/dequantize.py OUT_DIR [GGUF]    # default: the packaged model

(the field rig also dequantizes a Q2_K requantization of the model, the cheaper copy a cheat would serve).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from neurons.model.chat_template import jinja_template  # noqa: E402

STOP_IDS = [1, 106]  # <eos>, <end_of_turn>


def packaged_gguf() -> Path:
    """The GGUF the project's ``real`` extra installed (assembled in the project venv's cache)."""
    from neurons.model.packaged import cache_dir

    found = sorted(cache_dir().glob("*.gguf"))
    if not found:
        raise SystemExit(f"no assembled GGUF in {cache_dir()}: run `.venv/bin/python -c 'from neurons.model.packaged "
                         "import model_path; print(model_path())'` first")
    return found[0]


def dequantize(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # type: ignore[import-not-found]  # field venv

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    # the GGUF's quantization setting is left over on weights that are now plain float32: drop it, or transformers
    # refuses to save them and vLLM would look for GGUF kernels
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.eos_token_id = STOP_IDS
    model.generation_config.eos_token_id = STOP_IDS
    tokenizer.chat_template = jinja_template()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(jinja_template(), encoding="utf-8")
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print("usage: dequantize.py OUT_DIR [GGUF]", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    if (out / "config.json").exists():
        print(f"{out}: already there")
        return 0
    start = time.monotonic()
    dequantize(Path(sys.argv[2]) if len(sys.argv) == 3 else packaged_gguf(), out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"dequantized into {out}: {size / 1e6:.0f} MB in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
