"""Entry point of one gateway worker process the validator starts (``--gateway.workers``): reads its spec on stdin.

The spec is JSON: ``config`` (the validator's, :func:`~neurons.validator.config.config_to_json`, with the port it
bound), ``api_keys`` (keys given as a list, the local subnet's) and ``parent`` (the validator's pid: a worker whose
validator died, by kill -9 too, stops rather than serve with no one scoring). The key is loaded here as the validator
loads it (the wallet's hotkey, or the local subnet's development key), never sent through the pipe. The worker writes
one line, ``listening <port>``, on stdout once it serves; its logs go to stderr, the validator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any

from loguru import logger

from .config import ValidatorConfig, config_from_json


def worker_keypair(cfg: ValidatorConfig) -> Any:
    """The validator's hotkey, loaded the way the validator loads it."""
    from ..keys import dev_keypair, load_hotkey

    if cfg.local:
        from ..local_subnet import VALIDATOR_URI

        return dev_keypair(VALIDATOR_URI)
    return load_hotkey(cfg.wallet_name, cfg.wallet_hotkey, cfg.wallet_path)


def main() -> int:
    from .gateway_only import run_gateway
    from .process import configure_logging, raise_open_files_limit, until_stopped

    spec = json.loads(sys.stdin.readline())
    cfg = config_from_json(spec["config"])
    configure_logging(cfg.log_level, cfg.log_format)
    raise_open_files_limit()

    def ready(port: int) -> None:
        sys.stdout.write(f"listening {port}\n")
        sys.stdout.flush()

    async def run() -> int:
        gateway = asyncio.create_task(run_gateway(cfg, worker_keypair(cfg), api_keys=spec.get("api_keys"),
                                                  on_ready=ready))
        orphaned = asyncio.create_task(_parent_gone(int(spec.get("parent", os.getppid()))))
        try:  # until the gateway ends, SIGTERM stops this task, or the validator died (kill -9): never serve alone
            await asyncio.wait({gateway, orphaned}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            orphaned.cancel()
            if not gateway.done():
                gateway.cancel()  # it drains its streams and sends its last measurements before it ends
            with contextlib.suppress(asyncio.CancelledError):
                await gateway
        return 0 if gateway.cancelled() else gateway.result()

    try:
        return asyncio.run(until_stopped(run()))
    except KeyboardInterrupt:
        return 0


async def _parent_gone(parent: int) -> None:
    """Return once the process that started this one is gone (this one is then re-parented)."""
    while os.getppid() == parent:  # noqa: ASYNC110 - polls the OS, no event to wait on
        await asyncio.sleep(1.0)
    logger.warning("the validator (pid {}) is gone: this gateway worker stops", parent)


if __name__ == "__main__":
    raise SystemExit(main())
