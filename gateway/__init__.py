"""The OpenAI-compatible gateway: routing (``router``), the miner path (``upstream``), HTTP (``server``).

Modules are imported explicitly (``from gateway.server import Gateway``) so that using the pure
router does not pull in aiohttp or the bittensor SDK.
"""
