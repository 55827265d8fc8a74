"""The chain's own weight rules, applied to local state: ``do_set_weights`` and the timelocked commit, in order.

Pure functions over :class:`~.local_state.Subnet` data, so the rules can be read (and tested) apart from
the ``bt.Substrate`` plumbing that calls them (:mod:`.local_substrate`). A broken rule raises
:class:`Refused` with the chain's error name: the extrinsic is included but fails, as on chain.
"""

from __future__ import annotations

from typing import Any

from .local_state import MAX_UNREVEALED_COMMITS, U16_MAX, Commit, Subnet, jsonable


class Refused(Exception):
    """A dispatch error: the extrinsic is included but fails, as on chain."""

    def __init__(self, name: str, detail: str = "") -> None:
        self.name = name
        self.text = name + (f" ({detail})" if detail else "")
        super().__init__(self.text)


def set_weights(s: Subnet, hotkey: str, dests: list[int], values: list[int], version_key: int,
                 block: int, *, reveal: bool) -> int:
    """The chain's ``do_set_weights`` checks, in its order; writes the row. Returns the uid."""
    if len(dests) != len(values):
        raise Refused("WeightVecNotEqualSize")
    uid = s.uid_of(hotkey)
    if uid is None:
        raise Refused("HotKeyNotRegisteredInSubNet", f"{hotkey} on netuid {s.netuid}")
    n = s.neurons[uid]
    if n.stake_rao < s.weights_min_stake_rao:
        raise Refused("NotEnoughStakeToSetWeights")
    if version_key < s.weights_version_key:
        raise Refused("IncorrectWeightVersionKey", f"{version_key} < {s.weights_version_key}")
    if not reveal and s.weights_rate_limit and n.last_update and block - n.last_update < s.weights_rate_limit:
        raise Refused("SettingWeightsTooFast",
                       f"last set {block - n.last_update} blocks ago, limit {s.weights_rate_limit}")
    is_self = dests == [uid]
    if not is_self and not n.validator_permit:
        raise Refused("NeuronNoValidatorPermit")
    if len(set(dests)) != len(dests):
        raise Refused("DuplicateUids")
    if len(dests) > len(s.neurons):
        raise Refused("UidsLengthExceedUidsInSubNet")
    if any(d < 0 or d >= len(s.neurons) for d in dests):
        raise Refused("UidVecContainInvalidOne")
    if any(v < 0 or v > U16_MAX for v in values):
        raise Refused("MaxWeightExceeded", "values must be u16")
    if not is_self and len(dests) < s.min_allowed_weights:
        raise Refused("WeightVecLengthIsLow", f"{len(dests)} < {s.min_allowed_weights}")
    total = sum(values)
    if total == 0:
        raise Refused("WeightVecLengthIsLow", "all weights are zero")
    if not is_self and s.max_weights_limit < U16_MAX and not max_limited(values, s.max_weights_limit):
        raise Refused("MaxWeightExceeded", f"max {max(values) / total:.6f} > {s.max_weights_limit / U16_MAX:.6f}")
    top = max(values)
    s.weights[uid] = [[d, round(v * U16_MAX / top)] for d, v in zip(dests, values, strict=True) if v]
    if not reveal:
        n.last_update = block
    return uid


def max_limited(values: list[int], limit: int) -> bool:
    """The chain's ``check_vec_max_limited`` in its own I32F32 arithmetic (32 fractional bits,
    divisions truncate): ``max(v) / sum(v) <= limit / 65535``. Exact rationals would be stricter than
    the chain and refuse weights it accepts."""
    one = 1 << 32
    return (max(values) * one) // sum(values) <= (limit * one) // U16_MAX


def commit_weights(s: Subnet, hotkey: str, commit: Any, reveal_round: int, block: int,
                   plaintext: dict[str, Any] | None) -> int:
    """The chain's timelocked-commit checks; stores the commit (with the plaintext the committer left, if any)."""
    if not s.commit_reveal:
        raise Refused("CommitRevealDisabled")
    uid = s.uid_of(hotkey)
    if uid is None:
        raise Refused("HotKeyNotRegisteredInSubNet", f"{hotkey} on netuid {s.netuid}")
    n = s.neurons[uid]
    if s.weights_rate_limit and n.last_update and block - n.last_update < s.weights_rate_limit:
        raise Refused("CommittingWeightsTooFast",
                      f"last set {block - n.last_update} blocks ago, limit {s.weights_rate_limit}")
    if sum(1 for c in s.commits if c.hotkey == hotkey) >= MAX_UNREVEALED_COMMITS:
        raise Refused("TooManyUnrevealedCommits")
    epoch = s.epoch_index(block)
    ciphertext = jsonable(commit) if isinstance(commit, bytes | bytearray) else str(commit)
    s.commits.append(Commit(
        hotkey=hotkey, commit_block=block, epoch=epoch, reveal_block=s.epoch_block(epoch + s.reveal_period),
        reveal_round=int(reveal_round), ciphertext=ciphertext,
        plaintext=plaintext,
    ))
    n.last_update = block
    return uid
