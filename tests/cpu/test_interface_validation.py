"""The public API's argument checks and dispatch, on CPU (no GPU, no CuTe DSL needed).

Every rule but the CUDA one is checked before the device, so a CPU tensor that breaks a rule
raises that rule's error, and a fully valid CPU call raises the CUDA TypeError. Dispatch is
tested through one seam: `gpu_free` skips `_validate.check_cuda` and stands a recorder in
sys.modules["cute_flash.launch"] (tests/helpers/interface.py), so we can see exactly what would
reach the kernels.
"""

import inspect
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cute_flash
from cute_flash import _validate
from cute_flash import interface as fi
from tests.helpers.interface import (ALL, B, CACHE, D, FIRST, H, HALF_ARGS, HALF_CASES, HK, MAXBLOCKS, NBLOCKS, PAGE,
                                     SK, SQ, VARLEN, WITH_DROPOUT, call, i32, no_gpu_needed, rnd, valid, with_)

# --- signatures -----------------------------------------------------------------------------

_OPTS = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
         "alibi_slopes=None, deterministic=False, return_attn_probs=False")
FLASH_ATTN_2_8_3 = {  # flash_attn/flash_attn_interface.py at v2.8.3, plus our seqused_k
    "flash_attn_func": f"(q, k, v, {_OPTS})",
    "flash_attn_qkvpacked_func": f"(qkv, {_OPTS})",
    "flash_attn_kvpacked_func": f"(q, kv, {_OPTS})",
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                              f"{_OPTS}, block_table=None, *, seqused_k=None)",
    "flash_attn_varlen_qkvpacked_func": f"(qkv, cu_seqlens, max_seqlen, {_OPTS})",
    "flash_attn_varlen_kvpacked_func": "(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                       f"max_seqlen_k, {_OPTS})",
    "flash_attn_with_kvcache": "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, "
                               "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, "
                               "cache_leftpad=None, block_table=None, softmax_scale=None, "
                               "causal=False, window_size=(-1, -1), softcap=0.0, "
                               "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                               "return_softmax_lse=False)",
}


@pytest.mark.parametrize("fn", sorted(FLASH_ATTN_2_8_3))
def test_signatures_are_flash_attn_2_8_3(fn):
    """Names, order, kinds and defaults as flash-attn's (ours carry type hints, which it lacks),
    plus keyword-only additions after them: learnable_sink (flash-attn-4's) everywhere, the
    KV-cache call's packed queries (FA3's cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q), and
    flash-attn-4's score_mod, mask_mod, aux_tensors, score_mod_bwd on the two unpacked functions,
    and FlexAttention's block_mask on flash_attn_func."""
    sig = inspect.signature(getattr(fi, fn))
    additions = ["learnable_sink"] + (["cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q"]
                                      if fn == "flash_attn_with_kvcache" else [])
    if fn in ("flash_attn_func", "flash_attn_varlen_func"):
        additions += ["score_mod", "mask_mod", "aux_tensors", "score_mod_bwd"]
    if fn == "flash_attn_func":
        additions += ["block_mask"]
    assert list(sig.parameters)[-len(additions):] == additions
    for name in additions:
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and sig.parameters[name].default is None
    bare = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()
                                   if p.name not in additions], return_annotation=inspect.Signature.empty)
    assert str(bare) == FLASH_ATTN_2_8_3[fn]
    assert fn in fi.__all__


# --- device ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_valid_cpu_call_needs_cuda(name):
    match = (rf"^{FIRST[name]}\b.* must be CUDA"
             r" tensors, got device cpu")
    with pytest.raises(TypeError, match=match):
        call(name, **valid(name))


@pytest.mark.parametrize("name, arg", [(n, a) for n, a in HALF_CASES if a != FIRST[n]])
def test_device_mismatch(name, arg):
    args = valid(name)
    args[arg] = args[arg].to("meta")
    with pytest.raises(TypeError, match=rf"^{arg} must be on the same device as {FIRST[name]} "):
        call(name, **args)


@pytest.mark.parametrize("name, arg", [("varlen", "cu_seqlens_k"), ("varlen_paged", "seqused_k"),
                                       ("varlen_paged", "block_table"),
                                       ("kvcache", "cache_seqlens")])
def test_aux_tensor_device_mismatch(name, arg):
    args = valid(name)
    args[arg] = args[arg].to("meta")
    with pytest.raises(TypeError, match=rf"^{arg} must be on the same device as "):
        call(name, **args)


# --- dtype ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("name", ALL)
def test_reference_dtype_must_be_half(name, dtype):
    args = valid(name)
    first = FIRST[name]
    args[first] = args[first].to(dtype)
    with pytest.raises(TypeError, match=rf"^{first} must be float16 or bfloat16, got {dtype}"):
        call(name, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, arg", [(n, a) for n, a in HALF_CASES if a != FIRST[n]])
def test_dtypes_must_match(name, arg, dtype):
    args = valid(name)
    args[arg] = args[arg].to(dtype)
    with pytest.raises(TypeError, match=rf"^{arg} must have the same dtype as {FIRST[name]} "):
        call(name, **args)


@pytest.mark.parametrize("kind", ["list", "None"])
@pytest.mark.parametrize("name, arg", [(n, a) for n, a in HALF_CASES if a not in ("k", "v")
                                       or not n.startswith("kvcache")])
def test_non_tensor_refused(name, arg, kind):
    args = valid(name)
    args[arg] = args[arg].tolist() if kind == "list" else None
    with pytest.raises(TypeError, match=rf"^{arg} must be a torch.Tensor, got {kind}"):
        call(name, **args)


@pytest.mark.parametrize("arg", ["k", "v"])
def test_kvcache_new_kv_must_be_tensors(arg):
    with pytest.raises(TypeError, match=rf"^{arg} must be a torch.Tensor, got list"):
        call("kvcache", **with_("kvcache", **{arg: valid("kvcache")[arg].tolist()}))


def test_bfloat16_accepted():
    args = {k: t.bfloat16() for k, t in valid("func").items()}
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call("func", **args)


# --- shapes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, arg, shape, match", [
    ("func", "q", (B, SQ, H * D), r"^q must be 4-D \(batch, seqlen_q, nheads, headdim\)"),
    ("func", "k", (B, SK, HK, D, 1), r"^k must be 4-D \(batch, seqlen_k, nheads_k, headdim\)"),
    ("func", "v", (B, SK + 1, HK, D), r"^v must have the same shape as k"),
    ("func", "k v", (B + 1, SK, HK, D), r"^k must have the batch size of q \(2\), got 3"),
    ("qkvpacked", "qkv", (B, SQ, 2, H, D), r"^qkv must have shape \(batch, seqlen, 3, nheads"),
    ("qkvpacked", "qkv", (B, SQ, 3 * H, D), r"^qkv must have shape"),
    ("kvpacked", "kv", (B, SK, 3, HK, D), r"^kv must have shape \(batch, seqlen_k, 2, nheads_k"),
    ("kvpacked", "q", (B + 1, SQ, H, D), r"^kv must have the batch size of q"),
    ("varlen", "q", (B, 5, H, D), r"^q must be 3-D \(total_q, nheads, headdim\)"),
    ("varlen", "v", (6, HK, D), r"^v must have the same shape as k"),
    ("varlen_paged", "k", (7, HK, D), r"^k must be 4-D \(num_blocks, page_size, nheads_k"),
    ("varlen_qkvpacked", "qkv", (5, 2, H, D), r"^qkv must have shape \(total, 3, nheads"),
    ("varlen_kvpacked", "kv", (7, 3, HK, D), r"^kv must have shape \(total_k, 2, nheads_k"),
    ("kvcache", "q", (B, H, D), r"^q must be 4-D"),
    ("kvcache", "v_cache", (B, CACHE + 1, HK, D), r"^v_cache must have the same shape as k_cache"),
    ("kvcache", "k v", (B + 1, 1, HK, D), r"^k must have the batch size of q"),
    ("kvcache", "v", (B, 2, HK, D), r"^v must have the same shape as k"),
    ("kvcache", "k", (B, 1, HK, D, 1), r"^k must be 4-D \(batch, seqlen_new, nheads_k"),
])
def test_bad_shape(name, arg, shape, match):
    args = with_(name, **{a: rnd(*shape) for a in arg.split()})
    with pytest.raises(ValueError, match=match):
        call(name, **args)


@given(d=st.integers(257, 2048), name=st.sampled_from(ALL))
@settings(max_examples=30, deadline=None)
def test_head_dim_at_most_256(d, name):
    args = valid(name)
    for arg in HALF_ARGS[name]:
        args[arg] = rnd(*args[arg].shape[:-1], d)
    match = (rf"^{FIRST[name]} head dim must be"
             rf" between 1 and 256, got {d}")
    with pytest.raises(ValueError, match=match):
        call(name, **args)


@given(d=st.integers(1, 256).filter(lambda d: d != D),
       name=st.sampled_from([n for n in ALL if len(HALF_ARGS[n]) > 1]))
@settings(max_examples=30, deadline=None)
def test_head_dims_must_match(d, name):
    """q and k (or kv, k_cache) share one head dim; v's may differ where the call allows it
    (tests/cpu/test_value_head_dim.py)."""
    args = valid(name)
    arg = HALF_ARGS[name][1]
    args[arg] = rnd(*args[arg].shape[:-1], d)
    match = (rf"^{arg} head dim must equal the head dim of"
             rf" {FIRST[name]} \({D}\), got {d}")
    with pytest.raises(ValueError, match=match):
        call(name, **args)


def test_head_dim_zero():
    args = {k: rnd(*t.shape[:-1], 0) for k, t in valid("func").items()}
    with pytest.raises(ValueError, match=r"^q head dim must be between 1 and 256, got 0"):
        call("func", **args)


# --- GQA ------------------------------------------------------------------------------------


def _with_heads(name, nheads, nheads_k):
    args = valid(name)
    for arg in HALF_ARGS[name]:
        t = args[arg]
        heads = nheads if arg in ("q", "qkv") else nheads_k
        args[arg] = rnd(*t.shape[:-2], heads, 8)
    return args


@given(nheads=st.integers(1, 48), nheads_k=st.integers(1, 48),
       name=st.sampled_from(["func", "kvpacked", "varlen", "varlen_paged", "varlen_kvpacked",
                             "kvcache", "kvcache_paged"]))
@settings(max_examples=60, deadline=None)
def test_nheads_multiple_of_nheads_k(nheads, nheads_k, name):
    args = _with_heads(name, nheads, nheads_k)
    if nheads % nheads_k == 0:
        with pytest.raises(TypeError, match="must be CUDA tensors"):
            call(name, **args)
    else:
        match = (rf"^nheads of q \({nheads}\) must be a multiple of"
                 rf" nheads_k of \w+ \({nheads_k}\)")
        with pytest.raises(ValueError, match=match):
            call(name, **args)


@pytest.mark.parametrize("nheads, nheads_k", [(0, 1), (2, 0), (0, 0)])
def test_at_least_one_head(nheads, nheads_k):
    with pytest.raises(ValueError, match=r"^q and k must have at least one head"):
        call("func", **_with_heads("func", nheads, nheads_k))


# --- strides and alignment ------------------------------------------------------------------


CACHE_CASES = [(n, a) for n in ("kvcache", "kvcache_paged") for a in ("k_cache", "v_cache")]
COPYABLE_CASES = [(n, a) for n, a in HALF_CASES if (n, a) not in CACHE_CASES]


@pytest.mark.parametrize("name, arg", CACHE_CASES)
def test_cache_last_dim_must_be_contiguous(name, arg):
    """The caches are appended to in place, so a layout the kernel cannot use is an error."""
    args = valid(name)
    t = args[arg]
    args[arg] = rnd(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]
    match = (rf"^{arg} must have a contiguous last dimension"
             r" \(stride 1\), got stride 2")
    with pytest.raises(ValueError, match=match):
        call(name, **args)


@pytest.mark.parametrize("how", ["contiguous_d59", "rows_of_20", "misaligned_pointer"])
@pytest.mark.parametrize("name, arg", CACHE_CASES)
def test_unaligned_caches_are_accepted(name, arg, how):
    """Caches whose rows break 128-bit copies (a head dim not a multiple of 8, strides or a
    base address off 16 bytes) are not refused: the launcher works on aligned copies and copies
    the appended rows back, as flash-attn does."""
    args = valid(name)
    t = args[arg]
    if how == "misaligned_pointer":
        args[arg] = rnd(t.numel() + 8)[1 : t.numel() + 1].view(t.shape)
    else:
        d = 59 if how == "contiguous_d59" else 20
        for a in HALF_ARGS[name]:
            args[a] = rnd(*args[a].shape[:-1], d)
        if how == "rows_of_20":
            args[arg] = rnd(*t.shape[:-1], 24)[..., :20]
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call(name, **args)
    with no_gpu_needed() as fake:
        call(name, **args)
    (_, passed, _), = fake.calls
    assert passed[HALF_ARGS[name].index(arg)] is args[arg]  # the caller's cache, as given


@pytest.mark.parametrize("how", ["last_dim_stride_2", "rows_of_20", "misaligned_pointer"])
@pytest.mark.parametrize("name, arg", COPYABLE_CASES)
def test_copyable_layouts_are_accepted(name, arg, how):
    """q/k/v that break the kernel's 128-bit copies are not refused: the launcher pads or copies
    them (as flash-attn does), so validation lets them through to the device check."""
    args = valid(name)
    t = args[arg]
    if how == "last_dim_stride_2":
        args[arg] = rnd(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]
    elif how == "rows_of_20":
        for a in HALF_ARGS[name]:
            args[a] = rnd(*args[a].shape[:-1], 20)
        for a in ("k_cache", "v_cache"):
            if a in args:
                args[a] = rnd(*args[a].shape[:-1], 24)[..., :20]
    else:
        args[arg] = rnd(t.numel() + 8)[1 : t.numel() + 1].view(t.shape)
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call(name, **args)


@pytest.mark.parametrize("layout", ["padded_head_dim", "bhsd_transposed", "size1_odd_stride"])
def test_in_place_layouts_accepted(layout):
    """Layouts read in place rather than refused: a head dim of 20 inside rows of 24,
    (b, h, s, d) storage seen as (b, s, h, d), and a size-1 batch whose stride is never used."""
    q, k, v = rnd(B, SQ, H, 24)[..., :20], rnd(B, SK, HK, 32)[..., :20], rnd(B, SK, HK, 24)
    v = v[..., :20]
    if layout == "bhsd_transposed":
        q, k = rnd(B, H, SQ, D).transpose(1, 2), rnd(B, HK, SK, D).transpose(1, 2)
        v = rnd(B, SK, HK, D)
    if layout == "size1_odd_stride":
        q = torch.empty_strided((1, SQ, H, D), (3, H * D, D, 1), dtype=torch.float16)
        k, v = rnd(1, SK, HK, D), rnd(1, SK, HK, D)
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        fi.flash_attn_func(q, k, v)


# --- options --------------------------------------------------------------------------------


@given(left=st.integers(-(2**31), 2**31), right=st.integers(-(2**31), 2**31),
       name=st.sampled_from(ALL))
@settings(max_examples=60, deadline=None)
def test_window_sizes_at_least_minus_one(left, right, name):
    args = with_(name, window_size=(left, right))
    if left >= -1 and right >= -1:
        with pytest.raises(TypeError, match="must be CUDA tensors"):
            call(name, **args)
    else:
        match = (r"^window_size must be a pair \(left,"
                 r" right\) of ints >= -1")
        with pytest.raises(ValueError, match=match):
            call(name, **args)


@pytest.mark.parametrize("window_size",
                         [(1.5, 2), (True, -1), (1, False), (1, 2, 3), (4,), None, "ab", (None, 1),
                          torch.tensor([1.0, 2.0]), torch.tensor([True, False]), (torch.tensor(1.0), 2),
                          torch.tensor([1, 2, 3]), torch.tensor(3), (np.bool_(True), 1), (np.float32(2), 1),
                          (torch.tensor([1, 2]), 1)])
@pytest.mark.parametrize("name", ["func", "varlen", "kvcache"])
def test_window_size_must_be_int_pair(name, window_size):
    with pytest.raises(ValueError, match=r"^window_size must be a pair"):
        call(name, **with_(name, window_size=window_size))


INT_LIKE_WINDOWS = [
    ((np.int64(3), np.int32(-1)), (3, -1)),
    ((torch.tensor(5), torch.tensor(0)), (5, 0)),
    (torch.tensor([4, 2]), (4, 2)),
    (torch.tensor([4, 2], dtype=torch.int32), (4, 2)),
    ([2, 1], (2, 1)),
    (np.array([6, -1]), (6, -1)),
]


@pytest.mark.parametrize("window_size, expected", INT_LIKE_WINDOWS)
@pytest.mark.parametrize("name", ALL)
def test_int_like_window_sizes_reach_the_kernels_as_ints(gpu_free, name, window_size, expected):
    """flash-attn's tests pass window_size=torch.randint(0, seqlen_k, (2,)); any pair whose
    items convert with operator.index is taken, and dispatched as the same pair of Python ints."""
    call(name, **with_(name, window_size=window_size))
    call(name, **with_(name, window_size=expected))
    (_, _, int_like), (_, _, plain) = gpu_free.calls
    options = [{k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)} for kw in (int_like, plain)]
    assert options[0] == options[1]
    assert all(type(w) is int for w in int_like["window_size"])


def test_window_size_from_torch_randint_like_flash_attn_tests(gpu_free):
    window = torch.randint(0, SK, (2,))
    call("func", **with_("func", window_size=window))
    call("func", **with_("func", window_size=tuple(window.tolist())))
    (_, _, int_like), (_, _, plain) = gpu_free.calls
    assert int_like == plain


@pytest.mark.parametrize("softcap", [-0.5, -1e-30, math.inf, math.nan, "1", None])
@pytest.mark.parametrize("name", ALL)
def test_softcap_non_negative(name, softcap):
    with pytest.raises(ValueError, match=r"^softcap must be a finite float >= 0"):
        call(name, **with_(name, softcap=softcap))


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, "x", [0.5]])
@pytest.mark.parametrize("name", ALL)
def test_softmax_scale_finite(name, scale):
    """Zero and negative scales are computed (launch/args.py:positive_scale); a scale with no
    value is refused."""
    with pytest.raises(ValueError, match=r"^softmax_scale must be a finite float or None"):
        call(name, **with_(name, softmax_scale=scale))


@pytest.mark.parametrize("name", WITH_DROPOUT)
@given(p=st.floats(1.0 - 2.0 ** -15, 1.0, exclude_min=True, exclude_max=True))
@settings(max_examples=5, deadline=None)
def test_dropout_that_keeps_nothing_at_14_bits_refused(name, p):
    """Above 1 - 2^-15 the 14-bit keep threshold rounds to 0: nothing would be kept, and 1 / P(keep)
    would be infinite."""
    with pytest.raises(ValueError, match=r"^dropout_p must be at most 1 - 2\^-15"):
        call(name, **with_(name, dropout_p=p))


@pytest.mark.parametrize("p", [-0.1, 1.0, 2.0, math.nan, None, True])
@pytest.mark.parametrize("name", WITH_DROPOUT)
def test_dropout_out_of_range(name, p):
    with pytest.raises(ValueError, match=r"^dropout_p must be a float in \[0, 1\)"):
        call(name, **with_(name, dropout_p=p))


# --- ALiBi ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ALL)
def test_alibi_must_be_fp32(name, dtype):
    match = (rf"^alibi_slopes must have dtype"
             rf" torch.float32, got {dtype}")
    with pytest.raises(TypeError, match=match):
        call(name, **with_(name, alibi_slopes=torch.rand(H).to(dtype)))


@pytest.mark.parametrize("shape", [(H + 1,), (B + 1, H), (B, H, 1), (), (1, H)])
@pytest.mark.parametrize("name", ALL)
def test_alibi_shape(name, shape):
    match = (rf"^alibi_slopes must have shape"
             rf" \({H},\) or \({B}, {H}\)")
    with pytest.raises(ValueError, match=match):
        call(name, **with_(name, alibi_slopes=torch.rand(shape)))


@pytest.mark.parametrize("shape", [(H,), (B, H)])
@pytest.mark.parametrize("name", ALL)
def test_alibi_accepted(name, shape):
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call(name, **with_(name, alibi_slopes=torch.rand(shape)))


def test_alibi_last_dim_contiguous():
    with pytest.raises(ValueError, match=r"^alibi_slopes must have a contiguous last dimension"):
        call("func", **with_("func", alibi_slopes=torch.rand(B, 2 * H)[:, ::2]))


def test_alibi_not_a_tensor():
    with pytest.raises(TypeError, match=r"^alibi_slopes must be a torch.Tensor"):
        call("func", **with_("func", alibi_slopes=[0.5] * H))


# --- varlen: cu_seqlens, max_seqlen, seqused_k, block_table ---------------------------------


def _cu_names(name):
    if name == "varlen_qkvpacked":
        return "cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen"
    return "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32, torch.uint32])
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("name", VARLEN)
def test_cu_seqlens_must_be_int32(name, which, dtype):
    arg = _cu_names(name)[which]
    args = valid(name)
    args[arg] = args[arg].to(dtype)
    with pytest.raises(TypeError, match=rf"^{arg} must have dtype torch.int32, got {dtype}"):
        call(name, **args)


@pytest.mark.parametrize("name", VARLEN)
def test_cu_seqlens_shapes(name):
    cu_q, cu_k, _, _ = _cu_names(name)
    with pytest.raises(ValueError, match=rf"^{cu_q} must be 1-D of length batch \+ 1"):
        call(name, **with_(name, **{cu_q: i32(0, 3, 5).view(1, 3)}))
    with pytest.raises(ValueError, match=rf"^{cu_q} must be 1-D of length batch \+ 1"):
        call(name, **with_(name, **{cu_q: i32()}))
    with pytest.raises(ValueError, match=rf"^{cu_q} must be contiguous"):
        call(name, **with_(name, **{cu_q: i32(0, 9, 3, 9, 5, 9)[::2]}))
    if cu_k != cu_q:
        with pytest.raises(ValueError, match=rf"^{cu_k} must have shape \(3,\), got \(4,\)"):
            call(name, **with_(name, **{cu_k: i32(0, 4, 6, 7)}))


@pytest.mark.parametrize("value", [-1, 2.0, None, True, "3"])
@pytest.mark.parametrize("which", [2, 3])
@pytest.mark.parametrize("name", VARLEN)
def test_max_seqlen_non_negative_int(name, which, value):
    arg = _cu_names(name)[which]
    with pytest.raises(ValueError, match=rf"^{arg} must be an int >= 0"):
        call(name, **with_(name, **{arg: value}))


def test_seqused_k_rules():
    with pytest.raises(TypeError, match=r"^seqused_k must have dtype torch.int32, got torch.int64"):
        call("varlen", **with_("varlen", seqused_k=torch.tensor([3, 4])))
    with pytest.raises(ValueError, match=r"^seqused_k must have shape \(2,\), got \(3,\)"):
        call("varlen", **with_("varlen", seqused_k=i32(1, 2, 3)))
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call("varlen", **with_("varlen", seqused_k=i32(1, 2)))


def test_seqused_k_is_keyword_only():
    args = valid("varlen")
    positional = [args[a] for a in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                    "max_seqlen_q", "max_seqlen_k")]
    with pytest.raises(TypeError, match="positional argument"):
        fi.flash_attn_varlen_func(*positional, 0.0, None, False, (-1, -1), 0.0, None, False,
                                  False, None, i32(1, 2))


@pytest.mark.parametrize("name", ["varlen_paged", "kvcache_paged"])
def test_block_table_rules(name):
    bt = valid(name)["block_table"]
    match = (r"^block_table must have dtype"
             r" torch.int32, got torch.int64")
    with pytest.raises(TypeError, match=match):
        call(name, **with_(name, block_table=bt.long()))
    for bad in (bt[:1], bt.view(-1), bt.view(B, MAXBLOCKS, 1)):
        with pytest.raises(ValueError, match=rf"^block_table must have shape \({B}, max_blocks\)"):
            call(name, **with_(name, block_table=bad))
    with pytest.raises(ValueError, match=r"^block_table must have a contiguous last dimension"):
        call(name, **with_(name, block_table=i32(*range(8)).view(B, 4)[:, ::2]))


@pytest.mark.parametrize("name", ["varlen_paged", "kvcache_paged"])
def test_page_size_at_least_one(name):
    args = valid(name)
    cache = ("k", "v") if name == "varlen_paged" else ("k_cache", "v_cache")
    for a in cache:
        args[a] = rnd(NBLOCKS, 0, HK, D)
    with pytest.raises(ValueError, match=rf"^{cache[0]} page size \(dim 1\) must be at least 1, got 0"):
        call(name, **args)


@pytest.mark.parametrize("page", [1, 8, 16, 24, 48, 100, 255, 256, 1000])
@pytest.mark.parametrize("name", ["varlen_paged", "kvcache_paged"])
def test_page_sizes_accepted(name, page):
    args = valid(name)
    cache = ("k", "v") if name == "varlen_paged" else ("k_cache", "v_cache")
    for a in cache:
        args[a] = rnd(NBLOCKS, page, HK, D)
    if name == "kvcache_paged":  # the table must address the longest sequence (see below)
        args["block_table"] = i32(*range(B * 2 * (1 + 20 // page))).view(B, -1) % NBLOCKS
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call(name, **args)


# flash-attn's host guard: a block table too short for cache_seqlens (+ the appended rows).
@pytest.mark.parametrize("seqlens, append", [(i32(3, 2 * PAGE + 1), False), (i32(3, 2 * PAGE), True),
                                              (2 * PAGE, True), (2 * PAGE + 5, False)])
def test_block_table_too_short_raises_runtime_error(gpu_free, seqlens, append):
    args = with_("kvcache_paged", cache_seqlens=seqlens)
    if not append:
        args.update(k=None, v=None)
    longest = (seqlens if isinstance(seqlens, int) else int(seqlens.max())) + append
    plus = r" \+ seqlen_new" if append else ""
    match = (rf"^paged KV cache: max\(cache_seqlens\){plus} \(= {longest}\) "
             rf"exceeds what block_table addresses \(max_blocks {MAXBLOCKS} \* page_size {PAGE} = {2 * PAGE}\)")
    with pytest.raises(RuntimeError, match=match):
        call("kvcache_paged", **args)
    assert gpu_free.calls == []


@pytest.mark.parametrize("seqlens, append", [(i32(3, 2 * PAGE), False), (i32(0, 2 * PAGE - 1), True),
                                              (2 * PAGE - 1, True)])
def test_block_table_just_long_enough(gpu_free, seqlens, append):
    args = with_("kvcache_paged", cache_seqlens=seqlens)
    if not append:
        args.update(k=None, v=None)
    call("kvcache_paged", **args)
    assert len(gpu_free.calls) == 1


# --- kv cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("over, error, match", [
    (dict(cache_seqlens=torch.tensor([3, 5])), TypeError,
     r"^cache_seqlens must have dtype torch.int32"),
    (dict(cache_seqlens=i32(3, 5, 7)), ValueError,
     r"^cache_seqlens must have shape \(2,\), got \(3,\)"),
    (dict(cache_seqlens=i32(3, 5).view(2, 1)), ValueError,
     r"^cache_seqlens must have shape \(2,\)"),
    (dict(cache_seqlens=3.0), TypeError,
     r"^cache_seqlens must be an int or an int32 tensor, got float"),
    (dict(cache_seqlens=CACHE), ValueError, r"^cache_seqlens must be in \[0, 15\]"),
    (dict(cache_seqlens=-1), ValueError, r"^cache_seqlens must be in \[0, 15\]"),
    (dict(cache_seqlens=None), ValueError, r"^cache_seqlens must be given with k and v"),
    (dict(v=None), ValueError, r"^k and v must be given together"),
    (dict(k=None), ValueError, r"^k and v must be given together"),
    (dict(k=rnd(B, 1, HK * 2, D), v=rnd(B, 1, HK * 2, D)), ValueError,
     r"^k must have the nheads_k of k_cache \(2\), got 4"),
    (dict(k=rnd(B, CACHE + 1, HK, D), v=rnd(B, CACHE + 1, HK, D)), ValueError,
     r"^k must fit in the cache: seqlen_new \(17\)"),
    (dict(cache_batch_idx=torch.tensor([1, 0])), TypeError,
     r"^cache_batch_idx must have dtype torch.int32"),
    (dict(cache_batch_idx=i32(1)), ValueError,
     r"^cache_batch_idx must have shape \(2,\), got \(1,\)"),
    (dict(cache_leftpad=torch.tensor([0, 1], dtype=torch.int16)), TypeError,
     r"^cache_leftpad must have dtype torch.int32"),
    (dict(cache_leftpad=i32(0, 1, 2)), ValueError, r"^cache_leftpad must have shape \(2,\)"),
    (dict(k_cache=rnd(1, CACHE, HK, D), v_cache=rnd(1, CACHE, HK, D)), ValueError,
     r"^k_cache must hold at least batch \(2\) sequences"),
    (dict(num_splits=-1), ValueError, r"^num_splits must be an int >= 0"),
    (dict(q=rnd(B, CACHE + 1, H, D)), ValueError,
     r"^q seqlen_q \(17\) must be at most the cache length \(16\) when k"),
    (dict(num_splits=1.5), ValueError, r"^num_splits must be an int >= 0"),
])
def test_kvcache_args(over, error, match):
    with pytest.raises(error, match=match):
        call("kvcache", **with_("kvcache", **over))


@pytest.mark.parametrize("over", [
    dict(k_cache=rnd(1, CACHE, HK, D), v_cache=rnd(1, CACHE, HK, D), cache_batch_idx=i32(0, 0)),
    dict(cache_seqlens=CACHE - 1), dict(cache_seqlens=0), dict(k=None, v=None),
    dict(k=None, v=None, cache_seqlens=None), dict(cache_leftpad=i32(0, 2)), dict(num_splits=4),
])
def test_kvcache_args_accepted(over):
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call("kvcache", **with_("kvcache", **over))


@pytest.mark.parametrize("arg", ["cache_batch_idx", "cache_leftpad"])
def test_paged_kvcache_refuses_batch_idx_and_leftpad(arg):
    with pytest.raises(ValueError, match=rf"^{arg} is not supported with a paged KV cache"):
        call("kvcache_paged", **with_("kvcache_paged", **{arg: i32(0, 1)}))


def _rotary(rows=CACHE, half=D // 4, dtype=torch.float16):
    return dict(rotary_cos=rnd(rows, half, dtype=dtype), rotary_sin=rnd(rows, half, dtype=dtype))


@pytest.mark.parametrize("over, error, match", [
    (_rotary(dtype=torch.float32), TypeError,
     r"^rotary_cos must have dtype torch.float16, got torch.float32"),
    ({**_rotary(), "rotary_sin": rnd(CACHE, D // 4, dtype=torch.bfloat16)}, TypeError,
     r"^rotary_sin must have dtype torch.float16"),
    ({**_rotary(), "rotary_sin": None}, ValueError,
     r"^rotary_cos and rotary_sin must be given together"),
    ({**_rotary(), "rotary_cos": None}, ValueError,
     r"^rotary_cos and rotary_sin must be given together"),
    ({**_rotary(), "k": None, "v": None}, ValueError,
     r"^rotary_cos and rotary_sin rotate the appended keys"),
    (_rotary(half=D // 2 + 1), ValueError,
     rf"^rotary_cos rotary_dim \(2 \* {D // 2 + 1}\) must be at most the head dim \({D}\)"),
    ({**_rotary(), "rotary_sin": rnd(CACHE, D // 8)}, ValueError,
     r"^rotary_sin must have the shape of rotary_cos"),
    ({"rotary_cos": rnd(CACHE * D // 4), "rotary_sin": rnd(CACHE * D // 4)}, ValueError,
     r"^rotary_cos must be 2-D \(seqlen_ro, rotary_dim / 2\)"),
    (_rotary(rows=CACHE - 1), ValueError,
     r"^rotary_cos must have a row per cache position: seqlen_ro \(15\)"),
    ({**_rotary(), "rotary_cos": rnd(D // 4, CACHE).t()}, ValueError,
     r"^rotary_cos must be contiguous"),
    ({**_rotary(), "rotary_cos": [[1.0]]}, TypeError, r"^rotary_cos must be a torch.Tensor"),
])
def test_rotary_args(over, error, match):
    with pytest.raises(error, match=match):
        call("kvcache", **with_("kvcache", **over))


@pytest.mark.parametrize("half", [1, 3, D // 4, D // 2])
def test_rotary_dims_accepted(half):
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        call("kvcache", **with_("kvcache", **_rotary(rows=CACHE + 3, half=half)))


# --- nothing is written before the checks pass ----------------------------------------------


def _bytes(t):
    return t.view(torch.int16).clone()


@pytest.mark.parametrize("over", [
    dict(),  # valid: refused for want of CUDA
    dict(window_size=(-2, 0)),
    dict(softcap=-1.0),
    dict(alibi_slopes=torch.rand(H, dtype=torch.float16)),
    dict(cache_seqlens=i32(1, 2, 3)),
    dict(num_splits=-1),
    dict(k=rnd(B, 1, HK, D).float()),
    _rotary(dtype=torch.float32),
    _rotary(rows=2),
])
@pytest.mark.parametrize("name", ["kvcache", "kvcache_paged"])
def test_refused_kvcache_call_writes_nothing(name, over):
    args = with_(name, **over)
    before = {a: _bytes(t) for a, t in args.items()
              if isinstance(t, torch.Tensor) and t.element_size() == 2}
    with pytest.raises((TypeError, ValueError)):
        call(name, **args)
    for a, b in before.items():
        assert torch.equal(_bytes(args[a]), b), f"{a} was written by a refused call"


@pytest.mark.parametrize("name", ALL)
def test_refused_call_never_reaches_the_kernels(name):
    """Even with the kernels importable, a bad call stops in validation."""
    with no_gpu_needed() as fake:
        with pytest.raises(ValueError):
            call(name, **with_(name, window_size=(-5, -5)))
        with pytest.raises(TypeError):
            args = valid(name)
            args[FIRST[name]] = args[FIRST[name]].float()
            call(name, **args)
    assert fake.calls == []


# --- dispatch -------------------------------------------------------------------------------


def test_dense_dispatch_passes_inputs_and_defaults(gpu_free):
    args = valid("func")
    out = call("func", **args)
    [(fn, (q, k, v), kw)] = gpu_free.calls
    assert fn == "flash_fwd"
    assert q is args["q"] and k is args["k"] and v is args["v"]
    assert kw == dict(softmax_scale=D ** -0.5, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout=None, mods=None, block_mask=None,
                      learnable_sink=None)
    assert out.shape == args["q"].shape and bool((out == 7).all())


def test_dense_dispatch_passes_options(gpu_free):
    alibi = torch.rand(B, H)
    out, lse, probs = call("func", **with_("func", softmax_scale=0.25, softcap=30,
                                           alibi_slopes=alibi, window_size=(3, 1),
                                           return_attn_probs=True, deterministic=True))
    [(_, _, kw)] = gpu_free.calls
    assert kw["softmax_scale"] == 0.25 and kw["softcap"] == 30.0 and kw["alibi_slopes"] is alibi
    assert kw["window_size"] == (3, 1) and kw["causal"] is False
    assert isinstance(kw["softcap"], float)
    assert out.shape == (B, SQ, H, D) and lse.shape == (B, H, SQ)
    assert probs.shape == (0,) and probs.dtype == torch.float16  # flash-attn's S_dmask without dropout


@pytest.mark.parametrize("causal, window, sq, sk, expected", [
    (True, (-1, -1), 5, 7, (True, (-1, 0))),
    (True, (3, 2), 5, 7, (True, (3, 0))),
    (True, (7, -1), 5, 7, (True, (-1, 0))),
    (False, (7, 9), 5, 7, (False, (-1, -1))),
    (False, (6, 6), 5, 7, (False, (6, 6))),
    (False, (0, 0), 5, 7, (False, (0, 0))),
    (True, (2, -1), 1, 7, (False, (2, -1))),
    (True, (-1, -1), 1, 7, (False, (-1, -1))),
    (True, (-1, -1), 9, 3, (True, (-1, 0))),
    (False, (-1, 7), 20, 5, (False, (-1, 7))),  # right >= seqlen_k still masks early rows
    (False, (-1, 19), 20, 5, (False, (-1, -1))),
    (False, (5, 7), 20, 5, (False, (-1, 7))),
])
def test_mask_normalisation(gpu_free, causal, window, sq, sk, expected):
    call("func", q=rnd(B, sq, H, D), k=rnd(B, sk, HK, D), v=rnd(B, sk, HK, D), causal=causal,
         window_size=window)
    [(_, _, kw)] = gpu_free.calls
    assert (kw["causal"], kw["window_size"]) == expected


@given(causal=st.booleans(), left=st.integers(-1, 40), right=st.integers(-1, 40),
       sq=st.integers(1, 20), sk=st.integers(1, 20))
@settings(max_examples=100, deadline=None)
def test_mask_normalisation_invariants(causal, left, right, sq, sk):
    """What the kernel sees is canonical and masks the same keys as what the caller asked."""
    with no_gpu_needed() as fake:
        call("func", q=rnd(1, sq, 1, 8), k=rnd(1, sk, 1, 8), v=rnd(1, sk, 1, 8), causal=causal,
             window_size=(left, right))
    [(_, _, kw)] = fake.calls
    c, (l, r) = kw["causal"], kw["window_size"]
    assert all(isinstance(x, int) for x in (l, r)) and isinstance(c, bool)
    assert -1 <= l < sk and -1 <= r and (r < sk or r < sq - 1)
    if c:
        assert r == 0

    def visible(causal, left, right):
        def ok(i, j):
            d = i + sk - sq
            return ((left < 0 or j >= d - left) and (right < 0 or j <= d + right)
                    and (not causal or j <= d))
        return [[ok(i, j) for j in range(sk)] for i in range(sq)]

    assert visible(c, l, r) == visible(causal, left, right)


def _views_of(t, packed, dim):
    return all(
        v.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
        and v.data_ptr() == packed.select(dim, i).data_ptr()
        and v.stride() == packed.select(dim, i).stride()
        for i, v in enumerate(t)
    )


@pytest.mark.parametrize("transposed", [False, True])
def test_qkvpacked_dispatches_views(gpu_free, transposed):
    qkv = rnd(B, SQ, 3, H, D)
    if transposed:  # (b, 3, h, s, d) storage viewed as (b, s, 3, h, d)
        qkv = rnd(B, 3, H, SQ, D).permute(0, 3, 1, 2, 4)
    call("qkvpacked", qkv=qkv, causal=True)
    [(fn, qkv_args, kw)] = gpu_free.calls
    assert fn == "flash_fwd" and _views_of(qkv_args, qkv, 2)
    assert kw["softmax_scale"] == D ** -0.5 and kw["window_size"] == (-1, 0) and kw["causal"]


def test_kvpacked_dispatches_views(gpu_free):
    q, kv = rnd(B, SQ, H, D), rnd(B, SK, 2, HK, D)
    call("kvpacked", q=q, kv=kv)
    [(_, (q_arg, *kv_args), _)] = gpu_free.calls
    assert q_arg is q and _views_of(kv_args, kv, 2)


def test_varlen_qkvpacked_dispatches_views(gpu_free):
    args = valid("varlen_qkvpacked")
    out, lse, probs = call("varlen_qkvpacked", **args, return_attn_probs=True)
    [(fn, qkv_args, kw)] = gpu_free.calls
    assert fn == "flash_fwd_varlen" and _views_of(qkv_args, args["qkv"], 1)
    assert kw["cu_seqlens_q"] is args["cu_seqlens"] and kw["cu_seqlens_k"] is args["cu_seqlens"]
    assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 3
    assert out.shape == (5, H, D) and lse.shape == (H, 5) and probs.shape == (0,)


def test_varlen_kvpacked_dispatches_views(gpu_free):
    args = valid("varlen_kvpacked")
    call("varlen_kvpacked", **args)
    [(_, (q_arg, *kv_args), _)] = gpu_free.calls
    assert q_arg is args["q"] and _views_of(kv_args, args["kv"], 1)


@pytest.mark.parametrize("name", ["varlen", "varlen_paged"])
def test_varlen_dispatch_keywords(gpu_free, name):
    args = valid(name)
    out = call(name, **args, causal=True, window_size=(25, 3), softcap=5.0)
    [(fn, (q, k, v), kw)] = gpu_free.calls
    assert fn == "flash_fwd_varlen" and q is args["q"] and k is args["k"] and v is args["v"]
    left = 25 if args["max_seqlen_k"] > 25 else -1
    assert kw == dict(
        cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=args["cu_seqlens_k"],
        max_seqlen_q=3, max_seqlen_k=args["max_seqlen_k"], softmax_scale=D ** -0.5, causal=True,
        window_size=(left, 0), softcap=5.0, alibi_slopes=None,
        block_table=args.get("block_table"), seqused_k=args.get("seqused_k"), dropout=None, mods=None,
        learnable_sink=None,
    )
    for key in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k"):
        assert kw[key] is args.get(key)
    assert out.shape == args["q"].shape


@pytest.mark.parametrize("name", ["kvcache", "kvcache_paged"])
def test_kvcache_dispatch_keywords(gpu_free, name):
    args = with_(name, **_rotary(rows=40))
    alibi = torch.rand(H)
    out, lse = call(name, **args, softmax_scale=0.5, causal=True, window_size=(100, -1),
                    rotary_interleaved=False, alibi_slopes=alibi, num_splits=3,
                    return_softmax_lse=True)
    [(fn, (q, kc, vc), kw)] = gpu_free.calls
    assert fn == "flash_fwd_kvcache" and q is args["q"]
    assert kc is args["k_cache"] and vc is args["v_cache"]
    assert kw.pop("signature") == _validate.signature(
        q, kc, vc, args["k"], args["v"], args["rotary_cos"], args["rotary_sin"], args["cache_seqlens"],
        None, None, args.get("block_table"), 0.5, True, (100, -1), 0.0, False, alibi, 3, None)
    assert kw == dict(
        k=args["k"], v=args["v"], rotary_cos=args["rotary_cos"], rotary_sin=args["rotary_sin"],
        cache_seqlens=args["cache_seqlens"], cache_batch_idx=None, cache_leftpad=None,
        block_table=args.get("block_table"), softmax_scale=0.5, causal=False,  # seqlen_q == 1
        window_size=(-1, -1), softcap=0.0, rotary_interleaved=False, alibi_slopes=alibi,
        num_splits=3, return_lse=True, learnable_sink=None, folded_q=False,
    )
    for key in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "block_table"):
        assert kw[key] is args.get(key)
    assert out.shape == (B, 1, H, D) and lse.shape == (B, H, 1)


def test_kvcache_dispatch_causal_prefill(gpu_free):
    """seqlen_q > 1 keeps causal; the window is clamped against the cache length."""
    q = rnd(B, 3, H, D)
    k = rnd(B, 3, HK, D)
    out = call("kvcache", **with_("kvcache", q=q, k=k, v=k.clone(), cache_seqlens=4),
               causal=True, window_size=(8, 8))
    [(_, _, kw)] = gpu_free.calls
    assert kw["causal"] is True and kw["window_size"] == (8, 0) and kw["cache_seqlens"] == 4
    assert out.shape == q.shape


# --- empty problems: answered without a launch ----------------------------------------------


@pytest.mark.parametrize("b, sq, sk", [(0, SQ, SK), (B, 0, SK), (0, 0, 0), (B, 0, 0)])
def test_dense_empty_query(gpu_free, b, sq, sk):
    q = rnd(b, sq, H, D)
    out, lse, _ = call("func", q=q, k=rnd(b, sk, HK, D), v=rnd(b, sk, HK, D),
                       return_attn_probs=True)
    assert gpu_free.calls == []
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, H, sq) and lse.dtype == torch.float32


@pytest.mark.parametrize("name", ["func", "qkvpacked", "kvpacked"])
def test_dense_no_keys(gpu_free, name):
    if name == "qkvpacked":
        args = dict(qkv=rnd(B, 0, 3, H, D))
        sq = 0
    else:
        sq = SQ
        args = dict(q=rnd(B, SQ, H, D))
        if name == "func":
            args.update(k=rnd(B, 0, HK, D), v=rnd(B, 0, HK, D))
        else:
            args.update(kv=rnd(B, 0, 2, HK, D))
    out, lse, _ = call(name, **args, return_attn_probs=True)
    assert gpu_free.calls == []
    assert out.shape == (B, sq, H, D) and bool((out == 0).all())
    assert lse.shape == (B, H, sq) and bool((lse == math.inf).all())


@pytest.mark.parametrize("case", ["no_batch", "no_queries", "no_keys", "no_blocks", "max_seqlen_q_0",
                                  "max_seqlen_k_0"])
def test_varlen_empty(gpu_free, case):
    """Empty problems launch nothing. max_seqlen_q or max_seqlen_k 0 over non-empty tensors (the
    caller's maxima say no sequence has a query row or a key; flash-attn 2 reads max_seqlen_k 0
    the same way) answer 0 / +inf where the kernels' grids would be empty."""
    args = valid("varlen_paged" if case == "no_blocks" else "varlen")
    if case.startswith("max_seqlen"):
        args[case[:-2]] = 0
    elif case == "no_batch":
        args.update(cu_seqlens_q=i32(0), cu_seqlens_k=i32(0), q=rnd(0, H, D))
    elif case == "no_queries":
        args.update(cu_seqlens_q=i32(0, 0, 0), q=rnd(0, H, D), max_seqlen_q=0)
    elif case == "no_keys":
        args.update(cu_seqlens_k=i32(0, 0, 0), k=rnd(0, HK, D), v=rnd(0, HK, D), max_seqlen_k=0)
    else:
        args.update(block_table=i32().view(B, 0))
    out, lse, _ = call("varlen", **args, return_attn_probs=True)
    assert gpu_free.calls == []
    total_q = args["q"].shape[0]
    assert out.shape == (total_q, H, D) and lse.shape == (H, total_q)
    if case not in ("no_batch", "no_queries"):
        assert total_q > 0 and bool((out == 0).all()) and bool((lse == math.inf).all())


def test_kvcache_checks_run_once_per_signature(gpu_free, monkeypatch):
    runs = []
    check = fi._check_kvcache
    monkeypatch.setattr(fi, "_check_kvcache", lambda *a: (runs.append(a), check(*a)))
    call("kvcache", **with_("kvcache", num_splits=1))
    call("kvcache", **with_("kvcache", num_splits=1))  # fresh tensors, same signature
    assert len(runs) == 1 and len(gpu_free.calls) == 2

    strided = rnd(B, CACHE, HK, 2 * D)[..., ::2]
    for over, error in [
        (dict(num_splits=True), ValueError),          # equal to 1 and hashed alike, but refused
        (dict(cache_seqlens=CACHE), ValueError),      # no room for k
        (dict(k_cache=strided, v_cache=strided), ValueError),
        (dict(q=rnd(B, 1, H, D, dtype=torch.bfloat16)), TypeError),
    ]:
        for _ in range(2):  # a refused signature is not remembered
            with pytest.raises(error):
                call("kvcache", **with_("kvcache", **{"num_splits": 1, **over}))
    assert len(runs) == 9 and len(gpu_free.calls) == 2

    for _ in range(2):  # a window given as a list is normalised to a tuple first: checked once
        call("kvcache", **with_("kvcache", window_size=[-1, -1]))
    assert len(runs) == 10
    for _ in range(2):  # an unhashable argument: checked on every call
        call("kvcache", **with_("kvcache", causal=[]))
    assert len(runs) == 12


@pytest.mark.parametrize("case", ["no_batch", "no_queries", "no_cache", "no_blocks"])
def test_kvcache_empty(gpu_free, case):
    args = valid("kvcache_paged" if case == "no_blocks" else "kvcache")
    if case == "no_batch":
        args.update(q=rnd(0, 1, H, D), k=rnd(0, 1, HK, D), v=rnd(0, 1, HK, D),
                    cache_seqlens=i32())
    elif case == "no_queries":
        args.update(q=rnd(B, 0, H, D))
    elif case == "no_cache":
        args.update(k_cache=rnd(B, 0, HK, D), v_cache=rnd(B, 0, HK, D), k=None, v=None,
                    cache_seqlens=None)
    else:
        args.update(block_table=i32().view(B, 0), k=None, v=None, cache_seqlens=None)
    before = {a: _bytes(args[a]) for a in ("k_cache", "v_cache")}
    out, lse = call("kvcache", **args, return_softmax_lse=True)
    assert gpu_free.calls == []
    b, sq = args["q"].shape[:2]
    assert out.shape == (b, sq, H, D) and lse.shape == (b, H, sq)
    if case in ("no_cache", "no_blocks"):
        assert bool((out == 0).all()) and bool((lse == math.inf).all())
    for a, t in before.items():
        assert torch.equal(_bytes(args[a]), t)


def test_mla_decode_checks(gpu_free):
    """MLA decode (q and k_cache 576 wide, v_cache 512): v_cache must be k_cache's first 512
    columns (the kernel reads V from K's rows); appended keys, rotary, cache_leftpad, a split
    count and packed queries are refused by name; a call without keys answers 512 columns."""
    q = rnd(B, 1, H, 576)
    cache = rnd(B, CACHE, HK, 576)
    latent = cache[..., :512]
    with pytest.raises(ValueError, match=r"v_cache must be k_cache\[\.\.\., :512\]"):
        call("kvcache", q=q, k_cache=cache, v_cache=latent.clone())
    refused = [(dict(num_splits=2), "num_splits > 1"),
               (dict(k=cache[:, :1], v=latent[:, :1], cache_seqlens=CACHE - 1), "k / v"),
               (dict(cache_leftpad=i32(0, 1)), "cache_leftpad")]
    for over, what in refused:
        with pytest.raises(ValueError, match=rf"^MLA decode \(576 / 512\) is not built with .*{re.escape(what)}"):
            call("kvcache", q=q, k_cache=cache, v_cache=latent, **over)
    with pytest.raises(ValueError, match="not built with cu_seqlens_q"):
        cute_flash.flash_attn_with_kvcache(rnd(3, H, 576), cache, latent, cache_seqlens=i32(1, 2),
                                           cu_seqlens_q=i32(0, 1, 3), max_seqlen_q=2)
    assert gpu_free.calls == []
    out, lse = call("kvcache", q=q, k_cache=cache, v_cache=latent, return_softmax_lse=True)
    assert [name for name, *_ in gpu_free.calls] == ["flash_fwd_kvcache"]
    out, lse = call("kvcache", q=q, k_cache=rnd(B, 0, HK, 576), v_cache=rnd(B, 0, HK, 576)[..., :512],
                    return_softmax_lse=True)
    assert out.shape == (B, 1, H, 512) and bool((lse == math.inf).all())
