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


SEED_OVER_THE_BAR = 91  # the emulated dv 1.49x the bar alone (0.0370 against 0.0249)


def _gqa_two_keys(seed):
    """255 queries x 2 keys, causal, 4 query heads on 1 kv head, d 42 (bf16, CPU): the inputs,
    the stored O (the float32 output rounded), and dv as the kernels compute it: P in bf16, each
    query head's P^T dO in float32 rounded to bf16, the group's sum rounded (flash-attn's
    order). The backward GPU run of 2026-12-07 matched this emulation bit for bit on both
    backward kernels over 61 draws (docs/tuning/backward.md, "A dv miss with two keys and GQA")."""
    from cute_flash.reference import attention_ref

    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, 255, 4, 42, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, 1, 42, generator=gen).bfloat16() for _ in range(2))
    out = attention_ref(q.float(), k.float(), v.float(), causal=True)[0].bfloat16()
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().expand(-1, -1, 4, -1)) * 42 ** -0.5
    s = s.masked_fill(torch.arange(2)[None] > torch.arange(255)[:, None] - 253, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0).bfloat16().float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout.float()).bfloat16().float().sum(2, keepdim=True).bfloat16()
    return q, k, v, dout, out, dv


def _grads_check(dv, q, k, v, dout, out):
    """assert_grads_match with dq and dk the float32 reference's rounded to bf16 (half a step
    off at most) and the given dv."""
    from cute_flash.reference import attention_ref
    from tests.helpers.backward import assert_grads_match, reference

    dq, dk, _ = reference(attention_ref, dout, q, k, v, stored_out=out, causal=True)
    assert_grads_match([dq.bfloat16(), dk.bfloat16(), dv], q, k, v, dout, out=out, causal=True)


def test_a_gqa_gradient_within_its_storage_rounding_passes():
    """A draw where the emulated dv misses flash-attn's bar alone (2x the bf16 reference's error
    + 1e-4) and passes with the storage's rounding added (`storage_floor`): the GPU suite's miss
    of 2026-12-07, reproduced on the CPU (seed found by search)."""
    from cute_flash.reference import attention_ref
    from tests.helpers.backward import GRAD_FLOOR, reference

    q, k, v, dout, out, dv = _gqa_two_keys(SEED_OVER_THE_BAR)
    want = reference(attention_ref, dout, q, k, v, stored_out=out, causal=True)[2]
    lowp = reference(attention_ref, dout, q, k, v, upcast=False, causal=True)[2]
    assert (dv.float() - want).abs().max().item() > 2 * (lowp.float() - want).abs().max().item() + GRAD_FLOOR
    _grads_check(dv, q, k, v, dout, out)


@pytest.mark.parametrize("wrong", ["scaled", "keys_swapped"])
def test_a_wrong_gqa_gradient_still_fails(wrong):
    """The floor is a few bf16 steps, not a tolerance for wrong math: dv 1/32 too large, or the
    two keys' rows swapped, fails at the same draw."""
    q, k, v, dout, out, dv = _gqa_two_keys(SEED_OVER_THE_BAR)
    dv = (dv.float() * (1 + 2 ** -5)).bfloat16() if wrong == "scaled" else dv.flip(1)
    with pytest.raises(AssertionError, match="dv: max abs error"):
        _grads_check(dv, q, k, v, dout, out)
