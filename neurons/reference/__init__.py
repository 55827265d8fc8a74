"""The audit reference: the subnet's model held to replay miners' answers, in the validator or as a service.

``base`` (what the auditor needs), ``llama`` (the model on llama.cpp, in process), ``toy`` (the simulated
cards' model), ``remote`` (a reference service over HTTP); ``server``, ``protocol`` and ``__main__`` are the
service itself: ``python -m neurons.reference --model /models/subnet.gguf --port 8100`` serves the same
replay the validator runs in process, so an operator can put the model on a GPU box and point
``--audit.url`` at it.
"""
