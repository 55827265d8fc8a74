"""The OpenAI-compatible gateway. A request flows down this list, once:

- :mod:`gateway.app`: the front door (routes, API keys, request validation);
- :mod:`gateway.relay`: one request's life (lease, open, relay, retry before the first byte, release);
- :mod:`gateway.router`: the pure choice among miners (weighted-random least-in-flight);
- :mod:`gateway.upstream`: the signed, measured stream to one miner;
- :mod:`gateway.http`: the HTTP/1.1 transport on both sides (front-door server, miner client);
- :mod:`gateway.protocol`: the wire rules shared with the reference miner and the test doubles, and the vocabulary
  scoring reads (the measurement record, which answers an audit can check, sampling): scoring imports nothing
  else of the gateway, and the gateway nothing of scoring (``tests/test_structure.py``).

Modules are imported explicitly (``from gateway.app import Gateway``) so that using the pure router does
not pull in aiohttp or the bittensor SDK.
"""
