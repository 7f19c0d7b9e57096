"""The SM80 backward pass against `cute_flash.reference` under float32 autograd, given the output the
backward read, by flash-attn's rule: each gradient's max error is at most twice the error of the same
reference run in the input dtype, plus 1e-4, plus the rounding of storing each gradient in the dtype
(docs/semantics.md). Shapes are drawn by hypothesis; the allocator is poisoned with NaN before each
run, so an unwritten gradient element fails. On sm_90 GPUs, where dense backwards default to the
Hopper kernel, this module selects the SM80 kernels (`CUTE_FLASH_ARCH_PATH=sm80`, the path of every
sm_80/86/89 GPU); tests/gpu/test_bwd_sm90_gpu.py runs the dense shape tests on the Hopper one."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_flash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from tests.helpers.backward import (VARLEN_MOD_IDS, VARLEN_MODS, assert_grads_match, check_private_backward,
                                    check_score_modifiers, check_varlen_grads, check_varlen_nan_stays_in_its_sequence,
                                    check_varlen_score_modifiers, heads, inputs, lengths, ours, varlen_lengths)
from tests.helpers.gpu_utils import cu_seqlens, gpu_settings, on_path, poison_allocator

pytestmark = pytest.mark.gpu

BUCKETS = [32, 64, 96, 128, 160, 192, 224, 256]
head_dims = st.one_of(st.sampled_from(BUCKETS), st.integers(1, 256))


@pytest.fixture(autouse=True)
def sm80_path(monkeypatch, kernels):
    """Every test here on the SM80 forward and backward, and only on them (no silent fall back)."""
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    yield
    assert kernels == on_path("sm80", "fwd", "bwd"), kernels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@gpu_settings(8)
@given(rng=st.random_module(), b=st.integers(1, 2), sq=lengths, sk=lengths, hh=heads, d=head_dims,
       layout=st.sampled_from(["bshd", "bhsd"]))
def test_dense_grads_match_reference(rng, b, sq, sk, hh, d, causal, dtype, layout):
    q, k, v, dout = inputs(b, sq, sk, *hh, d, dtype, layout)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


@pytest.mark.parametrize("d", BUCKETS + [8, 40, 72, 100, 200])
@pytest.mark.parametrize("causal", [False, True])
def test_every_head_dim(d, causal):
    q, k, v, dout = inputs(2, 190, 301, 4, 2, d)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


MODS = ["window", "alibi", "softcap", "all"]


@pytest.mark.parametrize("mod", MODS)
@gpu_settings(8)
@given(rng=st.random_module(), sq=lengths, sk=lengths, hh=heads, d=st.sampled_from([64, 96, 128, 200]), data=st.data())
def test_score_modifiers_with_gqa(rng, mod, sq, sk, hh, d, data):
    """Window (both edges drawn), ALiBi, softcap (the tanh derivative), and all together, with
    GQA and odd lengths."""
    check_score_modifiers(mod, sq, sk, hh, d, data)


@pytest.mark.parametrize("causal", [False, True])
@gpu_settings(8)
@given(rng=st.random_module(), lens=varlen_lengths, hh=heads, d=st.sampled_from([32, 64, 128, 72]), used=st.booleans())
def test_varlen_grads_match_reference(rng, lens, hh, d, causal, used):
    check_varlen_grads(lens, hh, d, causal, used)


@pytest.mark.parametrize("opts", VARLEN_MODS, ids=VARLEN_MOD_IDS)
def test_varlen_grads_with_score_modifiers(opts):
    """The packed backward with each score modifier (ALiBi slopes per sequence and head), GQA,
    an empty sequence and seqused_k."""
    check_varlen_score_modifiers(opts)


def test_varlen_a_sequences_nan_stays_in_it():
    check_varlen_nan_stays_in_its_sequence()


@pytest.mark.parametrize("d", [32, 64, 96, 128, 160])
def test_small_shared_memory_tiles(d):
    """The backward tiles chosen for 99 KB of shared memory per block (sm_86, sm_89:
    `choose_bwd_traits(..., 86)`, single-buffered or smaller than sm_80's), run here by the same
    SM80 kernel with sm_86's dQ adds (one float per atomic)."""
    from cute_flash.launch.backward import flash_bwd
    from cute_flash.launch.dense import flash_fwd
    from layouts.traits import SMEM_LIMIT, choose_bwd_traits

    traits = choose_bwd_traits(d, "bf16", 86)
    assert traits.smem_bytes <= SMEM_LIMIT[86] < choose_bwd_traits(d, "bf16", 80).smem_bytes
    q, k, v, dout = inputs(2, 300, 257, 4, 2, d)
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=True)
    poison_allocator()
    grads = flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=True,
                      variant=dict(traits=traits, dq_vec=1, dq_bulk=False))[:3]
    torch.cuda.synchronize()
    assert_grads_match(grads, q, k, v, dout, out=out, causal=True)


def test_deterministic_grads_are_bitwise_repeatable():
    q, k, v, dout = inputs(2, 1000, 1100, 8, 2, 128)
    out, grads = ours(flash_attn_func, dout, q, k, v, causal=True, deterministic=True)
    for _ in range(2):
        for a, b in zip(grads, ours(flash_attn_func, dout, q, k, v, causal=True, deterministic=True)[1]):
            assert torch.equal(a, b)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=True)
    lq = [300, 1, 700]
    qv, kv_, vv, dv_ = (x.flatten(0, 1)[:1001] for x in (q, k, v, dout))
    cu = cu_seqlens(lq)
    varlen = [ours(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 700, 700, deterministic=True), dv_,
                   qv, kv_, vv)[1] for _ in range(2)]
    for a, b in zip(*varlen):
        assert torch.equal(a, b)


def test_packed_gradients_are_one_tensor_and_equal_the_unpacked_ones():
    """qkv / kv packed inputs get one packed gradient, equal to the separate inputs' gradients
    (deterministic, so equal bit for bit)."""
    qkv = torch.randn(2, 257, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 257, 4, 64, device="cuda", dtype=torch.bfloat16)
    _, (dqkv,) = ours(flash_attn_qkvpacked_func, dout, qkv, causal=True, deterministic=True)
    _, split = ours(flash_attn_func, dout, *qkv.unbind(2), causal=True, deterministic=True)
    assert dqkv.shape == qkv.shape and torch.equal(dqkv, torch.stack(split, 2))
    q, kv = qkv[:, :, 0], qkv[:, :, 1:, :2]
    _, (dq, dkv) = ours(flash_attn_kvpacked_func, dout, q, kv, deterministic=True)
    _, split = ours(flash_attn_func, dout, q, *kv.unbind(2), deterministic=True)
    assert torch.equal(dq, split[0]) and torch.equal(dkv, torch.stack(split[1:], 2))

    lens = [100, 157, 257]
    cu = cu_seqlens(lens)
    pq = torch.randn(sum(lens), 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    pdout = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    _, (dpq,) = ours(lambda x: flash_attn_varlen_qkvpacked_func(x, cu, 257, deterministic=True), pdout, pq)
    _, split = ours(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, deterministic=True), pdout,
                    *pq.unbind(1))
    assert torch.equal(dpq, torch.stack(split, 1))
    _, (dq, dkv) = ours(lambda q, kv: flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 257, 257, deterministic=True),
                        pdout, pq[:, 0], pq[:, 1:])
    assert torch.equal(dq, split[0]) and torch.equal(dkv, torch.stack(split[1:], 1))


def test_private_backward_writes_given_tensors_and_returns_softmax_d():
    check_private_backward()


def test_only_inputs_requiring_grad_get_one():
    q, k, v, dout = inputs(1, 100, 100, 2, 2, 64)
    kk = k.detach().requires_grad_()
    flash_attn_func(q, kk, v).backward(dout)
    assert q.grad is None and v.grad is None
    assert torch.equal(kk.grad, ours(flash_attn_func, dout, q, k, v)[1][1])  # dK has no atomics: repeatable
