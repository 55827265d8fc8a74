#!/usr/bin/env bash
# The vLLM plugin's tests against vLLM's own logits-processor classes, on this CPU, in a venv of their own
# (vLLM is never in this project's install). vLLM 0.34.0 pins a CUDA build of torch 2.14.0 and GPU kernels; its
# logits-processor interface and SamplingParams need neither, so it goes in with --no-deps beside the CPU torch
# and the pure-Python packages those two import. Measured here: 12 s for vLLM, ~30 s for the rest, 1.8 GB.
#   bash scripts/check_vllm_plugin.sh [VENV]      # default /tmp/tensorgate-vllm
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-/tmp/tensorgate-vllm}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q --no-deps vllm==0.34.0
    "$venv/bin/pip" install -q packaging regex cachetools psutil sentencepiece numpy requests tqdm blake3 py-cpuinfo \
        'transformers<5.23.0,>=5.16.1' tokenizers safetensors protobuf 'fastapi<0.137' starlette aiohttp openai \
        pydantic orjson prometheus_client pillow tiktoken typing_extensions partial-json-parser jsonschema pyzmq \
        msgspec pyyaml einops cloudpickle cbor2 pybase64 ijson setproctitle watchfiles python-json-logger uvloop pytest
fi
# --noconftest: the suite's conftest needs bittensor; this file needs only numpy, torch, vLLM and our sampler spec
PYTHONPATH=. "$venv/bin/python" -m pytest -q --noconftest -p no:cacheprovider tests/test_vllm_plugin.py -rs
