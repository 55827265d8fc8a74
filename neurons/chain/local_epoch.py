"""The local chain's epoch: at each tempo boundary, Yuma 3 (:mod:`scoring.yuma`) over the subnet's state, and its
results kept where the chain keeps them.

Why the local chain runs it: without an epoch, trust, consensus, incentive, dividends, validator trust and emission
all read 0, so nothing a validator does on the local subnet could be seen as the chain would pay it. What an epoch
leaves: per neuron the u16 shares (``Consensus``, ``Incentive``, ``Dividends``, ``ValidatorTrust``), its emission
for the epoch in rao, ``Active`` and the validator permit (the top stakes); per validator its bonds (u16 rows).

Emission is ``EMISSION_PER_BLOCK_RAO`` per block of the tempo, split as Yuma splits it; it is recorded, not staked
(the stakes a local run was given stay as given), and the owner's cut and the TAO side are not modelled.
"""

from __future__ import annotations

from scoring.yuma import EpochInput, YumaParams, run_epoch, u16_fraction

from .local_state import RAO_PER_UNIT, Subnet

EMISSION_PER_BLOCK_RAO = RAO_PER_UNIT
CATCH_UP_EPOCHS = 64  # a chain reopened after a long stop runs at most this many missed epochs (bonds converge)


def yuma_params(s: Subnet) -> YumaParams:
    return YumaParams(kappa=s.kappa, bonds_penalty=s.bonds_penalty, bonds_moving_average=s.bonds_moving_average,
                      liquid_alpha=s.liquid_alpha, alpha_low=s.alpha_low, alpha_high=s.alpha_high,
                      alpha_sigmoid_steepness=float(s.alpha_sigmoid_steepness),
                      max_allowed_validators=s.max_allowed_validators, activity_cutoff=s.activity_cutoff,
                      stake_threshold=float(s.weights_min_stake_rao))


def epochs_between(s: Subnet, after: int, upto: int) -> list[int]:
    """The epoch blocks in ``(after, upto]`` (the last ``CATCH_UP_EPOCHS`` of them)."""
    if upto <= after:
        return []
    first, last = s.epoch_index(after) + 1, s.epoch_index(upto)
    blocks = [s.epoch_block(i) for i in range(max(first, last - CATCH_UP_EPOCHS + 1), last + 1)]
    return [b for b in blocks if after < b <= upto]


def epoch_input(s: Subnet, block: int) -> EpochInput:
    """What an epoch at ``block`` reads of ``s``, in the shapes :func:`scoring.yuma.run_epoch` takes."""
    ns = s.neurons
    owner = s.uid_of(s.owner_hotkey) if s.owner_hotkey else None
    commits: dict[int, int] = {}
    if s.commit_reveal:
        for c in s.commits:
            uid = s.uid_of(c.hotkey)
            if uid is not None:
                commits[uid] = min(commits.get(uid, c.commit_block), c.commit_block)
    return EpochInput(
        block=block, stake=[float(n.stake_rao) for n in ns], validator_permit=[n.validator_permit for n in ns],
        # the chain sets LastUpdate at registration; here 0 means "never set weights" (the SDK's preflight reads it)
        last_update=[n.last_update or n.registered_at for n in ns], registered_at=[n.registered_at for n in ns],
        weights={uid: [(int(d), int(v)) for d, v in row] for uid, row in s.weights.items()},
        bonds={uid: [(int(d), int(v)) for d, v in row] for uid, row in s.bonds.items()},
        last_epoch_block=s.last_step or None, tempo=s.tempo, owner_uid=owner, commit_blocks=commits or None,
    )


def run_subnet_epoch(s: Subnet, block: int) -> None:
    """One epoch at ``block``: Yuma 3 over the subnet's weights, stakes and bonds; the results stored in ``s``."""
    ns = s.neurons
    if not ns:
        s.last_step = block
        return
    e = run_epoch(epoch_input(s, block), yuma_params(s))
    emission = s.tempo * EMISSION_PER_BLOCK_RAO
    for uid, n in enumerate(ns):
        n.consensus = u16_fraction(e.consensus[uid])
        n.incentive = u16_fraction(e.incentive[uid])
        n.dividends = u16_fraction(e.dividends[uid])
        n.validator_trust = u16_fraction(e.validator_trust[uid])
        n.emission_rao = int(e.emission[uid] * emission)
        n.active = bool(e.active[uid])
        n.validator_permit = bool(e.validator_permit[uid])
    s.bonds = {uid: [[j, v] for j, v in row] for uid, row in e.bonds.items() if row}
    s.last_step = block
