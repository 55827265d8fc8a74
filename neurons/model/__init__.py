"""The subnet's model on this machine: the packaged Gemma 3 270M, its chat template and a llama.cpp engine.

Shared by the reference miner's real runtime (generation) and the validator's audit reference
(teacher forcing), so both render prompts and read tokens the same way.
"""
