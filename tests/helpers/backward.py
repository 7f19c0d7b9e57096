"""The backward's rule on the GPU, shared by the GPU tests of gradients (tests/gpu/test_bwd_gpu.py,
test_bwd_sm90_gpu.py, test_dropout_gpu.py, test_conformance_gpu.py, ...): gradients through a
public function with the allocator poisoned (`ours`), the reference's (`reference`), and
flash-attn's rule between them (`assert_grads_match`, docs/semantics.md); and the bodies of the
tests that tests/gpu/test_bwd_gpu.py (SM80) and test_bwd_sm90_gpu.py (Hopper) both run."""
import torch
from hypothesis import strategies as st

from cute_flash import flash_attn_func, flash_attn_varlen_func
from cute_flash.reference import attention_ref, attention_varlen_ref
from tests.helpers.gpu_utils import assert_output_matches, cu_seqlens, one_step, poison_allocator

ODD_LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 255, 257]
GRAD_FLOOR = 1e-4
lengths = st.one_of(st.sampled_from(ODD_LENGTHS), st.integers(1, 400))
heads = st.sampled_from([(1, 1), (2, 2), (4, 1), (4, 2), (6, 3), (8, 1)])


def _leaves(*xs, dtype=None):
    return [x.detach().to(dtype or x.dtype).requires_grad_() for x in xs]


def ours(fn, dout, *inputs, **opts):
    """out and the inputs' gradients through `fn` (a public function), allocator poisoned."""
    poison_allocator()
    leaves = _leaves(*inputs)
    out = fn(*leaves, **opts)
    out.backward(dout)
    torch.cuda.synchronize()
    return out, [x.grad for x in leaves]


def reference(ref_fn, dout, *inputs, upcast=True, stored_out=None, **opts):
    """Gradients of the reference: float32 leaves (upcast) or leaves in the input dtype.

    stored_out: the output the backward under test read. Its D = rowsum(dO * O) then comes
    from that O, as the kernels' (and flash-attn's) does from the O the forward stored in the
    input dtype: D's difference d_i moves dS by -d_i P_ij, the gradient of -sum_i d_i LSE_i.
    With few keys a row's dS is a small difference that O's rounding dominates: against the
    float32 O, a float32 emulation of the kernels missed the bar in 6-12% of draws at 255 x 2
    causal (d 128 / 160; the kernels 3-14% at d 96-160 on the H200), and none with D from its
    own O."""
    leaves = _leaves(*inputs, dtype=torch.float32 if upcast else None)
    out, lse = ref_fn(*leaves, upcast=upcast, **opts)
    if stored_out is None:
        out.backward(dout.to(out.dtype))
    else:
        finite = torch.isfinite(lse)  # rows with no key: out 0, no D
        d = (dout.float() * (stored_out.detach().float() - out.detach().float())).sum(-1).movedim(-1, -2)
        torch.autograd.backward([out, lse], [dout.to(out.dtype), -d.masked_fill(~finite, 0.0)])
    return [x.grad for x in leaves]


def assert_grads_match(got, q, k, v, dout, *, out, ref_fn=attention_ref, **opts):
    """got (dq, dk, dv) against the float32 reference given `out`, the forward output the
    backward read (`reference`'s stored_out), by the rule of docs/semantics.md: the bar plus the
    rounding the gradients' storage adds (`storage_floor`); `out` itself against the reference
    first, since D = rowsum(dO * O) comes from it: a wrong forward could otherwise hand the
    backward a D that its own gradients agree with."""
    with torch.no_grad():
        assert_output_matches(out.detach(), ref_fn(q, k, v, **opts)[0], q, k, v, ref_fn, **opts)
    want, floors = storage_floor(ref_fn, dout, q, k, v, out, **opts)
    lowp = reference(ref_fn, dout, q, k, v, upcast=False, **opts)
    for name, g, w, lp, floor in zip(("dq", "dk", "dv"), got, want, lowp, floors):
        assert g.shape == w.shape and g.dtype == q.dtype, name
        assert not g.isnan().any(), f"{name}: NaN (an unwritten element)"
        diff = (g.float() - w).abs()
        bar = 2 * (lp.float() - w).abs().max().item() + GRAD_FLOOR
        assert not (diff > bar + floor).any(), (f"{name}: max abs error {diff.max().item():.3e} > {bar:.3e} "
                                                f"(plus the storage's rounding, {floor.max().item():.3e} at most)")


def storage_floor(ref_fn, dout, q, k, v, out, **opts):
    """The float32 reference's gradients given `out` (`reference`'s stored_out) and, per
    gradient and element, the rounding a correct backward adds by storing it in the input
    dtype: half a step of the dtype at the float32 gradient (`one_step`), and with GQA, for dk
    and dv, half a step at each query head's gradient too, which the kernels (as flash-attn's)
    round to the dtype before summing the group (docs/semantics.md). With GQA the reference
    runs on k and v repeated per query head (as the reference repeats them itself), so one run
    gives both the query heads' gradients and, summed over each group, the kv heads'."""
    group = q.shape[-2] // k.shape[-2]
    if group == 1:
        want = reference(ref_fn, dout, q, k, v, stored_out=out, **opts)
        return want, [0.5 * one_step(w.to(q.dtype)) for w in want]
    dq, *per_head = reference(ref_fn, dout, q, k.repeat_interleave(group, -2), v.repeat_interleave(group, -2),
                              stored_out=out, **opts)
    by_group = [x.unflatten(-2, (k.shape[-2], group)) for x in per_head]  # (..., hk, group, d)
    want = [dq] + [x.sum(-2) for x in by_group]
    floors = [0.5 * one_step(w.to(q.dtype)) for w in want]
    for i, x in enumerate(by_group, 1):
        floors[i] = floors[i] + 0.5 * one_step(x.to(q.dtype)).sum(-2)
    return want, floors


def inputs(b, sq, sk, h, hk, d, dtype=torch.bfloat16, layout="bshd", d_v=None):
    """q, k, v and dout on the GPU (v and dout d_v wide where given); layout "bhsd": (b, h, s,
    d) storage viewed as (b, s, h, d)."""
    def make(s, heads, cols=d):
        if layout == "bhsd":
            return torch.randn(b, heads, s, cols, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, s, heads, cols, device="cuda", dtype=dtype)

    return make(sq, h), make(sk, hk), make(sk, hk, d_v or d), make(sq, h, d_v or d)


def check_score_modifiers(mod, sq, sk, hh, d, data):
    """Gradients with modifier `mod` (window, alibi, softcap or all; causal, the window's edges
    and the cap drawn from `data`) against the reference."""
    q, k, v, dout = inputs(2, sq, sk, *hh, d)
    opts = dict(causal=data.draw(st.booleans()))
    if mod in ("window", "all"):
        opts["window_size"] = (data.draw(st.integers(-1, 300)), data.draw(st.integers(-1, 60)))
    if mod in ("alibi", "all"):
        opts["alibi_slopes"] = torch.rand(2, hh[0], device="cuda", dtype=torch.float32)
    if mod in ("softcap", "all"):
        opts["softcap"] = data.draw(st.sampled_from([5.0, 30.0]))
    out, grads = ours(flash_attn_func, dout, q, k, v, **opts)
    assert_grads_match(grads, q, k, v, dout, out=out, **opts)


def packed_inputs(lq, lk, h, hk, d, dtype=torch.bfloat16, d_v=None):
    """q, k, v, dout of a packed batch of query lengths lq and key lengths lk (lists); v and
    dout d_v wide where given."""
    q, dout = (torch.randn(sum(lq), h, cols, device="cuda", dtype=dtype) for cols in (d, d_v or d))
    k, v = (torch.randn(sum(lk), hk, cols, device="cuda", dtype=dtype) for cols in (d, d_v or d))
    return q, k, v, dout


def check_varlen_grads(lens, hh, d, causal, used, d_v=None):
    """Packed gradients of sequences of (query, key) lengths `lens` (zeros allowed), seqused_k
    half of each key length when `used`, against the reference per sequence (v d_v wide where
    given)."""
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    h, hk = hh
    q, k, v, dout = packed_inputs(lq, lk, h, hk, d, d_v=d_v)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    seqused = torch.tensor([n // 2 for n in lk], device="cuda", dtype=torch.int32) if used else None
    out, grads = ours(lambda q, k, v, **o: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                                  seqused_k=seqused, **o), dout, q, k, v, causal=causal)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal, ref_fn=lambda q, k, v, **o: attention_varlen_ref(
        q, k, v, cu_q, cu_k, seqused_k=seqused, **o))


def check_varlen_score_modifiers(opts):
    """The packed backward with score modifiers `opts` (alibi=True: slopes per sequence and
    head), GQA, an empty sequence and seqused_k, against the reference."""
    lq, lk, h, hk, d = [0, 77, 300, 1], [40, 129, 257, 60], 6, 2, 64
    q, k, v, dout = packed_inputs(lq, lk, h, hk, d)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    seqused = torch.tensor([40, 100, 257, 1], device="cuda", dtype=torch.int32)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(len(lq), h, device="cuda", dtype=torch.float32)
    out, grads = ours(lambda q, k, v, **o: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                                  seqused_k=seqused, **o), dout, q, k, v, **opts)
    assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=lambda q, k, v, **o: attention_varlen_ref(
        q, k, v, cu_q, cu_k, seqused_k=seqused, **o), **opts)


def check_varlen_nan_stays_in_its_sequence():
    """NaN in the first rows of sequence 1's q, k, v and dout: sequence 0's last query block
    (70 rows) and key block (100 keys) reach into them, where P = 0 or dS = 0 must not meet a
    NaN. Sequence 0's gradients match its reference alone."""
    lq, lk, h, hk, d = [70, 30], [100, 60], 4, 2, 64
    q, k, v, dout = packed_inputs(lq, lk, h, hk, d)
    for x, start in ((q, lq[0]), (k, lk[0]), (v, lk[0]), (dout, lq[0])):
        x[start:start + 3] = float("nan")
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    a, b = lq[0], lk[0]
    for causal in (False, True):
        out, (dq, dk, dv) = ours(lambda q, k, v, **o: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                                             **o), dout, q, k, v, causal=causal)
        assert_grads_match((dq[None, :a], dk[None, :b], dv[None, :b]), q[None, :a], k[None, :b], v[None, :b],
                           dout[None, :a], out=out[None, :a], causal=causal)


VARLEN_MODS = [dict(window_size=(50, 9)), dict(alibi=True, causal=True), dict(softcap=8.0),
               dict(window_size=(30, 0), alibi=True, softcap=20.0)]
VARLEN_MOD_IDS = ["window", "alibi-causal", "softcap", "all"]
varlen_lengths = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=4).filter(
    lambda lens: sum(a for a, _ in lens) > 0 and sum(b for _, b in lens) > 0)


def check_dropout_grads(d, sq, sk, hh, opts, d_v=None):
    """dq, dk, dv of a dropout forward's backward (p 0.2, a fixed seed and offset) against the
    reference's autograd with the mask `philox.keep_mask` draws for that seed and offset: a
    wrong bit, word or partner in any element moves a gradient far past the rule (v d_v wide
    where given)."""
    import functools

    from cute_flash.launch.backward import flash_bwd
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.rng import DropoutArgs
    from layouts import philox

    p, seed, offset = 0.2, 0xC0FFEE_1234, 9
    drop = DropoutArgs.seeded(p, seed, offset, "cuda")
    q, k, v, dout = inputs(2, sq, sk, *hh, d, d_v=d_v)
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, dropout=drop, **opts)
    poison_allocator()
    dq, dk, dv, _ = flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, dropout=drop, **opts)
    torch.cuda.synchronize()
    mask = torch.from_numpy(philox.keep_mask(seed, offset, 2, hh[0], sq, sk, p)).cuda()
    assert_grads_match([dq, dk, dv], q, k, v, dout, out=out,
                       ref_fn=functools.partial(attention_ref, dropout_p=p, dropout_mask=mask), **opts)


def check_bitwise_repeatable(fn, dout, q, k, v, ref_fn=attention_ref, **opts):
    """Gradients through `fn` with deterministic=True: three runs equal bit for bit, and within
    the rule against `ref_fn` with `opts`."""
    out, grads = ours(fn, dout, q, k, v, deterministic=True, **opts)
    for _ in range(2):
        for a, b in zip(grads, ours(fn, dout, q, k, v, deterministic=True, **opts)[1]):
            assert torch.equal(a, b)
    assert_grads_match(grads, q, k, v, dout, out=out, ref_fn=ref_fn, **opts)


def check_varlen_bitwise_repeatable(d):
    """Packed batches at head dim d, deterministic, with a window: equal bit for bit over three
    runs, and the reference rule per sequence."""
    lq, lk = [1500, 3, 0, 700], [1700, 90, 20, 700]
    q, k, v, dout = packed_inputs(lq, lk, 8, 2, d)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    check_bitwise_repeatable(lambda q, k, v, **o: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **o),
                             dout, q, k, v, ref_fn=lambda q, k, v, **o: attention_varlen_ref(q, k, v, cu_q, cu_k, **o),
                             window_size=(500, 0))


def check_private_backward():
    """The private `_flash_attn_backward` writes the given dq, dk, dv and returns softmax_d (d 64)."""
    from cute_flash.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    q, k, v, dout = inputs(2, 130, 200, 4, 4, 64)
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    torch.testing.assert_close(softmax_d, (dout.float() * out.float()).sum(-1).transpose(1, 2), atol=1e-3, rtol=1e-3)
    assert_grads_match((dq, dk, dv), q, k, v, dout, out=out, softmax_scale=0.125, causal=True)
