"""The embedded local subnet for tests that speak to it as a client does: started, its validator running, and both
stopped however the test ends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from neurons.local_subnet import LocalSubnet, start_local_subnet, stop_local_subnet
from neurons.validator.config import ValidatorConfig


@contextlib.asynccontextmanager
async def running_subnet(cfg: ValidatorConfig, *, seed: int) -> AsyncIterator[LocalSubnet]:
    net = await start_local_subnet(cfg, seed=seed)
    await net.validator.start()
    try:
        yield net
    finally:
        await net.validator.stop()
        await stop_local_subnet(net)
