"""A short training run with cute-flash attention follows SDPA FLASH's loss curve as closely as
another correct kernel (SDPA EFFICIENT) does (`python -m cute_flash traincheck`)."""
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.lowp_gemm]  # a bf16-autocast model: not under racecheck


def test_training_follows_sdpa():
    from cute_flash.tools.train_check import compare

    curves, ours, yardstick = compare(steps=200)
    flash = curves["FLASH"]
    assert flash[-1] < flash[0] - 1.0, "the reference run did not learn: the check would be vacuous"
    assert ours <= max(2 * yardstick, 0.01), f"ours {ours:.3e} vs FLASH; EFFICIENT vs FLASH {yardstick:.3e}"
