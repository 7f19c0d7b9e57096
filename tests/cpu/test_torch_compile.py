"""torch.compile over the public functions, on the CPU: inputs are fake CUDA tensors
(`FakeTensorMode`), so Dynamo traces the interface and the custom ops' fake implementations
(cute_flash/ops.py) without a GPU or a kernel. Each function is one graph with no break, with
the shapes, dtypes and strides of the eager outputs, and a dynamic sequence length does not
retrace. The real ops run in the GPU suite."""
import operator

import cutlass.cute as cute
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_flash
from cute_flash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_with_kvcache)

BF16 = dict(device="cuda", dtype=torch.bfloat16)


@pytest.fixture
def fake():
    torch._dynamo.reset()
    with FakeTensorMode() as mode:
        yield mode
    torch._dynamo.reset()


def keeping_graphs(seen: list):
    """An AOTAutograd backend that runs the traced graphs as they are and appends ("fw" or "bw",
    graph) to `seen`."""
    def keep(kind):
        return lambda g, _: seen.append((kind, g)) or make_boxed_func(g.forward)

    def backend(gm, example_inputs):
        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))(gm, example_inputs)
    return backend


def _one_graph(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    return explained


def test_dense_functions_are_one_graph(fake):
    q, k = torch.randn(2, 128, 8, 64, **BF16), torch.randn(2, 256, 2, 64, **BF16)
    _one_graph(lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(64, 0)), q, k, k)
    _one_graph(lambda q, kv: flash_attn_kvpacked_func(q, kv, softcap=30.0), q, torch.randn(2, 256, 2, 2, 64, **BF16))
    _one_graph(lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True), torch.randn(2, 128, 3, 8, 64, **BF16))


def test_compiled_outputs_have_the_eager_layout(fake):
    q = torch.randn(2, 128, 8, 100, **BF16)  # a head dim the launcher pads: still a contiguous output

    @torch.compile(fullgraph=True, backend="aot_eager")
    def attend(q, k, v):
        out, lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out, lse, s_dmask

    out, lse, s_dmask = attend(q, q, q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 8, 128) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert s_dmask.shape == (0,)


def test_a_value_head_dim_of_its_own_is_one_graph(fake):
    """MLA's q / k 192 with v 128 compiled without a gradient: the forward op takes v as it is,
    its output 128 wide."""
    q, v = torch.randn(2, 128, 8, 192, **BF16), torch.randn(2, 128, 8, 128, **BF16)
    _one_graph(lambda q, k, v: flash_attn_func(q, k, v, causal=True), q, q, v)
    attend = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    assert attend(q, q, v).shape == (2, 128, 8, 128)


def test_varlen_and_paged_are_one_graph(fake):
    q, k = torch.randn(300, 8, 128, **BF16), torch.randn(500, 8, 128, **BF16)
    cu_q = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 500], device="cuda", dtype=torch.int32)
    _one_graph(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True), q, k, k)
    pages = torch.randn(40, 16, 8, 128, **BF16)
    table = torch.zeros(2, 20, device="cuda", dtype=torch.int32)
    _one_graph(lambda q, kp, vp: flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 200, 300, block_table=table),
               q, pages, pages)


def test_kvcache_is_one_graph_and_mutates_the_caches(fake):
    q = torch.randn(4, 1, 32, 128, **BF16)
    k_cache, v_cache = torch.randn(4, 1024, 8, 128, **BF16), torch.randn(4, 1024, 8, 128, **BF16)
    k_new = torch.randn(4, 1, 8, 128, **BF16)
    lens = torch.full((4,), 100, device="cuda", dtype=torch.int32)
    explained = _one_graph(lambda q, kc, vc, kn, vn: flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                                             causal=True), q, k_cache, v_cache, k_new,
                           k_new)
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("cute_flash.fwd_kvcache" in op for op in ops), ops
    schema = torch.ops.cute_flash.fwd_kvcache.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == [
        "k_cache", "v_cache"]
    _one_graph(lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7), q, k_cache, v_cache)


def test_a_dynamic_sequence_length_compiles_once(fake):
    counts = torch._dynamo.testing.CompileCounter()

    @torch.compile(fullgraph=True, backend=counts)
    def attend(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    for seqlen in (128, 192, 320):
        q = torch.randn(2, seqlen, 8, 64, **BF16)
        torch._dynamo.mark_dynamic(q, 1)
        assert attend(q, q, q).shape == q.shape
    assert counts.frame_count == 1


def test_ops_are_registered_under_the_package_namespace():
    assert cute_flash.ops.fwd._qualname == "cute_flash::fwd"
    for name in ("fwd", "fwd_varlen", "fwd_kvcache", "pack_kvcache_queries", "bwd", "bwd_varlen"):
        assert hasattr(torch.ops.cute_flash, name)


@pytest.mark.parametrize("packed", [False, True])
def test_a_training_step_traces_the_backward_op(fake, packed, monkeypatch):
    """Forward and backward compiled (AOTAutograd): the registered gradient of the forward op
    traces the backward op, and the gradients have the inputs' shapes (packed: one tensor).
    The fake tensors live on the CPU here (the CUDA check is switched off): autograd's engine
    needs a CUDA driver for CUDA tensors, even fake ones."""
    monkeypatch.setattr(cute_flash._validate, "check_cuda", lambda named: None)
    seen = []

    @torch.compile(fullgraph=True, backend=keeping_graphs(seen))
    def step(qkv):
        if packed:
            return flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True).float().square().sum()
        q, k, v = qkv.unbind(2)
        return flash_attn_func(q, k[:, :, :2], v[:, :, :2], window_size=(32, 16)).float().square().sum()

    qkv = torch.randn(2, 128, 3, 8, 64, dtype=torch.bfloat16).requires_grad_()
    step(qkv).backward()
    assert qkv.grad.shape == qkv.shape and qkv.grad.dtype == qkv.dtype
    targets = {kind: [str(n.target) for n in g.graph.nodes if n.op == "call_function"] for kind, g in seen}
    assert any("cute_flash.fwd" in t for t in targets["fw"]), targets["fw"]
    assert any("cute_flash.bwd" in t for t in targets["bw"]), targets["bw"]


def test_dropout_state_is_drawn_in_the_graph_and_reaches_the_backward_op(fake, monkeypatch):
    """With dropout the compiled forward graph draws the state (a random op before the forward
    op) and passes it, with p, to both the forward and the backward op."""
    monkeypatch.setattr(cute_flash._validate, "check_cuda", lambda named: None)
    seen = []

    @torch.compile(fullgraph=True, backend=keeping_graphs(seen))
    def step(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.15, causal=True).float().sum()

    q, k, v = (torch.randn(2, 128, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    step(q, k, v).backward()
    assert q.grad.shape == q.shape
    graphs = dict(seen)
    ops = {kind: [n for n in g.graph.nodes if n.op == "call_function"] for kind, g in graphs.items()}
    fwd = [n for n in ops["fw"] if "cute_flash.fwd" in str(n.target)]
    bwd = [n for n in ops["bw"] if "cute_flash.bwd" in str(n.target)]
    assert len(fwd) == len(bwd) == 1
    assert any("randint" in str(n.target) for n in ops["fw"]), [str(n.target) for n in ops["fw"]]
    for node in fwd + bwd:
        args = list(node.args) + list(node.kwargs.values())
        assert 0.15 in args and any(getattr(a, "op", None) is not None for a in args[-1:]), node.format_node()


@cute.jit
def _causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return operator.ge(q_idx, kv_idx)


@cute.jit
def _bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return score + aux_tensors[0][h_idx[0]]


@cute.jit
def _bias_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return grad


def test_mods_are_one_graph_with_their_key_and_aux_tensors(fake):
    """The mods travel as a key of the graph (their digests, `ops.remember_mods`) and the aux
    tensors as graph inputs of the op, dense and packed; the key finds the callables again."""
    q = torch.randn(2, 128, 4, 64, **BF16)
    slopes = torch.randn(4, device="cuda")
    explained = _one_graph(lambda q, s: flash_attn_func(q, q, q, score_mod=_bias, mask_mod=_causal, aux_tensors=[s]),
                           q, slopes)
    (node,) = [n for n in explained.graphs[0].graph.nodes if "cute_flash.fwd" in str(n.target)]
    key = node.args[-1]
    assert key.startswith("score:") and "|mask:" in key and cute_flash.ops._MODS[key][:2] == (_bias, _causal)
    assert len(node.args[9]) == 1  # aux_tensors: a list of graph values
    qv = torch.randn(300, 4, 64, **BF16)
    cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
    _one_graph(lambda q: flash_attn_varlen_func(q, q, q, cu, cu, 200, 200, mask_mod=_causal), qv)


def test_a_training_step_with_mods_passes_them_to_the_backward_op(fake, monkeypatch):
    monkeypatch.setattr(cute_flash._validate, "check_cuda", lambda named: None)
    seen = []

    @torch.compile(fullgraph=True, backend=keeping_graphs(seen))
    def step(q, k, v, s):
        return flash_attn_func(q, k, v, score_mod=_bias, score_mod_bwd=_bias_bwd, aux_tensors=[s]).float().sum()

    q, k, v = (torch.randn(2, 128, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    step(q, k, v, torch.randn(4)).backward()
    assert q.grad.shape == q.shape
    (bwd,) = [n for kind, g in seen if kind == "bw" for n in g.graph.nodes if "cute_flash.bwd" in str(n.target)]
    key = bwd.kwargs.get("mods", bwd.args[-1])
    assert cute_flash.ops._MODS[key] == (_bias, None, _bias_bwd)


def test_a_compiled_score_mod_gradient_without_its_backward_is_refused(fake, monkeypatch):
    monkeypatch.setattr(cute_flash._validate, "check_cuda", lambda named: None)
    q = torch.randn(2, 128, 4, 64, dtype=torch.bfloat16).requires_grad_()
    with pytest.raises(Exception, match="needs its score_mod_bwd"):
        torch.compile(lambda q: flash_attn_func(q, q, q, score_mod=_bias, aux_tensors=[torch.randn(4)]),
                      fullgraph=True, backend="aot_eager")(q)


def test_new_aux_tensors_for_the_same_mods_do_not_retrace(fake):
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=counting)
    def attend(q, slopes):
        return flash_attn_func(q, q, q, score_mod=_bias, mask_mod=_causal, aux_tensors=[slopes])

    q = torch.randn(2, 128, 4, 64, **BF16)
    for _ in range(3):
        attend(q, torch.randn(4, device="cuda"))
    assert len(compiles) == 1


def test_a_block_mask_is_one_graph_and_reaches_the_backward_op(fake, monkeypatch):
    """A FlexAttention BlockMask under torch.compile: its lists are graph inputs of the forward
    and backward ops, its block sizes and lengths constants (`launch/block_sparse.op_arguments`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(cute_flash._validate, "check_cuda", lambda named: None)
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 128, 128, device="cpu")  # fake tensors
    seen = []

    @torch.compile(fullgraph=True, backend=keeping_graphs(seen))
    def step(q, k, v):
        return flash_attn_func(q, k, v, mask_mod=_causal, block_mask=block_mask).float().sum()

    q, k, v = (torch.randn(2, 128, 4, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    step(q, k, v).backward()
    nodes = {kind: [n for n in g.graph.nodes if "cute_flash." in str(n.target)] for kind, g in seen}
    for kind, name in (("fw", "cute_flash.fwd"), ("bw", "cute_flash.bwd")):
        (node,) = [n for n in nodes[kind] if name in str(n.target)]
        args = node.args
        lists, sizes = (args[10], args[11]) if kind == "fw" else (args[13], args[14])
        assert len(lists) == 4 and list(sizes) == [128, 128, 128, 128], node.format_node()


def test_block_lists_from_an_ops_arguments_are_the_block_masks():
    from torch.nn.attention.flex_attention import create_block_mask

    from cute_flash.launch import block_sparse

    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 300, 500, device="cpu", BLOCK_SIZE=(64, 128))
    rebuilt = block_sparse.BlockLists.of_op(*block_sparse.op_arguments(block_mask))
    assert rebuilt.BLOCK_SIZE == (64, 128) and rebuilt.seq_lengths == (300, 500)
    for a, b in zip(block_sparse.block_lists(rebuilt, 2, 4, 300, 500, 128, 128),
                    block_sparse.block_lists(block_mask, 2, 4, 300, 500, 128, 128)):
        assert torch.equal(a, b)
    assert block_sparse.BlockLists.of_op([], []) is None


def test_packed_kvcache_queries_are_one_graph(fake):
    """Packed queries in the KV-cache call (`cu_seqlens_q`): the packing op, which declares its
    writes (the padded queries, the lengths, the caches), then the fixed-length call's op."""
    q = torch.randn(7, 32, 128, **BF16)
    k_cache, v_cache = torch.randn(3, 1024, 8, 128, **BF16), torch.randn(3, 1024, 8, 128, **BF16)
    k_new = torch.randn(7, 8, 128, **BF16)
    cu = torch.tensor([0, 1, 5, 7], device="cuda", dtype=torch.int32)
    lens = torch.full((3,), 100, device="cuda", dtype=torch.int32)
    explained = _one_graph(lambda q, kc, vc, kn, vn: flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, cu_seqlens_q=cu, cu_seqlens_k_new=cu, max_seqlen_q=4),
        q, k_cache, v_cache, k_new, k_new)
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [op for op in ops if "cute_flash" in op] == ["cute_flash.pack_kvcache_queries", "cute_flash.fwd_kvcache"], ops
    schema = torch.ops.cute_flash.pack_kvcache_queries.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == [
        "q_pad", "lengths", "k_cache", "v_cache"]
