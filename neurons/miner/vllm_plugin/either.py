"""``SubnetSampler``: one plugin name for whichever logits-processor interface the installed vLLM offers.

vLLM resolves ``--logits-processors module:Class`` in its frontend (to validate each request's parameters) and in
the worker (to build the processor), and each loader checks that the class subclasses *its* interface's
``LogitsProcessor``. Which loader runs is decided at engine start by the runner it picks, not by anything an
import can see. So where both interfaces exist, ``SubnetSampler`` subclasses both abstract bases and builds, when
instantiated, the processor for the runner that called it: V1 passes ``(vllm_config, device, is_pin_memory)``,
V2 passes ``(vllm_config, req_states)``. Both processors share the torch sampler and the seed check.
"""

from __future__ import annotations

import functools
from typing import Any

from . import requested_seed


@functools.cache
def subnet_sampler() -> type:
    """The class to name in ``--logits-processors``; ImportError when vLLM offers neither interface."""
    impls: list[type] = []
    try:
        from .processor import SubnetSamplerV2

        impls.append(SubnetSamplerV2)
    except ImportError:
        pass
    try:
        from .processor_v1 import SubnetSamplerV1

        impls.append(SubnetSamplerV1)
    except ImportError:
        pass
    if not impls:
        raise ImportError("neither of vLLM's logits-processor interfaces (V1 or Model Runner V2) imports here")
    if len(impls) == 1:
        return impls[0]
    v2, v1 = impls
    bases = tuple(impl.__mro__[1] for impl in (v1, v2))  # each interface's own LogitsProcessor

    def __new__(cls: type, vllm_config: Any, *args: Any) -> Any:
        impl = v1 if len(args) == 2 else v2  # V1: (device, is_pin_memory); V2: (req_states,)
        return impl(vllm_config, *args)  # not an instance of cls: Python calls no __init__ after this

    def validate_params(cls: type, sampling_params: Any) -> None:
        requested_seed(sampling_params)

    return type("SubnetSampler", bases, {"__new__": __new__, "validate_params": classmethod(validate_params),
                                         "__module__": __name__,
                                         "__doc__": "The subnet sampler for vLLM's V1 or V2 runner, as it asks."})
