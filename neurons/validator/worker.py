"""Entry point of one gateway worker process the validator starts (``--gateway.workers``): reads its spec on stdin.

The spec is JSON: ``config`` (the validator's, :func:`~neurons.validator.config.config_to_json`, with the port it
bound), ``api_keys`` (keys given as a list, the local subnet's) and ``name``. The key is loaded here as the validator
loads it (the wallet's hotkey, or the local subnet's development key), never sent through the pipe. The worker writes
one line, ``listening <port>``, on stdout once it serves; its logs go to stderr, the validator's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from .config import ValidatorConfig, config_from_json


def worker_keypair(cfg: ValidatorConfig) -> Any:
    """The validator's hotkey, loaded the way the validator loads it."""
    from ..keys import dev_keypair, load_hotkey

    if cfg.local:
        from ..local_subnet import VALIDATOR_URI

        return dev_keypair(VALIDATOR_URI)
    return load_hotkey(cfg.wallet_name, cfg.wallet_hotkey, cfg.wallet_path)


def main() -> int:
    from .cli import _configure_logging, _until_stopped, raise_open_files_limit
    from .gateway_only import run_gateway

    spec = json.loads(sys.stdin.readline())
    cfg = config_from_json(spec["config"])
    _configure_logging(cfg.log_level, cfg.log_format)
    raise_open_files_limit()

    def ready(port: int) -> None:
        sys.stdout.write(f"listening {port}\n")
        sys.stdout.flush()

    try:
        return asyncio.run(_until_stopped(run_gateway(cfg, worker_keypair(cfg), api_keys=spec.get("api_keys"),
                                                      on_ready=ready)))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
