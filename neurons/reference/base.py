"""What an audit reference is to the auditor: one verdict per answer, or None when it cannot replay it.

Four references implement it, one a file: :mod:`.llama` (the subnet's model on llama.cpp, in process),
:mod:`.vllm` (the subnet's model in vLLM, the miners' engine, from the field venv), :mod:`.remote` (either run as a
service elsewhere, ``--audit.url``), :mod:`.toy` (the simulated cards' toy model, for the default local subnet and
the soak). The first two replay on a :class:`ForcingEngine`, the one seam between the audit and a model runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from gateway.protocol.measurement import Answer
from scoring.audit import AuditBands, Verdict

if TYPE_CHECKING:
    from neurons.model.grammar import Grammar


class Reference(Protocol):
    """What the auditor needs: a verdict on one answer, or None when it cannot be replayed (not the miner's fault)."""

    name: str
    grammars: bool  # it forces answers bound to a shape under the subnet's grammar (neurons.model.grammar)

    async def start(self) -> None: ...

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None: ...

    async def aclose(self) -> None: ...


class ForcingEngine(Protocol):
    """What a replay needs of a model runtime (:func:`neurons.reference.llama.replay`): the prompt ids the subnet's
    template gives, each token's bytes, the stop ids, the context, and teacher forcing: one row of raw logits per
    completion token and one for what follows."""

    n_ctx: int
    vocab_size: int
    stop_ids: frozenset[int]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def piece(self, token_id: int) -> bytes: ...

    def forced_logits(self, prompt_ids: list[int], completion_ids: list[int] | tuple[int, ...]
                      ) -> npt.NDArray[np.float32]: ...


@runtime_checkable
class Constraining(Protocol):
    """A :class:`ForcingEngine` that can also mask by the subnet's grammar (llama.cpp's): answers bound to a shape
    are replayed on it."""

    def grammar(self, text: str) -> Grammar: ...
