"""Inference backends behind the reference miner, all speaking :class:`.base.Runtime`."""
