"""The subnet's sampler as a vLLM logits processor, so a miner on stock vLLM passes the audit token by token.

Start vLLM with it (the miner's box needs this package and torch, which vLLM brings)::

    vllm serve <the subnet's model> --logits-processors neurons.miner.vllm_plugin:SubnetSampler

then the miner with ``--runtime.url http://127.0.0.1:8000 --runtime.sampler subnet``: the proxy runtime passes
each request's seed as ``vllm_xargs.tensorgate_seed``, the processor keeps only the subnet sampler's token in
each sampled row (:mod:`.sampler`, torch), and vLLM's own sampling can then pick nothing else.

vLLM has two logits-processor interfaces, and which one loads the plugin depends on the runner the engine picks at
start (Model Runner V2 where Triton and every feature in use allow it, Model Runner V1 otherwise: on every CPU):
:class:`~.processor.SubnetSamplerV2` implements V2's, :class:`~.processor_v1.SubnetSamplerV1` V1's, both over the
same torch sampler. ``SubnetSampler`` is the one name an operator writes: a class that both loaders accept where
the installed vLLM has both interfaces (0.32), and that builds the processor for whichever runner instantiates it;
where vLLM has one interface only (0.34 dropped V1), it is that one's processor. The classes load lazily, so
:mod:`.sampler` and :func:`requested_seed` import without vLLM.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.sampling import is_seed

SEED_ARG = "tensorgate_seed"  # the extra argument (vllm_xargs) a request names the subnet sampler's seed in


def requested_seed(params: Any) -> int | None:
    """The subnet sampler's seed a request asked for (``extra_args``), or None; ValueError for a malformed one."""
    extra = getattr(params, "extra_args", None) or {}
    if SEED_ARG not in extra:
        return None
    seed = extra[SEED_ARG]
    if not is_seed(seed):
        raise ValueError(f"{SEED_ARG} must be an integer in 0..2**63-1, got {seed!r}")
    return seed


def __getattr__(name: str) -> Any:
    if name == "SubnetSampler":
        from .either import subnet_sampler

        return subnet_sampler()
    if name == "SubnetSamplerV2":
        from .processor import SubnetSamplerV2

        return SubnetSamplerV2
    if name == "SubnetSamplerV1":
        from .processor_v1 import SubnetSamplerV1

        return SubnetSamplerV1
    raise AttributeError(name)
