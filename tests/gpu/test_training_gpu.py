"""A short training run with cute-flash attention follows SDPA FLASH's loss curve as closely as
another correct kernel (SDPA EFFICIENT) does (`python -m cute_flash traincheck`), on dense
batches and on packed rows of documents (`--packed`: flash_attn_varlen_func against SDPA on
each document alone)."""
import pytest

from tests.helpers.gpu_utils import on_path

pytestmark = [pytest.mark.gpu, pytest.mark.lowp_gemm]  # a bf16-autocast model: not under racecheck


@pytest.mark.parametrize("packed", [False, True])
def test_training_follows_sdpa(packed, kernels):
    from cute_flash.tools.train_check import compare

    curves, ours, yardstick = compare(steps=200, packed=packed)
    assert kernels == on_path("default", "fwd", "bwd")  # d 64: the Hopper backward's, packed too
    flash = curves["FLASH"]
    assert flash[-1] < flash[0] - 1.0, "the reference run did not learn: the check would be vacuous"
    assert ours <= max(2 * yardstick, 0.01), f"ours {ours:.3e} vs FLASH; EFFICIENT vs FLASH {yardstick:.3e}"
