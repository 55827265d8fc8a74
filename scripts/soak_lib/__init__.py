"""Helpers for ``scripts/soak.py``: routers under test, time compression, load models, scenarios, report.

Not part of the installed package: ``scripts/soak.py`` puts ``scripts/`` on ``sys.path``.

Example::

    import sys; sys.path.insert(0, "scripts")
    from soak_lib.scenarios import SCENARIOS
    SCENARIOS["seed"].cards        # two identical RTX 5090s
"""
