"""The custom ops on real CUDA tensors: `torch.library.opcheck` of each op (the backward ops
too), torch.compile (inductor, fullgraph) giving the eager outputs bit for bit (a training
step's gradients too, with and without mods), a dynamic sequence length compiling
once, and CUDA-graph capture and replay of prefill and decode, including a first call (kernel
compile and load) made inside the capture. The CPU half is tests/cpu/test_torch_compile.py."""
import pytest
import torch

from cute_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tests.helpers.gpu_utils import captures_graph, cu_seqlens

pytestmark = pytest.mark.gpu

BF16 = dict(device="cuda", dtype=torch.bfloat16)
I32 = dict(device="cuda", dtype=torch.int32)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _randn(*shape):
    return torch.randn(*shape, **BF16)


def test_opcheck_fwd():
    q, k, v = _randn(2, 100, 8, 64), _randn(2, 130, 2, 64), _randn(2, 130, 2, 64)
    slopes = torch.rand(2, 8, device="cuda", dtype=torch.float32)
    for args in ((q, k, v, 0.125, True, -1, -1, 0.0, None, [], [], []),
                 (q, k, v, 0.125, False, 32, 8, 30.0, slopes, [], [], []),
                 (_randn(1, 64, 4, 100), _randn(1, 64, 4, 100), _randn(1, 64, 4, 100), 0.1, True, -1, 0, 0.0, None,
                  [], [], [])):
        torch.library.opcheck(torch.ops.cute_flash.fwd.default, args)


def test_opcheck_fwd_varlen():
    lq, lk = [37, 0, 90], [50, 20, 91]
    q, k, v = _randn(sum(lq), 8, 128), _randn(sum(lk), 4, 128), _randn(sum(lk), 4, 128)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    torch.library.opcheck(torch.ops.cute_flash.fwd_varlen.default,
                          (q, k, v, cu_q, cu_k, max(lq), max(lk), 0.09, True, -1, -1, 0.0, None, None, None, []))
    pages = _randn(12, 16, 4, 128)
    table = torch.arange(12, **I32).view(3, 4)
    used = torch.tensor([40, 7, 64], **I32)
    torch.library.opcheck(torch.ops.cute_flash.fwd_varlen.default,
                          (q, pages, pages, cu_q, cu_seqlens([64, 64, 64]), max(lq), 64, 0.09, False, 16, -1, 0.0,
                           None, table, used, []))


def test_opcheck_fwd_kvcache():
    q = _randn(3, 1, 16, 128)
    k_cache, v_cache = _randn(3, 256, 4, 128), _randn(3, 256, 4, 128)
    k, v = _randn(3, 1, 4, 128), _randn(3, 1, 4, 128)
    lens = torch.tensor([10, 200, 255], **I32)
    op = torch.ops.cute_flash.fwd_kvcache.default
    # attention only; with an append (the declared mutation of both caches); an int length, split
    torch.library.opcheck(op, (q, k_cache, v_cache, None, None, None, None, lens, None, None, None, None, 0.088,
                               True, -1, 0, 0.0, True, None, 0))
    torch.library.opcheck(op, (q, k_cache, v_cache, k, v, None, None, lens, None, None, None, None, 0.088,
                               True, -1, 0, 0.0, True, None, 1))
    torch.library.opcheck(op, (q, k_cache, v_cache, k, v, None, None, None, 100, None, None, None, 0.088,
                               False, -1, -1, 0.0, True, None, 4))


def test_opcheck_bwd():
    q, k, v = _randn(2, 100, 8, 64), _randn(2, 130, 2, 64), _randn(2, 130, 2, 64)
    out, lse = torch.ops.cute_flash.fwd(q, k, v, 0.125, True, -1, -1, 0.0, None, [], [], [])
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_flash.bwd.default,
                          (dout, q, k, v, out, lse, 0.125, True, -1, 0, 0.0, None, [], [], [], True))
    lq, lk = [37, 90], [50, 91]
    qv, kv = _randn(sum(lq), 8, 64), _randn(sum(lk), 4, 64)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    outv, lsev = torch.ops.cute_flash.fwd_varlen(qv, kv, kv, cu_q, cu_k, 90, 91, 0.125, False, -1, -1, 0.0, None,
                                                 None, None, [])
    torch.library.opcheck(torch.ops.cute_flash.bwd_varlen.default,
                          (torch.randn_like(outv), qv, kv, kv, outv, lsev, cu_q, cu_k, 90, 91, 0.125, False, -1, -1,
                           0.0, None, None, [], True))


def assert_compiled_step_equals_eager(step):
    """step(q, k, v) -> loss, eager and under torch.compile (fullgraph) on the same inputs: the
    losses close (inductor may sum in another order), the gradients bit for bit."""
    inputs = [_randn(2, 250, 8, 64), _randn(2, 250, 2, 64), _randn(2, 250, 2, 64)]
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.detach().requires_grad_() for x in inputs]
        loss = fn(*leaves)
        loss.backward()
        grads.append((loss, [x.grad for x in leaves]))
    (loss, got), (eager_loss, want) = grads[1], grads[0]
    torch.testing.assert_close(loss, eager_loss)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_compiled_training_step_equals_eager():
    """Forward and backward under torch.compile (the ops' registered gradient) give the eager
    autograd path's output and gradients bit for bit (deterministic backward)."""
    def step(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, softcap=20.0, deterministic=True)
        return (out.float() ** 2).sum()

    assert_compiled_step_equals_eager(step)


@pytest.mark.parametrize("name", ["document", "document_blocks", "relative_bias"])
def test_compiled_training_step_with_a_mod_equals_eager(name):
    """A library mod (its aux tensor a graph input, the mods a key in the ops; document_blocks
    with its block mask's lists too) under torch.compile: output and gradients the eager path's
    bit for bit (deterministic backward; the forward skips the blocks the mask leaves empty)."""
    from cute_flash import mods

    torch.manual_seed(0)
    docs = torch.cumsum(torch.rand(2, 250) < 0.02, 1).to(torch.int32).cuda()
    spec = mods.relative_bias(torch.randn(8, 33).cuda()) if name == "relative_bias" else mods.document_mask(docs)
    extra = dict(block_mask=spec.block_mask(2, 1, 250, 250)) if name == "document_blocks" else {}

    def step(q, k, v):
        out = flash_attn_func(q, k, v, deterministic=True, **spec.kwargs(), **extra)
        return (out.float() ** 2).sum()

    assert_compiled_step_equals_eager(step)


def test_compiled_function_equals_eager():
    """Inductor, fullgraph, one graph: the ops run the very kernels eager calls run."""
    def attend(q, k, v):
        return flash_attn_func(q * 1.0, k, v, causal=True, window_size=(48, 0), return_attn_probs=True)[:2]

    q, k, v = _randn(2, 200, 8, 96), _randn(2, 230, 2, 96), _randn(2, 230, 2, 96)
    explained = torch._dynamo.explain(attend)(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(attend, fullgraph=True)
    for got, want in zip(compiled(q, k, v), attend(q, k, v)):
        assert torch.equal(got, want)


@pytest.mark.lowp_gemm  # the block's bf16 projections: not under racecheck
def test_compiled_module_matches_eager():
    """A small attention block (projections, GQA attention, output projection) compiled whole."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, dim=256, heads=4, kv_heads=2):
            super().__init__()
            self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
            self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.d)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).split([self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], -1)
            out = flash_attn_func(q.view(b, s, self.heads, self.d), k.view(b, s, self.kv_heads, self.d),
                                  v.view(b, s, self.kv_heads, self.d), causal=True)
            return self.proj(out.reshape(b, s, -1)) + x

    model = Block().cuda().to(torch.bfloat16)
    x = _randn(2, 333, 256)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_dynamic_sequence_length_compiles_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, backend=counter)
    def attend(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    for s in (128, 200, 517):
        q, k, v = _randn(1, s, 4, 64), _randn(1, s, 4, 64), _randn(1, s, 4, 64)
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 1)
        assert torch.equal(attend(q, k, v), flash_attn_func(q, k, v, causal=True))
    assert counter.frame_count == 1


def test_compiled_varlen_and_kvcache_equal_eager():
    lq, lk = [30, 61], [70, 90]
    q, k, v = _randn(sum(lq), 8, 64), _randn(sum(lk), 8, 64), _randn(sum(lk), 8, 64)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)

    def varlen(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)

    assert torch.equal(torch.compile(varlen, fullgraph=True)(q, k, v), varlen(q, k, v))

    def decode(q, k_cache, v_cache, k, v, lens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                       return_softmax_lse=True)

    q1, k1, v1 = _randn(2, 1, 16, 128), _randn(2, 1, 4, 128), _randn(2, 1, 4, 128)
    caches = [_randn(2, 512, 4, 128) for _ in range(2)]
    lens = torch.tensor([5, 400], **I32)
    eager_caches = [c.clone() for c in caches]
    want = decode(q1, *eager_caches, k1, v1, lens)
    got = torch.compile(decode, fullgraph=True)(q1, *caches, k1, v1, lens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(caches, eager_caches):  # the append happened in place under compile too
        assert torch.equal(a, b)


def _captured(step):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "first-call-in-capture"])
@captures_graph
def test_graph_replay_of_prefill_equals_eager(warm):
    """Captured once, replayed on new contents of the static inputs. `first-call-in-capture`
    uses a signature no other test of this process uses (d 72, softcap), so its kernel is
    compiled (or loaded from the disk cache) while the capture is open."""
    d, opts = (64, {}) if warm else (72, {"softcap": 20.0, "window_size": (100, 3)})
    q, k, v = _randn(2, 300, 8, d), _randn(2, 300, 4, d), _randn(2, 300, 4, d)

    def step():
        return flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **opts)[:2]

    if warm:
        step()
        torch.cuda.synchronize()
    graph, (out, lse) = _captured(step)
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        want_out, want_lse = step()
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "first-call-in-capture"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@captures_graph
def test_graph_replay_of_decode_equals_eager(warm, paged):
    """A decode step (append one token at `cache_seqlens`, attend, split-KV by the heuristic)
    captured once and replayed with growing lengths, against the same steps run eagerly on a
    copy of the caches. `first-call-in-capture` uses d 80 (no other test here does)."""
    d = 128 if warm else 80
    b, hk, rows = 4, 2, 1024
    if paged:
        page = 64
        k_cache, v_cache = _randn(b * rows // page, page, hk, d), _randn(b * rows // page, page, hk, d)
        table = torch.randperm(b * rows // page, device="cuda").to(torch.int32).view(b, rows // page)
    else:
        k_cache, v_cache, table = _randn(b, rows, hk, d), _randn(b, rows, hk, d), None
    q, k, v = _randn(b, 1, 8, d), _randn(b, 1, hk, d), _randn(b, 1, hk, d)
    lens = torch.tensor([0, 17, 500, 900], **I32)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()

    def step(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                       return_softmax_lse=True)

    if warm:
        step(k_cache.clone(), v_cache.clone())
        torch.cuda.synchronize()
    graph, (out, lse) = _captured(lambda: step(k_cache, v_cache))
    for t in range(3):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        want_out, want_lse = step(eager_k, eager_v)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"step {t}"
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), f"step {t}"
        lens += 1
