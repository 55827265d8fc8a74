"""The embedded local subnet: a local chain stand-in, miners, one validator or several, traffic.

Everything real except the chain: each validator is the same ``Validator`` that runs on finney, the
chain calls go through the bittensor SDK over ``LocalSubstrate``, which runs Yuma 3 at every tempo boundary
(about once a round), and organic traffic is an HTTP client sending chat completions through the gateways.
Miners are the reference miner on loopback, serving either

* ``--local.runtime sim`` (default): the simulated RTX 5090 runtime (the last one a slower card), no
  model, no GPU, audited against the toy model the cards run; or
* ``--local.runtime real``: Gemma 3 270M on llama.cpp on this CPU, one slot each, audited by the
  validator's reference (the same packaged model), paid against the ``cpu-gemma270m`` speed profile.

``--local.validators N`` runs N validators (development keys Alice, Bob, ...), each with its stake
(``--local.stakes``), its share of the traffic (``--local.traffic``), its state directory and its gateway, all
sharing the miners; every epoch the run logs what Yuma made of their weights.

``--local.miner-url host:port`` adds miners the run did not start (a real runtime on another port or
machine): the run reads the miner's hotkey from its ``/health`` and registers it on the local chain;
the banner prints the validator hotkeys that miner must ``--allow``.

The validators' state and the local chain stay in ``--state-dir`` from run to run of the same lineup; a run with
other local miners or validators under the same development keys starts fresh (:mod:`.lineup`).

Rooms: :mod:`.config` (compressed time, the validators' shares), :mod:`.miners`, :mod:`.subnet` (starting and
stopping it all), :mod:`.run` (the README's main job), :mod:`.summary` and :mod:`.epoch_table` (what it prints).

Example::

    python -m neurons.validator --local --local.rounds 6
    python -m neurons.validator --local --local.validators 3 --local.stakes 50,30,20 --local.traffic 0,30,70
    python -m neurons.validator --local --local.runtime real --local.rounds 3
    python -m neurons.weights --state-dir ~/.tensorgate/local --netuid 1
"""

from .config import FIRST_WEIGHTS_ROUND, REAL_MINERS, REAL_TRAFFIC_RPS, VALIDATOR_URI, local_config, local_tempo
from .miners import ExternalMinerError
from .run import run_local_subnet
from .subnet import LocalSubnet, LocalValidator, start_local_subnet, stop_local_subnet

__all__ = ["FIRST_WEIGHTS_ROUND", "REAL_MINERS", "REAL_TRAFFIC_RPS", "VALIDATOR_URI", "ExternalMinerError",
           "LocalSubnet", "LocalValidator", "local_config", "local_tempo", "run_local_subnet", "start_local_subnet",
           "stop_local_subnet"]
