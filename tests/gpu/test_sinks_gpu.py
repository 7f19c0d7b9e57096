"""Learnable sinks on the kernels: forward (out, LSE) and gradients (q, k, v and the sink) of the
dense, packed and KV-cache calls against the reference with a sink column, by the criterion of
docs/semantics.md, on the Hopper path and the SM80 one (`CUTE_FLASH_ARCH_PATH=sm80`), each test
asserting which kernels ran; and a compiled training step against the eager one.
tests/cpu/test_sinks.py checks the fold and its gradient on the CPU."""
import pytest
import torch

import cute_flash
from cute_flash.reference import attention_ref, attention_varlen_ref
from tests.helpers.backward import GRAD_FLOOR, assert_grads_match
from tests.helpers.gpu_utils import assert_matches_reference, backward_on_path, cu_seqlens, on_path

pytestmark = pytest.mark.gpu


def _inputs(b, sq, sk, h, hk, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    sink = torch.randn(h, device="cuda", generator=g) * 2
    return q, k, v, dout, sink


def _assert_sink_grad(got, ref_fn, q, k, v, dout, sink, **opts):
    """dsink against the float32 reference's, within twice the bf16 reference's distance of it."""
    grads = []
    for dtype in (torch.float32, None):
        leaves = [x.detach().to(dtype or x.dtype) for x in (q, k, v)]
        s = sink.detach().clone().requires_grad_()
        out, _ = ref_fn(*leaves, upcast=dtype is not None, learnable_sink=s, **opts)
        out.backward(dout.to(out.dtype))
        grads.append(s.grad.float())
    want, lowp = grads
    err, bar = (got.float() - want).abs().max().item(), 2 * (lowp - want).abs().max().item() + GRAD_FLOOR
    assert err <= bar, f"dsink: max abs error {err:.3e} > {bar:.3e}"


@pytest.mark.parametrize("b, sq, sk, h, hk, d, causal", [
    (2, 200, 333, 8, 2, 128, True), (1, 512, 512, 4, 4, 64, False), (2, 97, 64, 6, 3, 96, True)])
def test_dense_forward_and_backward_with_a_sink(arch_path, kernels, b, sq, sk, h, hk, d, causal):
    q, k, v, dout, sink = _inputs(b, sq, sk, h, hk, d, seed=sq)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
    out, lse, _ = cute_flash.flash_attn_func(*leaves[:3], causal=causal, learnable_sink=leaves[3],
                                             return_attn_probs=True)
    assert_matches_reference(out.detach(), lse, q, k, v, causal=causal, learnable_sink=sink)
    out.backward(dout)
    assert_grads_match([x.grad for x in leaves[:3]], q, k, v, dout, out=out, causal=causal, learnable_sink=sink)
    _assert_sink_grad(leaves[3].grad, attention_ref, q, k, v, dout, sink, causal=causal)
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, d)


def test_packed_forward_and_backward_with_a_sink(arch_path, kernels):
    lengths = [130, 1, 257, 64]
    cu, total = cu_seqlens(lengths), sum(lengths)
    q, k, v, dout, sink = (x[0] if x.dim() == 4 else x for x in _inputs(1, total, total, 8, 2, 128, seed=3))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
    def ref_fn(q, k, v, **opts):
        return attention_varlen_ref(q, k, v, cu, cu, **opts)

    out, lse, _ = cute_flash.flash_attn_varlen_func(*leaves[:3], cu, cu, max(lengths), max(lengths), causal=True,
                                                    learnable_sink=leaves[3], return_attn_probs=True)
    assert_matches_reference(out.detach(), lse, q, k, v, ref_fn, causal=True, learnable_sink=sink)
    out.backward(dout)
    assert_grads_match([x.grad for x in leaves[:3]], q, k, v, dout, out=out, ref_fn=ref_fn, causal=True,
                       learnable_sink=sink)
    _assert_sink_grad(leaves[3].grad, ref_fn, q, k, v, dout, sink, causal=True)
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, 128)


def _no_host_fold(monkeypatch):
    """A call that folds the sink in on the host (`sinks.fold`) fails the test: the kernels'
    epilogues add it."""
    from cute_flash import sinks

    monkeypatch.setattr(sinks, "fold", lambda *args: pytest.fail("a sink folded on the host"))


@pytest.mark.parametrize("num_splits", [0, 1, 3, 12])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_kvcache_with_a_sink(arch_path, kernels, seqlen_q, num_splits, monkeypatch):
    """Either KV-cache kernel adds the sink in its epilogue (one query row: the GQA fold of the
    heads into rows; four: the Hopper entry's query fold), unsplit, split (3: the Hopper entry's
    cluster; 12: through the workspace) or as the split rule picks (0), with an empty cache (a
    row of the sink alone); no fold on the host."""
    _no_host_fold(monkeypatch)
    q, k_cache, v_cache, _, sink = _inputs(3, seqlen_q, 4096, 32, 8, 128, seed=seqlen_q + 10 * num_splits)
    lens = torch.tensor([4096, 1000, 0], dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                  num_splits=num_splits, return_softmax_lse=True, learnable_sink=sink)
    keys = torch.arange(4096, device="cuda") < lens[:, None]
    assert_matches_reference(out, lse, q, k_cache, v_cache, causal=True, key_padding_mask=keys,
                             learnable_sink=sink)
    assert kernels == on_path(arch_path, "fwd")


@pytest.mark.parametrize("ctas", [5, 300])
@pytest.mark.parametrize("seqlen_q, h", [(1, 8), (6, 16)], ids=["gqa-fold", "query-fold"])
def test_hopper_stream_k_with_a_sink(seqlen_q, h, ctas, kernels, monkeypatch):
    """Stream-K on the Hopper entry with a sink: `ctas` CTAs share the tiles' key blocks, fewer
    CTAs than tiles or more than key blocks (a tile's first share, which carries the sink, may
    hold no key), an empty cache among them."""
    from cute_flash.launch import gpu, kvcache
    from cute_flash.launch.kvcache import flash_fwd_kvcache

    if gpu.device_arch(torch.cuda.current_device()) != 90:
        pytest.skip("the Hopper KV-cache entry runs on sm_90")
    _no_host_fold(monkeypatch)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    q, k_cache, v_cache, _, sink = _inputs(3, seqlen_q, 1024, h, 2, 128, seed=ctas + seqlen_q)
    lens = torch.tensor([700, 0, 1024], dtype=torch.int32, device="cuda")
    causal = seqlen_q > 1  # one row without a mask edge: the GQA fold (pack_gqa), else the query fold
    signature = ("stream-K sink test", seqlen_q, h, ctas)  # keeps the plan
    out, lse = flash_fwd_kvcache(q, k_cache, v_cache, cache_seqlens=lens, softmax_scale=128 ** -0.5, causal=causal,
                                 learnable_sink=sink, hopper_variant=dict(stream_ctas=ctas), signature=signature)
    plan = kvcache._calls[signature, "sm90"].plan
    assert plan.config.stream_k and plan.config.learnable_sink
    assert plan.config.pack_gqa == (not causal) and plan.query_group == (8 if causal else 1)
    keys = torch.arange(1024, device="cuda") < lens[:, None]
    assert_matches_reference(out, lse, q, k_cache, v_cache, causal=causal, key_padding_mask=keys,
                             learnable_sink=sink)
    assert kernels == {"sm90_fwd"}


def test_compiled_training_step_with_a_sink_matches_eager():
    torch._dynamo.reset()
    q, k, v, dout, sink = _inputs(2, 256, 256, 8, 2, 64, seed=11)

    def step(q, k, v, sink):
        return cute_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out] + [x.grad for x in leaves])
    torch._dynamo.reset()
    for eager, compiled in zip(*results):  # the same kernels, D computed apart for the sink
        torch.testing.assert_close(compiled.float(), eager.float(), atol=1e-3, rtol=1e-3)
