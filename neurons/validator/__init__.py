"""The validator process: config (:mod:`.config`), the one wiring (:mod:`.build`), the neuron and its loops
(:mod:`.neuron`), probe traffic (:mod:`.probes`, :mod:`.prompts`) and the command line (:mod:`.cli`).

``python -m neurons.validator`` runs :func:`neurons.validator.cli.main`.
"""

from .cli import main

__all__ = ["main"]
