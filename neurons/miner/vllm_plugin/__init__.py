"""The subnet's sampler as a vLLM logits processor, so a miner on stock vLLM passes the audit token by token.

Start vLLM with it (the miner's box needs this package and torch, which vLLM brings)::

    vllm serve <the subnet's model> --logits-processors neurons.miner.vllm_plugin:SubnetSampler

then the miner with ``--runtime.url http://127.0.0.1:8000 --runtime.sampler subnet``: the proxy runtime passes
each request's seed as ``vllm_xargs.tensorgate_seed``, the processor keeps only the subnet sampler's token in
each sampled row (:mod:`.sampler`, torch), and vLLM's own sampling can then pick nothing else.

``SubnetSampler`` (:mod:`.processor`) implements vLLM's Model Runner V2 interface (vLLM 0.34's only one); it is
loaded lazily here so that :mod:`.sampler` imports without vLLM (torch and the numpy spec only).
"""

from __future__ import annotations

from typing import Any

SEED_ARG = "tensorgate_seed"  # the extra argument (vllm_xargs) a request names the subnet sampler's seed in


def __getattr__(name: str) -> Any:
    if name == "SubnetSampler":
        from .processor import SubnetSampler

        return SubnetSampler
    raise AttributeError(name)
