"""Learnable sinks (`learnable_sink`, `cute_flash.sinks`) on the CPU: the fold of a sink into the
kernels' (O, LSE) and the sink's gradient against autograd through the reference with a sink
column; the claim the backward rests on (the kernels' backward given the folded O and LSE gives
the exact q, k, v gradients); and the public functions end to end over a stand-in for the
launchers that computes with the reference (tests/helpers/reference_launch.py). The GPU tests
run the same calls on the kernels."""
import pytest
import torch

import cute_flash
from cute_flash import sinks
from cute_flash.reference import attention_ref, attention_varlen_ref
from tests.helpers import reference_launch

F64 = dict(dtype=torch.float64)
CLOSE = dict(atol=1e-6, rtol=1e-5)  # float64 inputs; the reference's LSE is float32
BF16 = dict(atol=2e-2, rtol=2e-2)   # the public functions take fp16 / bf16: outputs and gradients rounded to bf16


def _qkv(b=2, sq=37, sk=53, h=4, hk=2, d=16, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, **kw)
    k, v = (torch.randn(b, sk, hk, d, generator=g, **kw) for _ in range(2))
    return q, k, v


def _sink(h=4, seed=1, dtype=torch.float64):
    return (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(5, 3)), dict(causal=True, softcap=3.0)])
def test_fold_gives_attention_with_the_sink_column(mask):
    """(O, LSE) without the sink, folded, equal attention whose softmax has the sink column; a
    causal call with more queries than keys has rows that see no key (O 0, LSE the sink)."""
    q, k, v = _qkv(sq=61, **F64)
    sink = _sink()
    out, lse = sinks.fold(*attention_ref(q, k, v, **mask), sink)
    ref_out, ref_lse = attention_ref(q, k, v, learnable_sink=sink, **mask)
    torch.testing.assert_close(out, ref_out, **CLOSE)
    torch.testing.assert_close(lse, ref_lse, **CLOSE)
    if mask.get("causal"):
        empty = ~torch.isfinite(attention_ref(q, k, v, **mask)[1])
        assert empty.any() and torch.equal(lse[empty], sink.float().view(1, -1, 1).expand_as(lse)[empty])


def test_fold_of_packed_sequences_matches_the_reference():
    q, k, v = _qkv(b=1, sq=50, sk=50, **F64)
    q, k, v = q[0], k[0], v[0]
    cu = torch.tensor([0, 17, 17, 50], dtype=torch.int32)
    sink = _sink()
    out, lse = sinks.fold(*attention_varlen_ref(q, k, v, cu, cu, causal=True), sink)
    ref_out, ref_lse = attention_varlen_ref(q, k, v, cu, cu, causal=True, learnable_sink=sink)
    torch.testing.assert_close(out, ref_out, **CLOSE)
    torch.testing.assert_close(lse, ref_lse, **CLOSE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fold_of_a_low_precision_output_rounds_once(dtype):
    """A bf16 / fp16 O is rescaled in fp32 and rounded once: O' = round(O * exp(L - L')), the
    layout and strides of O kept."""
    q, k, v = _qkv(sq=61, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # heads-major strides, as a kernel may write
    sink = _sink(dtype=torch.float32)
    folded, _ = sinks.fold(out, lse, sink)
    keys_lse = lse.masked_fill(lse == float("inf"), -float("inf"))
    factor = torch.exp(keys_lse - torch.logaddexp(keys_lse, sink.view(1, -1, 1)))  # (b, h, rows)
    assert folded.dtype == dtype and folded.stride() == out.stride()
    assert torch.equal(folded, (out.float() * factor.transpose(1, 2).unsqueeze(-1)).to(dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_kernels_backward_on_the_folded_outputs_is_exact(causal):
    """dq, dk, dv by the kernels' formulas from (O', L') and dsink from sinks.grad equal
    autograd through attention with a sink column."""
    q, k, v = (x.requires_grad_() for x in _qkv(**F64))
    sink = _sink().requires_grad_()
    ref_out, _ = attention_ref(q, k, v, causal=causal, learnable_sink=sink)
    dout = torch.randn_like(ref_out)
    ref_out.backward(dout)
    out, lse = sinks.fold(*attention_ref(q.detach(), k.detach(), v.detach(), causal=causal), sink.detach())
    dq, dk, dv, d = reference_launch._grads(dout, q.detach(), k.detach(), v.detach(), out, lse,
                                            dict(softmax_scale=16 ** -0.5, causal=causal, window_size=(-1, -1),
                                                 softcap=0.0, alibi_slopes=None))
    for ours, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(ours, theirs, **CLOSE)
    torch.testing.assert_close(sinks.grad(lse, d, sink.detach()), sink.grad, **CLOSE)
    torch.testing.assert_close(sinks.softmax_d(dout, out, lse), d, **CLOSE)


@pytest.fixture
def launch(monkeypatch):
    return reference_launch.install(monkeypatch)


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_func_with_a_sink_trains_it(launch, sink_dtype):
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.bfloat16))
    sink = _sink(dtype=sink_dtype).requires_grad_()
    out, lse, _ = cute_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [x.grad for x in (q, k, v, sink)]
    refs = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
    ref_out, ref_lse = attention_ref(*refs[:3], causal=True, learnable_sink=refs[3])
    ref_out.backward(dout)
    torch.testing.assert_close(out, ref_out, **BF16)
    torch.testing.assert_close(lse, ref_lse, **BF16)
    for ours, ref in zip(grads, refs):
        torch.testing.assert_close(ours, ref.grad, **BF16)
    assert grads[3].dtype == sink_dtype
    assert launch.calls == ["flash_fwd", "flash_bwd"]


def test_compiled_training_step_gives_the_sink_its_gradient(launch):
    """Under torch.compile the custom ops fold the sink and their registered gradient gives it
    its share (the eager path goes through FlashAttnFunction instead): both agree."""
    torch._dynamo.reset()
    q, k, v = _qkv(dtype=torch.bfloat16)
    sink = _sink(dtype=torch.float32)
    dout = torch.randn_like(q)

    def step(q, k, v, sink):
        return cute_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out] + [x.grad for x in leaves])
    torch._dynamo.reset()
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, **BF16)
    assert launch.calls.count("flash_fwd") == 2 and launch.calls.count("flash_bwd") == 2


def test_only_the_sink_requiring_grad_still_takes_the_backward(launch):
    q, k, v = _qkv(dtype=torch.bfloat16)
    sink = _sink(dtype=torch.float32).requires_grad_()
    cute_flash.flash_attn_func(q, k, v, learnable_sink=sink).float().sum().backward()
    assert sink.grad is not None and sink.grad.shape == (4,)
    assert launch.calls == ["flash_fwd", "flash_bwd"]


def test_packed_functions_with_a_sink_match_the_reference(launch):
    q, k, v = _qkv(b=1, sq=50, sk=50, dtype=torch.bfloat16)
    q, k, v = (x[0].requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, 17, 50], dtype=torch.int32)
    sink = _sink(dtype=torch.float32).requires_grad_()
    out = cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True, learnable_sink=sink)
    dout = torch.randn_like(out)
    out.backward(dout)
    refs = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
    ref_out, _ = attention_varlen_ref(*refs[:3], cu, cu, causal=True, learnable_sink=refs[3])
    ref_out.backward(dout)
    torch.testing.assert_close(out, ref_out, **BF16)
    for ours, ref in zip((q, k, v, sink), refs):
        torch.testing.assert_close(ours.grad, ref.grad, **BF16)
    assert launch.calls == ["flash_fwd_varlen", "flash_bwd_varlen"]


def test_kvcache_with_a_sink_folds_it_into_out_and_lse(launch):
    q, k_cache, v_cache = _qkv(sq=3, sk=40, dtype=torch.bfloat16)
    lens = torch.tensor([40, 12], dtype=torch.int32)
    sink = _sink(dtype=torch.float32)
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                  return_softmax_lse=True, learnable_sink=sink)
    keys = torch.arange(40) < lens[:, None]
    ref_out, ref_lse = attention_ref(q, k_cache, v_cache, causal=True, key_padding_mask=keys, learnable_sink=sink)
    torch.testing.assert_close(out, ref_out, **BF16)
    torch.testing.assert_close(lse, ref_lse, **BF16)
    out_plain = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                   learnable_sink=sink)
    # the sink goes to the launcher (either kernel's epilogue adds it), whether or not the LSE is asked for
    torch.testing.assert_close(out_plain, ref_out, **BF16)


def test_no_keys_leave_the_sink_alone_in_every_row(launch):
    q, k, v = _qkv(sk=0, dtype=torch.bfloat16)
    sink = _sink(dtype=torch.float32)
    out, lse, _ = cute_flash.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, sink.view(1, -1, 1).expand(2, 4, 37))


def test_meta_calls_give_shapes():
    q, k, v = _qkv(device="meta", dtype=torch.bfloat16)
    sink = torch.empty(4, device="meta")
    out, lse, _ = cute_flash.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 37) and out.is_meta


@pytest.mark.parametrize("sink, error, match", [
    (torch.zeros(3), ValueError, r"shape \(nheads,\) = \(4,\)"),
    (torch.zeros(4, 1), ValueError, "shape"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "float16, bfloat16 or float32"),
    ([0.0] * 4, TypeError, "torch.Tensor"),
])
def test_bad_sinks_are_refused(launch, sink, error, match):
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        cute_flash.flash_attn_func(q, k, v, learnable_sink=sink)
    with pytest.raises(error, match=match):
        cute_flash.flash_attn_with_kvcache(q, k, v, learnable_sink=sink)
    assert launch.calls == []


def test_s_dmask_with_dropout_and_a_sink_is_refused(launch):
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="S_dmask has no column for the sink"):
        cute_flash.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True, learnable_sink=torch.zeros(4))
