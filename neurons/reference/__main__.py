"""``python -m neurons.reference``: serve the audit reference for validators (``--audit.url``).

Example::

    python -m neurons.reference --model /models/subnet.gguf --host 0.0.0.0 --port 8100 --threads 8
    # the miners' engine instead (a GPU box, vLLM installed; the model as a Hugging Face folder):
    python -m neurons.reference --engine vllm --model /models/subnet-hf --host 0.0.0.0 --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from pathlib import Path

from loguru import logger

from ..flag_types import bound
from ..logs import to_stderr
from ..model.packaged import ModelUnavailable
from ..settings import REFERENCE_PREFIX, add_config_flag, resolve
from ..supervise import until_stop_signal
from .base import Reference
from .llama import LlamaReference
from .server import OpenReferenceRefused, start_reference_service


def build_reference(args: argparse.Namespace) -> Reference:
    """The engine the operator named: llama.cpp over a GGUF file (or the packaged model), or vLLM over a Hugging Face
    folder (:mod:`.vllm`, imported only then: the project's install has no vLLM)."""
    path = None if args.model == "packaged" else Path(args.model).expanduser()
    if args.engine == "vllm":
        if path is None:
            raise ModelUnavailable("--engine vllm needs --model: the subnet's model as a Hugging Face folder")
        from .vllm import VllmReference

        return VllmReference(path, n_ctx=args.context)
    return LlamaReference(path, n_ctx=args.context, threads=args.threads)


async def _run(args: argparse.Namespace) -> int:
    try:
        runner, port = await start_reference_service(build_reference(args), host=args.host, port=args.port)
    except (ModelUnavailable, OpenReferenceRefused) as e:
        logger.error("{}", e)
        return 2
    logger.info("reference service on http://{}:{} (model {})", args.host, port, args.model)
    await until_stop_signal()
    await runner.cleanup()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m neurons.reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flag(p, REFERENCE_PREFIX)
    p.add_argument("--engine", choices=("llama", "vllm"), default="llama",
                   help="llama: llama.cpp over a GGUF file; vllm: the miners' engine over a Hugging Face folder "
                   "(needs vLLM installed, e.g. the field venv)")
    p.add_argument("--model", default="packaged", help="GGUF file (llama) or Hugging Face folder (vllm) of the "
                   "subnet's model, or 'packaged' (llama)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the model")
    p.add_argument("--context", type=int, default=4096, help="context in tokens (longer answers are not audited)")
    bound(p, {"port": (0, 65535), "threads": (1, 256), "context": (64, 1 << 20)})
    return p


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Flags, then ``TENSORGATE_REFERENCE_<FLAG>`` variables, then ``--config``'s TOML file (neurons.settings)."""
    return resolve(build_parser(), argv, env, prefix=REFERENCE_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    to_stderr("info")
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
