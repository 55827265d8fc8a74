"""The local chain's state: subnets, neurons, weights, commits, and the block anchor, as plain data.

Kept apart from the file it is stored in (:mod:`.local_files`) and from the ``bt.Substrate`` that serves
it (:mod:`.local_substrate`), so the chain's rules there work on data a test can build in one line.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field
from typing import Any

U16_MAX = 65535
RAO_PER_UNIT = 10**9
MECHANISM_STRIDE = 4096  # GLOBAL_MAX_SUBNET_COUNT: storage index = mechid * 4096 + netuid
MAX_UNREVEALED_COMMITS = 10
EXTRINSIC_LOG_LIMIT = 500
STATE_VERSION = 1


@dataclass
class Neuron:
    hotkey: str
    coldkey: str
    ip: int = 0
    port: int = 0
    ip_type: int = 4
    validator_permit: bool = False
    stake_rao: int = 0
    registered_at: int = 0
    last_update: int = 0  # 0 = never set weights (the SDK's preflight and the chain skip the limit)
    # what the last epoch left (neurons.chain.local_epoch): u16 shares, the epoch's emission in rao
    consensus: int = 0
    incentive: int = 0
    dividends: int = 0
    validator_trust: int = 0
    emission_rao: int = 0
    active: bool = True


@dataclass
class Commit:
    hotkey: str
    commit_block: int
    epoch: int
    reveal_block: int
    reveal_round: int
    ciphertext: str  # 0x-hex, as the chain stores it
    plaintext: dict[str, Any] | None = None  # {"uids", "values", "version_key"} when the committer left it


@dataclass
class Subnet:
    netuid: int
    tempo: int = 360
    weights_rate_limit: int = 100
    max_weights_limit: int = U16_MAX  # u16; the cap is this / 65535 of a row's sum
    min_allowed_weights: int = 1
    commit_reveal: bool = False
    reveal_period: int = 1  # epochs
    weights_version_key: int = 0
    weights_min_stake_rao: int = 0
    max_allowed_uids: int = 256
    consensus: str = "Yuma"
    # Yuma 3's hyperparameters, at the chain's defaults (scoring.yuma.YumaParams)
    kappa: int = 32767
    bonds_penalty: int = U16_MAX
    bonds_moving_average: int = 900_000
    liquid_alpha: bool = False
    alpha_low: int = 45_875
    alpha_high: int = 58_982
    alpha_sigmoid_steepness: int = 1000
    max_allowed_validators: int = 128
    activity_cutoff_factor_milli: int = 13_889  # the cutoff is this / 1000 tempos (5,000 blocks at tempo 360)
    name: str = "tensorgate-local"
    symbol: str = "α"
    registered_at: int = 0
    owner_hotkey: str = ""
    owner_coldkey: str = ""
    neurons: list[Neuron] = field(default_factory=list)
    weights: dict[int, list[list[int]]] = field(default_factory=dict)  # uid -> [[dest, u16], ...]
    commits: list[Commit] = field(default_factory=list)
    bonds: dict[int, list[list[int]]] = field(default_factory=dict)  # validator uid -> [[miner uid, u16], ...]
    last_step: int = 0  # the block of the last epoch run (0: none yet)

    # Epoch schedule: the classic subtensor rule, an epoch at every block with
    # (block + netuid + 1) % (tempo + 1) == 0; its index counts epochs since genesis.
    def epoch_index(self, block: int) -> int:
        return (block + self.netuid + 1) // (self.tempo + 1) if self.tempo > 0 else 0

    def epoch_block(self, index: int) -> int:
        return max(0, index * (self.tempo + 1) - self.netuid - 1)

    def last_epoch_block(self, block: int) -> int:
        index = self.epoch_index(block)
        return self.epoch_block(index) if index > 0 else 0

    @property
    def activity_cutoff(self) -> int:
        """Blocks without a weight update before a validator's stake stops counting (``get_activity_cutoff_blocks``)."""
        return max(1, self.activity_cutoff_factor_milli * self.tempo // 1000)

    def uid_of(self, hotkey: str) -> int | None:
        for uid, n in enumerate(self.neurons):
            if n.hotkey == hotkey:
                return uid
        return None


@dataclass
class ChainState:
    anchor_block: int
    anchor_time: float
    block_time: float
    last_block: int
    subnets: dict[int, Subnet] = field(default_factory=dict)
    extrinsics: list[dict[str, Any]] = field(default_factory=list)
    nonces: dict[str, int] = field(default_factory=dict)
    version: int = STATE_VERSION

    def block_timestamp_ms(self, block: int) -> int:
        """When ``block`` was (or will be) produced, on the anchored clock, in ms (``Timestamp.Now``)."""
        return int((self.anchor_time + (block - self.anchor_block) * self.block_time) * 1000)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ChainState:
        subnets: dict[int, Subnet] = {}
        for key, s in raw.get("subnets", {}).items():
            s = dict(s)
            neurons = [Neuron(**n) for n in s.pop("neurons", [])]
            weights = {int(uid): [list(map(int, p)) for p in row] for uid, row in s.pop("weights", {}).items()}
            commits = [Commit(**c) for c in s.pop("commits", [])]
            bonds = {int(uid): [list(map(int, p)) for p in row] for uid, row in s.pop("bonds", {}).items()}
            subnets[int(key)] = Subnet(**s, neurons=neurons, weights=weights, commits=commits, bonds=bonds)
        return cls(
            anchor_block=int(raw["anchor_block"]), anchor_time=float(raw["anchor_time"]),
            block_time=float(raw["block_time"]), last_block=int(raw["last_block"]), subnets=subnets,
            extrinsics=list(raw.get("extrinsics", [])), nonces=dict(raw.get("nonces", {})),
        )


def parse_endpoint(endpoint: str | None) -> tuple[int, int, int]:
    """``"ip:port"`` / ``"[v6]:port"`` -> (ip as int, port, ip_type); None -> nothing served."""
    if not endpoint:
        return 0, 0, 4
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint must be 'ip:port', got {endpoint!r}")
    addr = ipaddress.ip_address(host.strip("[]"))
    return int(addr), int(port), addr.version


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    return str(value)
