"""A reference service: the validator's audit reference in a process (or on a machine) of its own.

``python -m neurons.reference --model /models/subnet.gguf --port 8100`` serves the same replay the
validator runs in process (:class:`neurons.validator.reference.LlamaReference`) over HTTP, so an
operator can put the model on a GPU box and point ``--audit.url`` at it.
"""
