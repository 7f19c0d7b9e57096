"""Dropout in the forwards and backwards (SM80 and, on sm_90, Hopper; kernels/common/philox.py:
Dropout) against `cute_flash.reference` computed with the mask `philox.keep_mask` draws for the
same seed and offset (docs/semantics.md, Dropout): a wrong counter, word, threshold or scale in
any element moves the output far past the criterion. The launcher tests give seeds; the public-API tests
take the drawn state back from S_dmask or the private forward's rng_state, and read the kernel's
own mask bits from outputs built to expose them (q = 0, v one-hot)."""
import functools

import pytest
import torch

import cute_flash
from cute_flash import flash_attn_interface as fai
from layouts import philox
from cute_flash.reference import attention_ref
from tests.helpers.gpu_utils import (assert_matches_reference, backward_on_path, captures_graph, cu_seqlens, on_path,
                                    poison_allocator)

pytestmark = pytest.mark.gpu


def _mask(seed, offset, b, h, sq, sk, p):
    return torch.from_numpy(philox.keep_mask(seed, offset, b, h, sq, sk, p)).cuda()


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("b, sq, sk, h, hk, d, opts", [
    (2, 257, 300, 4, 2, 64, {}),
    (1, 513, 129, 6, 3, 128, dict(causal=True)),
    (3, 100, 700, 8, 1, 96, dict(window_size=(200, 30), softcap=15.0)),
], ids=["d64-gqa", "d128-causal", "d96-window-softcap"])
def test_dense_dropout_matches_reference(p, b, sq, sk, h, hk, d, opts, arch_path, kernels):
    """The default path (the Hopper forward on sm_90) and the SM80 kernel."""
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.rng import DropoutArgs

    seed, offset = 0x1234_5678_9ABC, 40
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    poison_allocator()
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, dropout=DropoutArgs.seeded(p, seed, offset, "cuda"), **opts)
    torch.cuda.synchronize()
    ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=_mask(seed, offset, b, h, sq, sk, p))
    assert_matches_reference(out, lse, q, k, v, ref_fn=ref, **opts)
    assert kernels == on_path(arch_path, "fwd")


def test_varlen_dropout_counts_rows_and_columns_per_sequence():
    from cute_flash.launch.dense import flash_fwd_varlen
    from cute_flash.launch.rng import DropoutArgs

    lengths_q, lengths_k, h, d, p, seed, offset = [70, 1, 300], [90, 200, 33], 4, 64, 0.2, 99, 7
    cu_q = torch.tensor([0, 70, 71, 371], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 290, 323], dtype=torch.int32, device="cuda")
    q = torch.randn(371, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(323, h, d, device="cuda", dtype=torch.float16) for _ in range(2))
    poison_allocator()
    out, lse = flash_fwd_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=200,
                                softmax_scale=d ** -0.5, causal=True,
                                dropout=DropoutArgs.seeded(p, seed, offset, "cuda"))
    torch.cuda.synchronize()
    mask = _mask(seed, offset, 3, h, 300, 200, p)
    for i, (sq, sk) in enumerate(zip(lengths_q, lengths_k)):
        qs, ks, vs = q[cu_q[i]:cu_q[i] + sq], k[cu_k[i]:cu_k[i] + sk], v[cu_k[i]:cu_k[i] + sk]
        ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=mask[i:i + 1, :, :sq, :sk])
        assert_matches_reference(out[cu_q[i]:cu_q[i] + sq][None], lse[:, cu_q[i]:cu_q[i] + sq][None], qs[None],
                                 ks[None], vs[None], ref_fn=ref, causal=True)


def test_same_seed_same_output_other_offset_other_output():
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.rng import DropoutArgs

    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = [flash_fwd(q, k, v, softmax_scale=0.125, dropout=DropoutArgs.seeded(0.3, 5, off, "cuda"))[0]
           for off in (0, 0, 1)]
    assert torch.equal(run[0], run[1]) and not torch.equal(run[0], run[2])


@pytest.mark.parametrize("b, sq, sk, h, hk, d, opts, p", [
    (2, 257, 300, 4, 2, 64, {}, 0.25),
    (1, 200, 333, 6, 3, 128, dict(causal=True), 0.25),
    (2, 129, 65, 4, 4, 96, dict(window_size=(40, 10), softcap=20.0), 0.25),
    (2, 257, 300, 4, 2, 64, {}, 0.996),
    (2, 300, 200, 4, 4, 32, {}, 0.996),
], ids=["d64-gqa", "d128-causal", "d96-window-softcap", "d64-gqa-subnormal", "d32-subnormal"])
def test_dense_dropout_grads_match_reference(b, sq, sk, h, hk, d, opts, p):
    """The backward recomputes the forward's mask from the same seed and offset: dq, dk, dv
    against the reference's autograd with that mask, by the backward tests' rule. p = 0.996:
    a keep threshold of 66, bfloat16 subnormals in the Hopper backward's packed compare; d 32
    takes 128-row query blocks there (two registers of keep bits per thread)."""
    from cute_flash.launch.backward import flash_bwd
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.rng import DropoutArgs
    from tests.helpers.backward import assert_grads_match

    seed, offset = 31337, 3
    drop = DropoutArgs.seeded(p, seed, offset, "cuda")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, dropout=drop, **opts)
    poison_allocator()
    dq, dk, dv, _ = flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, dropout=drop, **opts)
    torch.cuda.synchronize()
    ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=_mask(seed, offset, b, h, sq, sk, p))
    assert_grads_match([dq, dk, dv], q, k, v, dout, out=out, ref_fn=ref, **opts)


# --- through the public functions -----------------------------------------------------------


def _kernel_bits(b, sq, h, sk, p):
    """The kernel's own keep bits (b, h, sq, sk) for sk <= 128 = d: with q = 0 every visible
    probability is 1 / sk and v = identity puts element (i, j)'s kept value alone in out[i, j],
    so out > 0 exactly where it was kept. Returns (bits, the private forward's rng_state)."""
    q = torch.zeros(b, sq, h, 128, device="cuda", dtype=torch.float16)
    v = torch.eye(sk, 128, device="cuda", dtype=torch.float16).expand(b, h, sk, 128).transpose(1, 2).contiguous()
    out, _, _, rng_state = fai._flash_attn_forward(q, torch.zeros_like(v), v, p, 1.0, False, -1, -1, 0.0, None,
                                                   False)
    return (out[..., :sk] > 0).permute(0, 2, 1, 3), rng_state


def test_kernel_mask_is_the_states_mask_and_kept_fraction_within_4_sigma():
    """The kernel's mask bits equal philox.keep_mask_of_state of the returned rng_state bit for
    bit, and over 2^26 elements the kept fraction is within 4 sigma of 1 - p."""
    b, sq, h, sk, p = 4, 4096, 32, 128, 0.1
    bits, rng_state = _kernel_bits(b, sq, h, sk, p)
    assert torch.equal(bits, philox.keep_mask_of_state(rng_state, p, b, h, sq, sk))
    n = bits.numel()
    frac = bits.sum().item() / n
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(frac - (1 - p)) < 4 * sigma, (frac, sigma)


@pytest.mark.parametrize("p", [0.996, 1e-5])
def test_kernel_mask_at_the_thresholds_ends(p):
    """Keep thresholds below 128 (p = 0.996: 66 of 2^14, bfloat16 subnormals in the Hopper
    kernels' packed compare) and at 2^14 (p = 1e-5: every element kept) give the state's mask
    bit for bit."""
    b, sq, h, sk = 2, 512, 8, 128
    bits, rng_state = _kernel_bits(b, sq, h, sk, p)
    assert philox.keep_threshold(p) in (66, 2 ** 14)
    assert torch.equal(bits, philox.keep_mask_of_state(rng_state, p, b, h, sq, sk))


def _chi_square(a, b):
    """Pearson's chi-square (1 dof) of the 2x2 table of two equally long bool vectors."""
    a, b = a.flatten().double(), b.flatten().double()
    n = a.numel()
    table = torch.stack([((1 - a) * (1 - b)).sum(), ((1 - a) * b).sum(), (a * (1 - b)).sum(), (a * b).sum()])
    pa, pb = a.mean(), b.mean()
    want = n * torch.stack([(1 - pa) * (1 - pb), (1 - pa) * pb, pa * (1 - pb), pa * pb])
    return (((table - want) ** 2) / want).sum().item()


def test_no_correlation_between_neighbouring_heads_batches_rows_columns():
    """Chi-square of the kernel's mask bits between neighbours: heads h and h+1, batches b and
    b+1 (counters whose third word differ by 1 and by `heads`), rows and columns i and i+1. Under
    independence each is chi-square with 1 dof; 30 is beyond the 1 - 1e-7 quantile."""
    b, sq, h, sk, p = 3, 1024, 4, 128, 0.5
    bits, _ = _kernel_bits(b, sq, h, sk, p)
    stats = {
        "heads": [_chi_square(bits[:, i], bits[:, i + 1]) for i in range(h - 1)],
        "batches": [_chi_square(bits[i], bits[i + 1]) for i in range(b - 1)],
        "rows": [_chi_square(bits[..., :-1, :], bits[..., 1:, :])],
        "columns": [_chi_square(bits[..., :-1], bits[..., 1:])],
    }
    assert all(x < 30 for xs in stats.values() for x in xs), stats
    # the statistic itself sees a correlation: half of one slice copied into its neighbour
    leaky = bits[0, 1].clone()
    leaky[: sq // 2] = bits[0, 0, : sq // 2]
    assert _chi_square(bits[0, 0], leaky) > 1000


def _mask_of(s_dmask, sq, sk):
    """The keep mask in S_dmask's signs, on its first sq x sk (its lengths are rounded up to 128)."""
    return ~torch.signbit(s_dmask[..., :sq, :sk])


@pytest.mark.parametrize("b, sq, sk, h, hk, d, opts", [
    (2, 193, 257, 6, 2, 64, {}),
    (1, 300, 211, 4, 4, 128, dict(causal=True)),
    (2, 77, 500, 8, 1, 96, dict(window_size=(100, 20), softcap=10.0)),
], ids=["d64-gqa", "d128-causal", "d96-window-softcap"])
def test_public_out_and_grads_match_reference_with_s_dmask_mask(b, sq, sk, h, hk, d, opts):
    """flash_attn_func with dropout and return_attn_probs: out and, through autograd, dq/dk/dv
    against the reference given the mask read back from S_dmask's signs."""
    from tests.helpers.backward import assert_grads_match

    p = 0.17
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dout = torch.randn_like(q)
    out, lse, s_dmask = cute_flash.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **opts)
    out.backward(dout)
    torch.cuda.synchronize()
    assert s_dmask.shape == (b, h, -(-sq // 128) * 128, -(-sk // 128) * 128) and s_dmask.dtype == q.dtype
    ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=_mask_of(s_dmask, sq, sk))
    grads = [x.grad for x in (q, k, v)]
    q, k, v = q.detach(), k.detach(), v.detach()
    assert_matches_reference(out.detach(), lse, q, k, v, ref_fn=ref, **opts)
    assert_grads_match(grads, q, k, v, dout, out=out.detach(), ref_fn=ref, **opts)


def test_public_varlen_matches_reference_with_s_dmask_mask():
    p, h, d = 0.3, 4, 64
    lengths = [(70, 90), (1, 200), (300, 33)]
    cu_q = torch.tensor([0, 70, 71, 371], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 290, 323], dtype=torch.int32, device="cuda")
    q = torch.randn(371, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(323, h, d, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse, s_dmask = cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 200, dropout_p=p, causal=True,
                                                          return_attn_probs=True)
    torch.cuda.synchronize()
    assert s_dmask.shape == (3, h, 384, 256)
    for i, (sq, sk) in enumerate(lengths):
        qs, ks, vs = q[cu_q[i]:cu_q[i] + sq], k[cu_k[i]:cu_k[i] + sk], v[cu_k[i]:cu_k[i] + sk]
        mask = _mask_of(s_dmask[i:i + 1], sq, sk)
        ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=mask)
        assert_matches_reference(out[cu_q[i]:cu_q[i] + sq][None], lse[:, cu_q[i]:cu_q[i] + sq][None], qs[None],
                                 ks[None], vs[None], ref_fn=ref, causal=True)
    assert s_dmask[0, :, 70:].abs().sum() == 0 and s_dmask[2, :, :, 33:].abs().sum() == 0


def test_same_seed_bitwise_identical_and_successive_calls_differ():
    q, k, v, dout = (torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = cute_flash.flash_attn_func(*leaves, dropout_p=0.2, causal=True, deterministic=True)
        out.backward(dout)
        return [out.detach()] + [x.grad for x in leaves]

    torch.manual_seed(11)
    first, second = run(), run()
    torch.manual_seed(11)
    again = run()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], second[0])


@captures_graph
def test_cuda_graph_replays_draw_fresh_masks():
    """A captured forward draws its state on the device: each replay gets a new rng_state, and
    the output of each replay matches the reference with that state's mask."""
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))

    def fwd():
        return fai._flash_attn_forward(q, k, v, 0.25, 0.125, False, -1, -1, 0.0, None, False)

    fwd()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, _, rng_state = fwd()
    seen = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        seen.append(rng_state.clone())
        mask = philox.keep_mask_of_state(rng_state, 0.25, 1, 4, 256, 256)
        ref = functools.partial(attention_ref, dropout_p=0.25, dropout_mask=mask)
        assert_matches_reference(out, lse, q, k, v, ref_fn=ref, softmax_scale=0.125)
    assert not torch.equal(seen[0], seen[1])


def test_compiled_training_step_with_dropout():
    """torch.compile (inductor) over the forward with dropout, backward through its registered
    gradient: out and grads against the reference with the mask of S_dmask, drawn inside the
    compiled graph."""
    from tests.helpers.backward import assert_grads_match

    torch._dynamo.reset()
    p = 0.2

    @torch.compile(fullgraph=True)
    def fwd(q, k, v):
        return cute_flash.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)

    q, k, v, dout = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, s = fwd(*leaves)
    out.backward(dout)
    torch.cuda.synchronize()
    ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=_mask_of(s, 200, 200))
    assert_matches_reference(out.detach(), lse, q, k, v, ref_fn=ref, causal=True)
    assert_grads_match([x.grad for x in leaves], q, k, v, dout, out=out.detach(), ref_fn=ref, causal=True)


# --- packed batches with dropout: backward, pages, the SM80 kernel on sm_90 ------------------


def _sequences(drop, lq, lk, h):
    """Per sequence i: its query rows, its key rows (slices of the packed tensors) and its keep
    mask (1, h, lq[i], lk[i]), whose rows and columns count from the sequence's start."""
    full = philox.keep_mask_of_state(drop.rng_state, drop.p, len(lq), h, max(lq), max(lk))
    q0, k0 = 0, 0
    for i, (sq, sk) in enumerate(zip(lq, lk)):
        yield slice(q0, q0 + sq), slice(k0, k0 + sk), full[i:i + 1, :, :sq, :sk]
        q0, k0 = q0 + sq, k0 + sk


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(40, 7), softcap=10.0)],
                         ids=["causal", "window-softcap"])
def test_varlen_dropout_grads_match_reference_per_sequence(opts, arch_path, kernels):
    """The packed forward and backward with dropout, each sequence against the reference with
    its part of the mask, on either path."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch.backward import flash_bwd_varlen
    from cute_flash.launch.dense import flash_fwd_varlen
    from tests.helpers.backward import assert_grads_match, packed_inputs

    lq, lk, h, hk, d, p = [70, 1, 200], [90, 130, 33], 4, 2, 64, 0.2
    q, k, v, dout = packed_inputs(lq, lk, h, hk, d)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    drop = DropoutArgs.seeded(p, 777, 5, "cuda")
    lens = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk), softmax_scale=0.125)
    out, lse = flash_fwd_varlen(q, k, v, **lens, dropout=drop, **opts)
    poison_allocator()
    dq, dk, dv, _ = flash_bwd_varlen(dout, q, k, v, out, lse, **lens, dropout=drop, **opts)
    torch.cuda.synchronize()
    assert kernels == on_path(arch_path, "fwd") | backward_on_path(arch_path, d)
    for rq, rk, mask in _sequences(drop, lq, lk, h):
        ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=mask, softmax_scale=0.125)
        sq_ = (q[rq][None], k[rk][None], v[rk][None])
        assert_matches_reference(out[rq][None], lse[:, rq][None], *sq_, ref_fn=ref, **opts)
        # dk, dv of a sequence come from its own queries only: each sequence is a whole problem
        assert_grads_match([dq[rq][None], dk[rk][None], dv[rk][None]], *sq_, dout[rq][None], out=out[rq][None],
                           ref_fn=ref, **opts)


def test_paged_varlen_dropout_matches_reference(kernels):
    """Dropout over a paged cache (pages of 128 rows: the Hopper entry on sm_90; of 16 the SM80
    kernel), each sequence against the reference with its part of the mask."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch.dense import flash_fwd_varlen
    from tests.helpers.caches import paged_cache

    lq, lk, h, hk, d, p = [50, 130], [300, 77], 4, 2, 128, 0.3
    for page_size, path in ((128, "default"), (16, "sm80")):
        kernels.clear()
        k_pages, v_pages, table, k, v = paged_cache(lk, page_size, hk, d, torch.bfloat16)
        q = torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16)
        cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
        drop = DropoutArgs.seeded(p, 4242, 9, "cuda")
        poison_allocator()
        out, lse = flash_fwd_varlen(q, k_pages, v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                                    max_seqlen_k=max(lk), softmax_scale=d ** -0.5, causal=True, block_table=table,
                                    dropout=drop)
        torch.cuda.synchronize()
        assert kernels == on_path(path, "fwd")
        for rq, rk, mask in _sequences(drop, lq, lk, h):
            ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=mask)
            assert_matches_reference(out[rq][None], lse[:, rq][None], q[rq][None], k[rk][None], v[rk][None],
                                     ref_fn=ref, causal=True)


@captures_graph
def test_cuda_graph_of_a_training_step_with_dropout_replays_with_a_new_mask():
    """One captured forward + backward with dropout: each replay draws a new rng_state on the
    device, and its output and gradients match the reference with that state's mask."""
    from tests.helpers.backward import assert_grads_match

    p, b, s, h, d = 0.2, 1, 200, 4, 64
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    states = []

    def step():
        out, lse, _, rng_state = fai._flash_attn_forward(*(x.detach() for x in leaves), p, 0.125, True, -1, -1, 0.0,
                                                         None, False)
        grads = [torch.empty_like(x) for x in leaves]
        fai._flash_attn_backward(dout, *(x.detach() for x in leaves), out, lse, *grads, p, 0.125, True, -1, -1, 0.0,
                                 None, False, rng_state)
        return out, lse, grads, rng_state

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, grads, rng_state = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        states.append(rng_state.clone())
        mask = philox.keep_mask_of_state(rng_state, p, b, h, s, s)
        ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=mask, softmax_scale=0.125)
        assert_matches_reference(out, lse, q, k, v, ref_fn=ref, causal=True)
        assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=ref, causal=True)
    assert not torch.equal(states[0], states[1])
