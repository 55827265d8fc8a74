"""The read side of the local chain's ``bt.Substrate`` seam (blocks, storage, runtime calls), its free fees, and
the parts of the protocol it does not model, each refusing by name. A mixin of
:class:`neurons.chain.local_substrate.LocalSubstrate`, which owns the state, the clock and the lock they read."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from bittensor import Balance, ChainError, ExtrinsicResult

from .local_reads import metagraph, read_storage, read_storage_map
from .local_state import ChainState


class SubstrateReads:
    """Reads served from the head state (block hashes are labels only); calls the local chain does not model."""

    _lock: threading.RLock
    _state: ChainState

    token_symbols: dict[int, str]

    def _tick(self) -> int:  # the head block, the clock advanced (LocalSubstrate's)
        raise NotImplementedError

    def balance(self, rao: int, netuid: int = 0) -> Balance:
        symbol = self.token_symbols.get(netuid) if netuid else None
        return Balance(int(rao), netuid, symbol)

    async def block_hash(self, block: int | None = None) -> str:
        with self._lock:
            number = self._tick() if block is None else int(block)
        return f"0x{number:064x}"

    async def block_number(self) -> int:
        with self._lock:
            return self._tick()

    async def finalized_block_number(self) -> int:
        return await self.block_number()  # instant finality

    async def block_time(self) -> float:
        return self._state.block_time

    async def spec_version(self) -> int:
        return 1

    async def get_block(self, block_number: int | None = None, block_hash: str | None = None) -> dict | None:
        with self._lock:
            head = self._tick()
            number = int(block_hash, 16) if block_hash else (head if block_number is None else int(block_number))
            if number > head:
                return None
            extrinsics = [{"call": {"call_module": "Timestamp", "call_function": "set",
                                    "call_args": [{"name": "now", "value": self._state.block_timestamp_ms(number)}]}}]
            extrinsics += [{"call": {"call_module": e["call"].split(".")[0], "call_function": e["call"].split(".")[-1],
                                     "call_args": []}, "signer": e["signer"]}
                           for e in self._state.extrinsics if e["block"] == number and "." in e["call"]]
            header = {"number": number, "hash": f"0x{number:064x}", "parentHash": f"0x{max(0, number - 1):064x}"}
            return {"header": header, "extrinsics": extrinsics}

    async def events(self, block_hash: str | None = None) -> list[dict]:
        with self._lock:
            number = int(block_hash, 16) if block_hash else self._tick()
            return [{**ev, "extrinsic_idx": e["index"]} for e in self._state.extrinsics
                    if e["block"] == number for ev in e["events"]]

    async def blocks(self, *, finalized: bool = False) -> AsyncIterator[dict]:
        """Yield each new head as the clock reaches it (sleeps, no polling thread)."""
        last = await self.block_number()
        while True:
            await asyncio.sleep(max(0.01, self._state.block_time / 4))
            head = await self.block_number()
            for number in range(last + 1, head + 1):
                yield {"header": {"number": number, "parentHash": f"0x{number - 1:064x}"}}
            last = max(last, head)

    # -- bt.Substrate: reads ------------------------------------------------------------------------

    async def query(self, module: str, storage_function: str, params: list | None = None,
                    block_hash: str | None = None) -> Any:
        with self._lock:
            head = self._tick()
            return read_storage(self._state, module, storage_function, list(params or []), head)

    async def query_batch(self, module: str, storage_function: str, param_sets: list[list],
                          block_hash: str | None = None) -> list[Any]:
        with self._lock:
            head = self._tick()
            return [read_storage(self._state, module, storage_function, list(p), head) for p in param_sets]

    async def map_has_entries(self, module: str, storage_function: str, params: list,
                              block_hash: str | None = None) -> bool:
        return bool(await self.query_map(module, storage_function, params, block_hash))

    async def query_map(self, module: str, storage_function: str, params: list | None = None,
                        block_hash: str | None = None) -> list[tuple[Any, Any]]:
        with self._lock:
            self._tick()
            return read_storage_map(self._state, module, storage_function, list(params or []))

    async def runtime_call(self, api: str, method: str, params: list, block_hash: str | None = None) -> Any:
        with self._lock:
            head = self._tick()
            if api == "SubnetInfoRuntimeApi" and method == "get_metagraph":
                s = self._state.subnets.get(int(params[0]))
                return None if s is None else metagraph(s, head)
            if api == "SubnetInfoRuntimeApi" and method == "get_next_epoch_start_block":
                s = self._state.subnets.get(int(params[0]))
                return None if s is None else s.epoch_block(s.epoch_index(head) + 1)
            raise ChainError(f"the local chain does not implement runtime API {api}.{method}")

    async def constant(self, module: str, name: str) -> Any:
        raise ChainError(f"the local chain does not model constant {module}.{name}")

    async def decode_scale(self, type_string: str, data: Any) -> Any:
        raise ChainError("the local chain has no SCALE runtime metadata")

    # -- bt.Substrate: fees ------------------------------------------------------------------------

    async def compose(self, call: Any) -> Any:
        return call  # a generated Call(module, function, params) is already all this chain needs

    async def estimate_fee(self, call: Any, keypair: Any) -> Balance:
        return Balance.from_rao(0)

    async def estimate_weight(self, call: Any, keypair: Any) -> dict:
        return {"ref_time": 0, "proof_size": 0}

    async def mev_next_key(self) -> bytes | None:
        return None

    # -- bt.Substrate: the rest of the protocol (not modelled) --------------------------------------

    async def sign_extrinsic(self, call: Any, keypair: Any, *, nonce: int, period: int) -> tuple[bytes, str]:
        raise ChainError("the local chain does not support MEV-shielded submission")

    async def find_extrinsic(self, extrinsic_hash: str, block_hash: str) -> ExtrinsicResult | None:
        return None

    async def prepare(self, call: Any, *, address: str, crypto_type: int = 1, nonce: int | None = None,
                      period: int | None = 64, tip: int = 0, metadata_hash: bytes | None = None) -> Any:
        raise ChainError("the local chain does not support out-of-process signing")

    async def submit_signature(self, unsigned: Any, signature: bytes | str, *, wait_for_inclusion: bool = True,
                               wait_for_finalization: bool = True) -> ExtrinsicResult:
        raise ChainError("the local chain does not support out-of-process signing")

    async def submit_signed(self, extrinsic: Any, keypair: Any, *, wait_for_inclusion: bool = True,
                            wait_for_finalization: bool = True) -> ExtrinsicResult:
        raise ChainError("the local chain does not support pre-signed extrinsics")

    def multisig_account(self, signatories: list[str], threshold: int) -> Any:
        raise ChainError("the local chain does not support multisig")

    async def submit_multisig(self, call: Any, keypair: Any, multisig_account: Any, *,
                              wait_for_inclusion: bool = True, wait_for_finalization: bool = True) -> ExtrinsicResult:
        raise ChainError("the local chain does not support multisig")
