"""The embedded local subnet for tests that speak to it as a client does: started, its validator running, and both
stopped however the test ends; and the official SDK's client for it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from neurons.local_subnet import LocalSubnet, start_local_subnet, stop_local_subnet
from neurons.validator.config import ValidatorConfig

if TYPE_CHECKING:
    import openai


@contextlib.asynccontextmanager
async def running_subnet(cfg: ValidatorConfig, *, seed: int) -> AsyncIterator[LocalSubnet]:
    net = await start_local_subnet(cfg, seed=seed)
    await net.validator.start()
    try:
        yield net
    finally:
        await net.validator.stop()
        await stop_local_subnet(net)


def base_url(net: LocalSubnet) -> str:
    """The subnet's gateway as an OpenAI client's ``base_url``."""
    return f"http://127.0.0.1:{net.validator.gateway.port}/v1"


def sdk_client(net: LocalSubnet, *, timeout: float = 30.0) -> openai.AsyncOpenAI:
    """The official SDK's async client for the subnet: no retries, so a failure shows."""
    import openai

    return openai.AsyncOpenAI(base_url=base_url(net), api_key=net.api_key, max_retries=0, timeout=timeout)
