"""Helpers for the benchmark scripts in ``scripts/``: fake upstream, peers, clients, process accounting.

Not part of the installed package: the scripts put ``scripts/`` on ``sys.path`` and import ``bench_lib``.

Example::

    import sys; sys.path.insert(0, "scripts")
    from bench_lib.stats import percentile
    percentile([1.0, 2.0, 3.0], 50)   # 2.0
"""
