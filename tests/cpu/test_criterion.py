"""The GPU tests' error criterion (tests/helpers/gpu_utils.py, docs/semantics.md) on hand-made CPU
tensors: the one-step allowance is the dtype's spacing and nothing wider."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.gpu_utils import assert_matches_reference, one_step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=200, deadline=None)
@given(x=st.floats(min_value=1e-4, max_value=6e4, allow_nan=False), negative=st.booleans())
def test_one_step_is_the_gap_to_the_next_value(dtype, x, negative):
    """Against the next representable magnitude, found by adding one to the bit pattern."""
    a = torch.tensor([x], dtype=dtype)
    above = (a.view(torch.int16) + 1).view(dtype)
    want = above.float() - a.float()
    assert torch.equal(one_step(-a if negative else a), want)


def _check(out, ref, ref_lp):
    """assert_matches_reference on a (1, 1, 1, n) output, the references given."""
    def ref_fn(q, k, v, upcast=True):
        return (ref if upcast else ref_lp).view(1, 1, 1, -1), torch.zeros(1, 1, 1)

    q = torch.zeros(1, 1, 1, out.numel(), dtype=out.dtype)
    assert_matches_reference(out.view(1, 1, 1, -1), torch.zeros(1, 1, 1), q, q, q, ref_fn=ref_fn)


def test_a_neighbour_passes_where_the_bar_is_under_one_step():
    """The failing draw of 2026-12-03 (1 query, d 1): the input-dtype reference equal to the
    float32 one, ours one bf16 step (4.9e-4, the step in [1/16, 1/8)) off at 0.0698."""
    ref = torch.tensor([0.1318, 0.0698, 0.1377, 0.0183], dtype=torch.bfloat16)
    out = ref.clone()
    out[1] = (ref[1:2].view(torch.int16) + 1).view(torch.bfloat16)
    assert (out - ref).abs().max().item() == 2 ** -11
    _check(out, ref, ref.clone())


def test_two_steps_fail():
    ref = torch.tensor([0.1318, 0.0698], dtype=torch.bfloat16)
    out = ref.clone()
    out[0] = (ref[0:1].view(torch.int16) + 2).view(torch.bfloat16)
    with pytest.raises(AssertionError, match="max abs error"):
        _check(out, ref, ref.clone())


def test_no_allowance_at_an_exact_zero():
    """Rows with no visible key give exactly 0: 1e-3 there fails, which a step taken from the
    exponent alone (frexp(0) gives 0: 2^-8 in bf16) would forgive."""
    ref = torch.tensor([0.0, 0.5], dtype=torch.bfloat16)
    out = torch.tensor([1e-3, 0.5], dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="max abs error"):
        _check(out, ref, ref.clone())
