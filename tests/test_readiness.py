"""The validator's readiness rules (neurons.validator.readiness) and its wiring into /ready."""

from __future__ import annotations

from neurons.validator.readiness import REFERENCE_ERRORS, not_ready


def _reason(routable: int = 3, age: float | None = 10.0, errors: int = 0, error: str = "",
            answering: int | None = None) -> str:
    return not_ready(routable=routable, metagraph_age_s=age, max_age_s=360.0, reference_errors=errors,
                     reference_error=error, answering=answering) or ""


def test_each_reason_flips_readiness() -> None:
    assert _reason() == ""
    assert "not been read" in _reason(age=None)
    assert "361 s old" in _reason(age=361.0)
    assert "no miner is routable" in _reason(routable=0)
    assert "no routable miner is answering" in _reason(answering=0)
    assert _reason(answering=1) == ""
    assert "ConnectionRefusedError" in _reason(errors=REFERENCE_ERRORS, error="ConnectionRefusedError: ...")
    assert _reason(errors=REFERENCE_ERRORS - 1) == ""  # one or two errors in a row: still ready


async def test_the_validator_is_ready_once_synced_and_not_when_its_metagraph_is_stale(tmp_path) -> None:
    import time

    from neurons.keys import dev_keypair
    from neurons.validator.build import build_validator
    from neurons.validator.config import ValidatorConfig
    from tests.test_validator import FakeChain

    v = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0), FakeChain([]), dev_keypair("Alice"))
    assert "not been read" in (v.readiness() or "")
    await v.sync_metagraph()
    assert v.readiness() is None
    v._synced_at = time.monotonic() - 10 * v._max_metagraph_age_s
    assert "old" in (v.readiness() or "")
