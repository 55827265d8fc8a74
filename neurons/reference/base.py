"""What an audit reference is to the auditor: one verdict per answer, or None when it cannot replay it.

Three references implement it, one a file: :mod:`.llama` (the subnet's model on llama.cpp, in process),
:mod:`.remote` (that same code run as a service elsewhere, ``--audit.url``), :mod:`.toy` (the simulated
cards' toy model, for the default local subnet and the soak).
"""

from __future__ import annotations

from typing import Protocol

from scoring.audit import AuditBands, Verdict
from scoring.measurement import Answer


class Reference(Protocol):
    """What the auditor needs: a verdict on one answer, or None when it cannot be replayed (not the miner's fault)."""

    name: str

    async def start(self) -> None: ...

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None: ...

    async def aclose(self) -> None: ...
