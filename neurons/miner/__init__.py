"""The reference miner: HTTP, signatures and slots (:mod:`.server`), whom it serves (:mod:`.trust`), the
inference backends behind it (:mod:`.runtimes`: the simulated card, the proxy to a real runtime) and the
command line (:mod:`.cli`).

``python -m neurons.miner`` runs :func:`neurons.miner.cli.main`.
"""
