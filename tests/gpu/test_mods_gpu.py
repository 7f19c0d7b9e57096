"""Python-written mods (`score_mod` / `mask_mod` / `score_mod_bwd`, kernels/common/user_mods.py):
every variant of the library (`cute_flash.mods`) against `cute_flash.reference` with its torch
twin, forward and gradients, on both paths' kernels, dense and packed, by the criteria of
docs/semantics.md; ALiBi and softcap as mods against the built-in flags; a mod written as
flash-attn-4 writes one. Each test asserts the path that ran."""
import operator

import cutlass
import cutlass.cute as cute
import pytest
import torch

from cute_flash import flash_attn_func, flash_attn_varlen_func, mods
from cute_flash.reference import attention_varlen_ref
from tests.helpers import forward
from tests.helpers.backward import assert_grads_match, ours
from tests.helpers.gpu_utils import assert_matches_reference, cu_seqlens, on_path, poison_allocator

pytestmark = pytest.mark.gpu

B, S, H, HK = 2, 700, 4, 2


PATHS = ["sm80", "default"]


def take_path(path, monkeypatch):
    """Calls take the SM80 kernels (`CUTE_FLASH_ARCH_PATH=sm80`) or the default path's."""
    if path == "sm80":
        monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    else:
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch, kernels):
    take_path(request.param, monkeypatch)
    yield request.param
    assert kernels == on_path(request.param, "fwd"), f"the forwards that ran: {sorted(kernels)}"


def library(device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(0)
    docs = torch.cumsum(torch.rand(B, S, generator=gen) < 0.01, 1).to(torch.int32).to(device)
    return {
        "document": mods.document_mask(docs),
        "prefix_lm": mods.prefix_lm(torch.tensor([100, 333], dtype=torch.int32, device=device)),
        "window_sinks": mods.sliding_window_with_sinks(128, 4),
        "relative_bias": mods.relative_bias(torch.randn(H, 2 * 64 + 1, generator=gen).to(device)),
        "alibi": mods.alibi(torch.rand(H, generator=gen).to(device)),
        "softcap": mods.softcap(20.0),
    }


def inputs(d, seed=0):
    torch.manual_seed(seed)
    return forward.inputs(B, S, S, H, HK, d, torch.bfloat16)


@pytest.mark.parametrize("name", list(library("cpu")))
@pytest.mark.parametrize("d", [64, 128])
def test_library_mods_match_reference(path, name, d):
    spec = library()[name]
    q, k, v = inputs(d)
    poison_allocator()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **spec.kwargs())
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k, v, **spec.ref_kwargs())


@pytest.mark.parametrize("name, flag", [("alibi", "alibi_slopes"), ("softcap", "softcap")])
def test_alibi_and_softcap_as_mods_match_the_flags(path, name, flag):
    """The mods give the built-in flags' output, up to rounding (one step of bf16)."""
    spec = library()[name]
    q, k, v = inputs(64)
    value = spec.aux_tensors[0] if flag == "alibi_slopes" else 20.0
    got = flash_attn_func(q, k, v, **spec.kwargs())
    want = flash_attn_func(q, k, v, **{flag: value})
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -6 * want.float().abs().max().item()


def test_packed_batches_see_positions_per_sequence(path):
    """Packed: b_idx is the sequence, q_idx / kv_idx count from its start (prefix LM per sequence)."""
    lens = [300, 1, 700, 129]
    spec = mods.prefix_lm(torch.tensor([50, 1, 0, 200], dtype=torch.int32, device="cuda"))
    torch.manual_seed(1)
    q, k, v = (torch.randn(sum(lens), h, 64, device="cuda", dtype=torch.bfloat16) for h in (H, HK, HK))
    cu = cu_seqlens(lens)
    poison_allocator()
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), return_attn_probs=True,
                                         **spec.kwargs())
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k, v, ref_fn=lambda q, k, v, **o: attention_varlen_ref(
        q, k, v, cu, cu, **o), **spec.ref_kwargs())


@cute.jit
def fa4_style_causal_bias(tSrS_ssa, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """A score_mod as flash-attn-4's tests write one: TensorSSA in, `cute.where` on a comparison."""
    bias = (q_idx - kv_idx).to(cutlass.Float32) * 0.05
    return cute.where(operator.ge(q_idx, kv_idx), tSrS_ssa - bias, tSrS_ssa - 1.0)


def test_a_flash_attn_4_score_mod_runs_unchanged(path):
    q, k, v = inputs(128)
    poison_allocator()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, score_mod=fa4_style_causal_bias)
    torch.cuda.synchronize()

    def ref(score, b, h, qi, ki):
        return torch.where(qi >= ki, score - (qi - ki) * 0.05, score - 1.0)

    assert_matches_reference(out, lse, q, k, v, score_mod=ref)


@pytest.fixture(params=PATHS)
def grad_path(request, monkeypatch, kernels):
    take_path(request.param, monkeypatch)
    yield request.param
    assert kernels == on_path(request.param, "fwd", "bwd"), f"the kernels that ran: {sorted(kernels)}"


@pytest.mark.parametrize("name", list(library("cpu")))
@pytest.mark.parametrize("d", [64, 128])
def test_library_mod_gradients_match_reference(grad_path, name, d):
    """dq, dk, dv through each library mod (score_mod_bwd where it has a score_mod) against the
    reference's autograd, by the backward's rule."""
    spec = library()[name]
    q, k, v = inputs(d)
    dout = torch.randn_like(q)
    out, grads = ours(lambda q, k, v: flash_attn_func(q, k, v, **spec.kwargs()), dout, q, k, v)
    assert_grads_match(grads, q, k, v, dout, out=out, **spec.ref_kwargs())


def test_packed_gradients_see_positions_per_sequence(grad_path):
    lens = [300, 1, 700, 129]
    spec = mods.prefix_lm(torch.tensor([50, 1, 0, 200], dtype=torch.int32, device="cuda"))
    torch.manual_seed(2)
    q, k, v, dout = (torch.randn(sum(lens), h, 64, device="cuda", dtype=torch.bfloat16) for h in (H, HK, HK, H))
    cu = cu_seqlens(lens)
    out, grads = ours(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **spec.kwargs()),
                      dout, q, k, v)
    assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=lambda q, k, v, **o: attention_varlen_ref(
        q, k, v, cu, cu, **o), **spec.ref_kwargs())
