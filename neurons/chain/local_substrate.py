"""A small local chain behind the bittensor SDK's ``bt.Substrate`` seam.

No subtensor node can be had offline, so the local subnet runs the SDK's *real* client code (reads,
``SetWeights`` conforming, rate-limit preflight, plaintext vs timelocked commit) over this stand-in.
It models only what a validator touches: one or more subnets with neurons (hotkey, coldkey, axon,
validator permit, stake), the weight hyperparameters, ``Weights`` rows, ``LastUpdate``, timelocked
commits and the epoch schedule. Blocks come from a clock (no thread): the head is computed lazily
from wall time, so a 0.25 s block time makes tests fast and 12 s mirrors finney.

Split by job: the state as plain data (:mod:`.local_state`), its file and writer lock
(:mod:`.local_files`: ``<state_dir>/local_chain.json``, atomic tmp + rename after every change, so a
restart keeps the subnet and ``python -m neurons.weights`` can read it with ``read_only=True``), the
chain's weight and commit rules (:mod:`.local_rules`), what storage reads return (:mod:`.local_reads`),
the ``bt.Substrate`` seam's reads and the calls it does not model (:mod:`.local_seam`), and here the seam itself:
the clock, the lock, reveals, and submission.

Example::

    import asyncio, bittensor as bt
    from bittensor.sp_core import Keypair
    from neurons.chain.local_substrate import LocalSubstrate

    sub = LocalSubstrate.open("/tmp/chain", block_time=0.25)
    sub.ensure_subnet(1, min_allowed_weights=1)
    alice = Keypair.create_from_uri("//Alice")
    sub.register(alice.ss58_address, alice.ss58_address, validator_permit=True, stake=1000.0)
    bob = Keypair.create_from_uri("//Bob").ss58_address
    sub.register(bob, bob, endpoint="127.0.0.1:8091")

    async def main():
        client = await bt.Subtensor("local", substrate=sub)
        print(await client.execute(bt.SetWeights(1, weights={1: 1.0}), alice))
        print(await client.weights.weights(1))      # {0: {1: 1.0}}
    asyncio.run(main())

Honest limits of the commit-reveal model: the SDK encrypts commits to a drand round, and drand
signatures cannot be fetched offline, so this chain cannot decrypt a commit. Instead the committing
side may leave the plaintext it conformed (:meth:`LocalSubstrate.expect_commit`, used by
``LocalChain``); the commit is stored with its ciphertext and drand ``reveal_round`` as on chain,
and is revealed by *epoch*: at the first epoch boundary ``reveal_period`` epochs after the commit's
epoch (epochs fire where ``(block + netuid + 1) % (tempo + 1) == 0``), the plaintext is checked like
a fresh ``set_weights`` and written to ``Weights``. A commit with no plaintext alongside (e.g. one
made by another tool) is dropped at that boundary, the way the chain drops a commit it cannot
decrypt. Block-pinned reads are served from head state (block hashes are labels only).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bittensor import Balance, ChainError, ExtrinsicResult, sp_core
from loguru import logger

from .local_blocks import advance, event, log_extrinsic
from .local_files import STATE_FILE, StateDirLocked, StateFile
from .local_rules import Refused, commit_weights, set_weights
from .local_seam import SubstrateReads
from .local_state import (
    RAO_PER_UNIT,
    U16_MAX,
    ChainState,
    Commit,
    Neuron,
    Subnet,
    jsonable,
    parse_endpoint,
)

__all__ = ["LocalSubstrate", "StateDirLocked", "Subnet", "Neuron", "Commit", "parse_endpoint"]


class LocalSubstrate(SubstrateReads):
    """An in-process ``bt.Substrate``: a persistent, clock-driven local subnet chain.

    Construct with :meth:`open`. Mutating helpers (``register``, ``set_hyperparameters``) are for the
    local-subnet orchestrator; everything else is the SDK protocol.
    """

    def __init__(self, state_dir: Path, state: ChainState, *, clock: Callable[[], float], read_only: bool) -> None:
        self.state_dir = state_dir
        self._file = StateFile(state_dir)
        self.read_only = read_only
        self.token_symbols: dict[int, str] = {}
        self._state = state
        self._clock = clock
        self._lock = threading.RLock()
        self._stat: tuple[int, int] | None = None
        self._plaintexts: dict[tuple[int, str], dict[str, Any]] = {}
        self.default_netuid: int | None = None

    # -- opening, persistence -------------------------------------------------------------------

    @staticmethod
    def find_state_dir(path: str | os.PathLike[str]) -> Path:
        """The directory holding the state file: ``path`` itself or its ``chain/`` child."""
        return StateFile.find_state_dir(path)

    @classmethod
    def open(
        cls,
        state_dir: str | os.PathLike[str],
        *,
        block_time: float | None = None,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> LocalSubstrate:
        """Open (or create) the chain stored in ``state_dir``.

        ``block_time`` (seconds, default 12.0 for a new chain) re-anchors the clock at the current
        block when it differs from the stored one, so blocks never go backwards. ``read_only``
        opens an existing chain for reading from another process (it reloads on change, never writes).
        """
        path = Path(state_dir).expanduser()
        if read_only:
            path = StateFile.find_state_dir(path)
            file = StateFile(path)
            if not file.exists():
                raise FileNotFoundError(f"no local chain in {path} (expected {path / STATE_FILE})")
            sub = cls(path, file.read(), clock=clock, read_only=True)
            sub._stat = file.stat()
            return sub
        path.mkdir(parents=True, exist_ok=True)
        now = clock()
        file = StateFile(path)
        if file.exists():
            state = file.read()
        else:
            state = ChainState(anchor_block=1, anchor_time=now, block_time=block_time or 12.0, last_block=1)
        sub = cls(path, state, clock=clock, read_only=False)
        sub._acquire()
        if block_time is not None and block_time != state.block_time:
            head = sub._head()
            state.anchor_block, state.anchor_time, state.block_time = head, now, float(block_time)
        sub._save()
        return sub

    def _refresh(self) -> None:
        """Readers pick up the writer's latest state (cheap stat per operation)."""
        if not self.read_only:
            return
        stat = self._file.stat()
        if stat is not None and stat != self._stat:
            with contextlib.suppress(json.JSONDecodeError, FileNotFoundError):
                self._state = self._file.read()
                self._stat = stat

    def _acquire(self) -> None:
        self._file.lock()

    def _release(self) -> None:
        self._file.unlock()

    def _save(self) -> None:
        if self.read_only:
            return
        if not self._file.locked:
            raise ChainError(f"local chain {self.state_dir} is closed")
        self._file.write(self._state)

    # -- clock ------------------------------------------------------------------------------------

    def _head(self) -> int:
        s = self._state
        elapsed = max(0.0, self._clock() - s.anchor_time)
        return max(s.last_block, s.anchor_block + int(elapsed // s.block_time))

    def _tick(self) -> int:
        """Advance to the clock's head, applying reveals due on the way; returns the head."""
        self._refresh()
        head = self._head()
        if head != self._state.last_block:
            before, self._state.last_block = self._state.last_block, head
            if advance(self._state, before, head, epochs=not self.read_only):
                self._save()
        return head

    # -- orchestrator helpers ---------------------------------------------------------------------

    def ensure_subnet(self, netuid: int, **hyperparameters: Any) -> Subnet:
        """Create ``netuid`` if missing, then apply the given hyperparameters (see ``set_hyperparameters``)."""
        with self._lock:
            head = self._tick()
            if netuid not in self._state.subnets:
                self._state.subnets[netuid] = Subnet(netuid=netuid, registered_at=head)
                logger.info("local chain: created subnet {} at block {}", netuid, head)
            if self.default_netuid is None:
                self.default_netuid = netuid
            self.set_hyperparameters(netuid, **hyperparameters)
            return self._state.subnets[netuid]

    def set_hyperparameters(
        self,
        netuid: int | None = None,
        *,
        tempo: int | None = None,
        weights_rate_limit: int | None = None,
        max_weight_limit: float | None = None,
        min_allowed_weights: int | None = None,
        commit_reveal: bool | None = None,
        reveal_period: int | None = None,
        weights_version_key: int | None = None,
        weights_min_stake: float | None = None,
        max_allowed_uids: int | None = None,
        kappa: int | None = None,
        liquid_alpha: bool | None = None,
        activity_cutoff_factor_milli: int | None = None,
    ) -> None:
        """Set subnet hyperparameters (the owner/sudo setters of the real chain). ``None`` keeps a value.

        ``max_weight_limit`` is a fraction (0..1] of a row's sum; ``weights_min_stake`` is in alpha units; ``kappa``
        is u16 (32767 = 0.5), ``activity_cutoff_factor_milli`` per mille of a tempo, as the chain stores them.
        """
        with self._lock:
            self._tick()  # an epoch due before the change runs with the old values
            s = self._subnet_or_raise(netuid)
            if max_weight_limit is not None and not 0.0 < max_weight_limit <= 1.0:
                raise ValueError("max_weight_limit is a fraction in (0, 1]")
            if tempo is not None and tempo < 1:
                raise ValueError("tempo must be >= 1")
            if reveal_period is not None and reveal_period < 1:
                raise ValueError("reveal_period must be >= 1 epoch")
            updates: dict[str, Any] = {
                "tempo": tempo, "weights_rate_limit": weights_rate_limit,
                "max_weights_limit": None if max_weight_limit is None else round(max_weight_limit * U16_MAX),
                "min_allowed_weights": min_allowed_weights, "commit_reveal": commit_reveal,
                "reveal_period": reveal_period, "weights_version_key": weights_version_key,
                "weights_min_stake_rao": None if weights_min_stake is None else int(weights_min_stake * RAO_PER_UNIT),
                "max_allowed_uids": max_allowed_uids, "kappa": kappa, "liquid_alpha": liquid_alpha,
                "activity_cutoff_factor_milli": activity_cutoff_factor_milli,
            }
            for name, value in updates.items():
                if value is not None:
                    setattr(s, name, type(getattr(s, name))(value))
            self._save()

    def register(
        self,
        hotkey: str,
        coldkey: str,
        endpoint: str | None = "127.0.0.1:0",
        validator_permit: bool = False,
        stake: float = 0.0,
        *,
        netuid: int | None = None,
    ) -> int:
        """Register ``hotkey`` on the subnet and return its uid.

        Re-registering a known hotkey keeps its uid and updates endpoint, permit and stake (a
        restarted local subnet re-serves its miners on new ports). ``stake`` is in alpha units.
        """
        for address in (hotkey, coldkey):
            try:
                sp_core.ss58_decode(address)
            except Exception as e:
                raise ValueError(f"not an ss58 address: {address!r}") from e
        with self._lock:
            head = self._tick()
            s = self._subnet_or_raise(netuid)
            ip, port, ip_type = parse_endpoint(endpoint)
            uid = s.uid_of(hotkey)
            if uid is None:
                if len(s.neurons) >= s.max_allowed_uids:
                    raise ChainError(f"subnet {s.netuid} is full ({s.max_allowed_uids} uids)")
                s.neurons.append(Neuron(hotkey=hotkey, coldkey=coldkey, registered_at=head))
                uid = len(s.neurons) - 1
                if not s.owner_hotkey:
                    s.owner_hotkey, s.owner_coldkey = hotkey, coldkey
            n = s.neurons[uid]
            n.coldkey, n.ip, n.port, n.ip_type = coldkey, ip, port, ip_type
            n.validator_permit, n.stake_rao = bool(validator_permit), int(stake * RAO_PER_UNIT)
            self._log(head, hotkey, "SubtensorModule.burned_register", True, f"uid {uid} on netuid {s.netuid}")
            self._save()
            return uid

    def expect_commit(self, netuid: int, hotkey: str, uids: list[int], values: list[int], version_key: int = 0) -> None:
        """Leave the plaintext of the next timelocked commit by ``hotkey`` (see the module docstring)."""
        with self._lock:
            self._plaintexts[(netuid, hotkey)] = {
                "uids": [int(u) for u in uids], "values": [int(v) for v in values], "version_key": int(version_key),
            }

    def forget_commit(self, netuid: int, hotkey: str) -> None:
        with self._lock:
            self._plaintexts.pop((netuid, hotkey), None)

    def subnet(self, netuid: int | None = None) -> Subnet:
        """The live state of a subnet (read it; mutate only through the helpers)."""
        with self._lock:
            self._tick()
            return self._subnet_or_raise(netuid)

    def extrinsics(self, block: int | None = None) -> list[dict[str, Any]]:
        """Applied extrinsics and reveals (most recent ``EXTRINSIC_LOG_LIMIT``), optionally of one block."""
        with self._lock:
            self._tick()
            return [dict(e) for e in self._state.extrinsics if block is None or e["block"] == block]

    def _subnet_or_raise(self, netuid: int | None) -> Subnet:
        key = self.default_netuid if netuid is None else netuid
        if key is None and len(self._state.subnets) == 1:
            key = next(iter(self._state.subnets))
        if key is None or key not in self._state.subnets:
            raise ChainError(f"subnet {netuid} does not exist on the local chain", "SubnetNotExists")
        return self._state.subnets[key]

    def _log(self, block: int, signer: str, call: str, ok: bool, detail: str, events: list[dict] | None = None) -> int:
        return log_extrinsic(self._state, block, signer, call, ok, detail, events)

    # -- bt.Substrate: lifecycle, metadata ----------------------------------------------------------

    async def connect(self) -> None:
        if not self.read_only:
            self._acquire()  # no-op while held; re-takes the lock after release()

    async def close(self) -> None:
        """The SDK's lifecycle hook: flush. Several clients may share one substrate, so the writer
        lock stays until its owner calls :meth:`release`."""
        with self._lock:
            if self._file.locked:
                self._tick()
                self._save()

    def release(self) -> None:
        """Flush and give up the writer lock (idempotent); another process may then open the chain."""
        with self._lock:
            if self._file.locked:
                self._tick()
                self._save()
            self._release()

    # -- bt.Substrate: calls, fees, submission ------------------------------------------------------

    async def account_next_index(self, address: str) -> int:
        with self._lock:
            self._refresh()
            return int(self._state.nonces.get(address, 0))

    async def submit(self, call: Any, keypair: Any, *, nonce: int | None = None, period: int | None = 64,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True) -> ExtrinsicResult:
        """Check the signature, then apply the call in the head block with the chain's rules."""
        if self.read_only:
            raise ChainError("this local chain was opened read-only")
        module, function, params = call
        address = keypair.ss58_address
        payload = json.dumps([module, function, params, nonce], sort_keys=True, default=jsonable).encode()
        signature = keypair.sign(payload)
        if inspect.isawaitable(signature):
            signature = await signature
        if not sp_core.verify(payload, bytes(signature), address, getattr(keypair, "crypto_type", 1)):
            return ExtrinsicResult(success=False, message="Invalid signature (BadProof)",
                                   error=ChainError("Invalid signature", "BadProof"))
        with self._lock:
            head = self._tick()
            self._state.nonces[address] = self._state.nonces.get(address, 0) + 1
            name = f"{module}.{function}"
            try:
                events = self._dispatch(module, function, dict(params), address, head)
            except Refused as e:
                index = self._log(head, address, name, False, f"{e.name}: {e.text}")
                self._save()
                logger.debug("local chain: {} by {} failed at block {}: {}", name, address, head, e.text)
                return ExtrinsicResult(success=False, message=e.text, block_hash=f"0x{head:064x}",
                                       extrinsic_id=f"{head}-{index:04d}", error=ChainError(e.text, e.name))
            index = self._log(head, address, name, True, _summary(function, params), events)
            self._save()
        return ExtrinsicResult(success=True, message="Success", block_hash=f"0x{head:064x}",
                               extrinsic_id=f"{head}-{index:04d}", fee=Balance.from_rao(0),
                               events=[{**ev, "extrinsic_idx": index} for ev in events])

    def _dispatch(self, module: str, function: str, p: dict[str, Any], signer: str, head: int) -> list[dict]:
        if module != "SubtensorModule":
            raise Refused("CallFiltered", f"the local chain does not implement {module}.{function}")
        netuid = int(p.get("netuid", -1))
        s = self._state.subnets.get(netuid)
        if s is None:
            raise Refused("SubnetNotExists", f"netuid {netuid}")
        if int(p.get("mecid", 0)) != 0:
            raise Refused("MechanismDoesNotExist", "the local chain models mechanism 0 only")
        if function in {"set_mechanism_weights", "set_weights"}:
            if s.commit_reveal:
                raise Refused("CommitRevealEnabled")
            dests = [int(d) for d in p["dests"]]
            values = [int(v) for v in p["weights"]]
            uid = set_weights(s, signer, dests, values, int(p.get("version_key", 0)), head, reveal=False)
            return [event("WeightsSet", {"netuid": netuid, "uid": uid})]
        if function in {"commit_timelocked_mechanism_weights", "commit_timelocked_weights"}:
            uid = commit_weights(s, signer, p["commit"], int(p["reveal_round"]), head,
                                 self._plaintexts.get((s.netuid, signer)))
            self._plaintexts.pop((s.netuid, signer), None)  # taken by the commit it was left for
            return [event("TimelockedWeightsCommitted", {"netuid": netuid, "hotkey": signer,
                                                          "reveal_round": int(p["reveal_round"])})]
        if function in {"serve_axon", "serve_axon_tls"}:
            server_uid = s.uid_of(signer)
            if server_uid is None:
                raise Refused("HotKeyNotRegisteredInNetwork")
            n = s.neurons[server_uid]
            n.ip, n.port, n.ip_type = int(p["ip"]), int(p["port"]), int(p.get("ip_type", 4))
            return [event("AxonServed", {"netuid": netuid, "hotkey": signer})]
        raise Refused("CallFiltered", f"the local chain does not implement {module}.{function}")

    def __del__(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None and file.locked:
            file.unlock()


def _summary(function: str, params: Any) -> str:
    p = dict(params)
    if "dests" in p:
        return f"{len(p['dests'])} weights on netuid {p.get('netuid')}"
    if "reveal_round" in p:
        return f"timelocked commit on netuid {p.get('netuid')}, drand round {p['reveal_round']}"
    return f"netuid {p.get('netuid')}"
