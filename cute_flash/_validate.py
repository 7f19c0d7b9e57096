"""Argument checks for the public API in `cute_flash.interface`.

One function per family of rules. Each raises TypeError (wrong type, dtype or device) or
ValueError (wrong shape, stride or option) with a message that names the argument and says
what was expected, so that misuse fails in Python before any kernel launch and before any
tensor the caller owns is written. None of them reads tensor data (no device sync), and only
`check_cuda` looks at devices: the interface calls it last, so every other rule can be
exercised on CPU tensors in CI.

`named` arguments are sequences of `(name, tensor_or_None)` pairs; the first pair is the
reference (q) and `None` entries (optional arguments not given) are skipped.
"""

import math
import numbers
import operator

import torch

from cute_flash.launch import block_sparse
from layouts.traits import LATENT_DIMS

MAX_HEAD_DIM = 256
# The kernels move global memory with 128-bit copies: a base address off 16 bytes changes
# what a call can be launched with, so it is part of a call's signature.
ALIGN_BYTES = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)
_Q4 = ("batch", "seqlen_q", "nheads", "headdim")


def signature(*args):
    """A hashable summary of everything the checks here read from `args`: for a tensor its dtype,
    shape, strides, device and base-address alignment; for anything else its type and value.
    Arguments with equal signatures pass or fail every check alike, so a hot path may check one
    signature once. None when an argument is unhashable (a list, say)."""
    key = []
    for a in args:  # a plain loop: this runs on every call, and a generator costs a third more
        if a is None:
            key.append(None)
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.shape, a.stride(), a.device, a.data_ptr() % ALIGN_BYTES))
        else:
            key.append((type(a), a))
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _given(named):
    return [(name, t) for name, t in named if t is not None]


def _is_int(x):
    """Python/NumPy integers, but not bools (True is an int to Python, never a length to us)."""
    if type(x) is int:  # the common case, without the ABC machinery (a hot path per call)
        return True
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _require_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _require_dtype(t, name, dtype):
    _require_tensor(t, name)
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")


def _fmt(dims):
    return "(" + ", ".join(dims) + ")"


# --- dtype / device -------------------------------------------------------------------------


def check_dtypes(named, optional=()):
    """All tensors are torch tensors of one dtype, float16 or bfloat16 (the MMA input types);
    only the arguments named in `optional` may be None."""
    named = [(name, t) for name, t in named if not (t is None and name in optional)]
    for name, t in named:
        _require_tensor(t, name)
    ref_name, ref = named[0]
    if ref.dtype not in HALF_DTYPES:
        raise TypeError(f"{ref_name} must be float16 or bfloat16, got {ref.dtype}")
    for name, t in named[1:]:
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{name} must have the same dtype as {ref_name} ({ref.dtype}), got {t.dtype}"
            )


def check_cuda(named):
    """All tensors on one CUDA device, or all on the meta device (shape inference: the caller
    answers without a launch). Called last so the other rules are testable on CPU."""
    named = [(name, t) for name, t in _given(named) if isinstance(t, torch.Tensor)]
    ref_name, ref = named[0]
    for name, t in named[1:]:
        if t.device != ref.device:
            raise TypeError(
                f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}"
            )
    if ref.device.type not in ("cuda", "meta"):
        names = ", ".join(dict.fromkeys(name for name, _ in named))
        raise TypeError(f"{names} must be CUDA tensors, got device {ref.device}")


# --- shapes ---------------------------------------------------------------------------------


def check_packed(t, name, dim, count, dims):
    """A packed qkv / kv tensor has `count` slices along `dim`, split into views by the caller."""
    _require_tensor(t, name)
    if t.dim() != len(dims) or t.shape[dim] != count:
        raise ValueError(f"{name} must have shape {_fmt(dims)}, got {tuple(t.shape)}")


def check_shapes(q, k, v, names, q_dims, kv_dims):
    """q has len(q_dims) dims, k and v len(kv_dims) dims and the same shape up to the head dim;
    when both layouts start with "batch" the batch sizes agree. Head dims: `check_head_dim`."""
    for t, name, dims in ((q, names[0], q_dims), (k, names[1], kv_dims), (v, names[2], kv_dims)):
        if t.dim() != len(dims):
            raise ValueError(
                f"{name} must be {len(dims)}-D {_fmt(dims)}, got shape {tuple(t.shape)}"
            )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{names[2]} must have the same shape as {names[1]} {tuple(k.shape)} "
            f"(up to the head dim), got {tuple(v.shape)}"
        )
    if q_dims[0] == kv_dims[0] == "batch" and k.shape[0] != q.shape[0]:
        raise ValueError(
            f"{names[1]} must have the batch size of {names[0]} ({q.shape[0]}), got {k.shape[0]}"
        )


def check_kvcache_shapes(q, k_cache, v_cache, k, v, paged):
    """q (batch, seqlen_q, nheads, d); caches 4-D, paged or not; the new k and v, given together
    or not at all, are (batch, seqlen_new, nheads_k, d) with the caches' nheads_k."""
    cache_dims = (
        ("num_blocks", "page_size", "nheads_k", "headdim")
        if paged
        else ("batch_cache", "seqlen_cache", "nheads_k", "headdim")
    )
    check_shapes(q, k_cache, v_cache, ("q", "k_cache", "v_cache"), _Q4, cache_dims)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append)")
    if k is None:
        return
    check_shapes(q, k, v, ("q", "k", "v"), _Q4, ("batch", "seqlen_new", "nheads_k", "headdim"))
    if k.shape[2] != k_cache.shape[2]:
        raise ValueError(
            f"k must have the nheads_k of k_cache ({k_cache.shape[2]}), got {k.shape[2]}"
        )


def is_latent(q, k_cache, v_cache) -> bool:
    """MLA's absorbed decode (`layouts.traits.LATENT_DIMS`): q and k_cache 576 wide, v_cache 512."""
    return (q.shape[-1], v_cache.shape[-1]) == LATENT_DIMS and k_cache.shape[-1] == LATENT_DIMS[0]


def check_latent_cache(k_cache, v_cache, k, rotary_cos, cache_batch_idx, cache_leftpad, num_splits):
    """MLA decode reads V from K's rows (one latent cache): v_cache must be k_cache's first 512
    columns, a view; what the call may add to the plain decode is refused where not built."""
    d, d_v = LATENT_DIMS
    # tensors without data (meta, or torch.compile's fake ones) have no address to compare
    traced = k_cache.is_meta or torch.compiler.is_compiling()
    if (v_cache.shape[:-1] != k_cache.shape[:-1] or v_cache.stride() != k_cache.stride()
            or (not traced and v_cache.data_ptr() != k_cache.data_ptr())):
        raise ValueError(f"with q and k_cache {d} wide and v_cache {d_v} (MLA decode), v_cache must be "
                         f"k_cache[..., :{d_v}]: the kernel reads V from the first {d_v} columns of K's rows")
    unbuilt = [name for name, x in (("k / v (appended keys)", k), ("rotary_cos", rotary_cos),
                                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad))
               if x is not None] + (["num_splits > 1"] if num_splits > 1 else [])
    if unbuilt:
        raise ValueError(f"MLA decode ({d} / {d_v}) is not built with {', '.join(unbuilt)}")


def check_head_dim(named):
    """One head dim for all the named tensors (q, k, v; or q, k with v checked alone where it may
    have its own), between 1 and 256 (the largest kernel bucket)."""
    named = _given(named)
    ref_name, ref = named[0]
    d = ref.shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{ref_name} head dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    for name, t in named[1:]:
        if t.shape[-1] != d:
            raise ValueError(
                f"{name} head dim must equal the head dim of {ref_name} ({d}), got {t.shape[-1]}"
            )


def check_gqa(q, k, q_name, k_name):
    """MQA/GQA: each kv head serves nheads // nheads_k query heads, so the ratio is whole."""
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads < 1 or nheads_k < 1:
        raise ValueError(
            f"{q_name} and {k_name} must have at least one head, got nheads={nheads}, "
            f"nheads_k={nheads_k}"
        )
    if nheads % nheads_k != 0:
        raise ValueError(
            f"nheads of {q_name} ({nheads}) must be a multiple of nheads_k of {k_name} ({nheads_k})"
        )


def check_last_dim_contiguous(named):
    """For tensors the kernels update in place (the KV caches): a unit-stride last dim, as
    flash-attn requires. Other strides, the head dim and the base address may break 128-bit
    copies: the launcher then works on aligned copies and writes the appended rows back."""
    for name, t in _given(named):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1), "
                f"got stride {t.stride(-1)}"
            )


def needs_grad(tensors, extra=None) -> bool:
    """Grad mode is on and a given tensor (of `tensors`, or `extra`) requires grad (None and
    non-tensors are skipped). A plain loop with an early exit: this runs on every call."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return isinstance(extra, torch.Tensor) and extra.requires_grad


# --- options --------------------------------------------------------------------------------


def check_dropout(dropout_p) -> float:
    """dropout_p as a float in [0, 1); above 1 - 2^-15 the 14-bit keep threshold
    (philox.keep_threshold) would keep nothing, so those are refused too."""
    if type(dropout_p) is float and dropout_p == 0.0:
        return 0.0
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 1.0 - 2.0 ** -15:
        raise ValueError(f"dropout_p must be at most 1 - 2^-15 (the keep probability is quantized to 2^-14), "
                         f"got {dropout_p!r}")
    return float(dropout_p)


def _index(x):
    """x as a Python int when `operator.index` takes it and it is no boolean: ints, NumPy
    integers, integer tensors of one element. TypeError otherwise (NumPy's bool is refused by
    operator.index itself; Python's and torch's are not)."""
    if isinstance(x, bool):
        raise TypeError("a boolean is not a window size")
    if isinstance(x, torch.Tensor) and (x.dtype == torch.bool or x.is_floating_point() or x.is_complex()):
        raise TypeError("not an integer tensor")
    return operator.index(x)


def check_window(window_size):
    """(left, right), each item an int by `operator.index` (ints, NumPy integers, 0-d integer
    tensors; a 2-element integer tensor is a pair too, as flash-attn's tests pass it); -1 means
    unbounded on that side. Returns the pair as Python ints."""
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int \
            and type(window_size[1]) is int:
        pair = window_size  # the common case, without the conversions (a hot path per call)
    else:
        try:
            left, right = window_size
            pair = (_index(left), _index(right))
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}"
            ) from None
    if pair[0] < -1 or pair[1] < -1:
        raise ValueError(
            f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}"
        )
    return pair


def check_softmax_scale(softmax_scale):
    """None (1 / sqrt(headdim)) or a finite number: zero and negative scales are computed as
    written (launch/args.py:positive_scale), an infinite or NaN one has no meaning."""
    if softmax_scale is None:
        return
    try:
        finite = math.isfinite(float(softmax_scale))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")


def check_softcap(softcap):
    """0 disables softcapping; a cap must be a finite positive number."""
    if type(softcap) is float and softcap == 0.0:
        return
    if not isinstance(softcap, numbers.Real) or not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")


def check_alibi(alibi_slopes, batch, nheads):
    """One fp32 slope per head, shared by the batch (nheads,) or per sequence (batch, nheads)."""
    if alibi_slopes is None:
        return
    _require_dtype(alibi_slopes, "alibi_slopes", torch.float32)
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if nheads > 1 and alibi_slopes.stride(-1) != 1:
        raise ValueError(
            f"alibi_slopes must have a contiguous last dimension, got strides "
            f"{tuple(alibi_slopes.stride())}"
        )



SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_learnable_sink(sink, nheads):
    """One logit per query head (nheads,), fp16 / bf16 / fp32, as flash-attn-4's learnable_sink."""
    if sink is None:
        return
    _require_tensor(sink, "learnable_sink")
    if sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink must be float16, bfloat16 or float32, got {sink.dtype}")
    if tuple(sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got {tuple(sink.shape)}")


def check_mods(score_mod, mask_mod, aux_tensors, score_mod_bwd, softcap, alibi_slopes, dropout_probs):
    """Python-written mods (kernels/common/user_mods.py): callables; aux_tensors a list or tuple of
    tensors, given with a mod; score_mod_bwd with a score_mod; a score_mod sees the scaled score
    itself, so softcap and ALiBi (which rescale it) are written into it instead; S_dmask, which
    return_attn_probs computes with dropout (`dropout_probs`), is computed without mods."""
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod), ("score_mod_bwd", score_mod_bwd)):
        if mod is not None and not callable(mod):
            raise TypeError(f"{name} must be a callable (a cute.jit function), got {type(mod).__name__}")
    if score_mod_bwd is not None and score_mod is None:
        raise ValueError("score_mod_bwd is the backward of a score_mod; none was given")
    if aux_tensors is not None:
        if score_mod is None and mask_mod is None:
            raise ValueError("aux_tensors are read by a score_mod or mask_mod; none was given")
        if not isinstance(aux_tensors, (list, tuple)):
            raise TypeError(f"aux_tensors must be a list of tensors, got {type(aux_tensors).__name__}")
        for i, t in enumerate(aux_tensors):
            _require_tensor(t, f"aux_tensors[{i}]")
    if score_mod is not None and (softcap > 0 or alibi_slopes is not None):
        raise ValueError("softcap and alibi_slopes do not compose with a score_mod: write them into the mod")
    if (score_mod is not None or mask_mod is not None) and dropout_probs:
        raise ValueError("return_attn_probs with dropout is not available with a score_mod or mask_mod "
                         "(S_dmask is computed without them)")


_BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def check_block_mask(block_mask, mask_mod, batch, nheads, seqlen_q, seqlen_k):
    """A FlexAttention BlockMask (its lists, block sizes and lengths), given with the mask_mod
    whose blocks it lists (the kernels evaluate the mask_mod on its partial blocks), and built
    for the call's shape (`launch/block_sparse.check_block_mask`)."""
    if block_mask is None:
        return
    if not all(hasattr(block_mask, name) for name in _BLOCK_MASK_TENSORS + ("BLOCK_SIZE", "seq_lengths")):
        raise TypeError(f"block_mask must be a FlexAttention BlockMask (torch.nn.attention.flex_attention."
                        f"create_block_mask), got {type(block_mask).__name__}")
    if mask_mod is None:
        raise ValueError("block_mask lists the blocks a mask_mod cuts: pass the mask_mod too (it runs on the "
                         "block_mask's partial blocks)")
    block_sparse.check_block_mask(block_mask, batch, nheads, seqlen_q, seqlen_k)


def block_mask_named(block_mask) -> list:
    """The BlockMask's tensors for `check_cuda`."""
    if block_mask is None:
        return []
    return [(f"block_mask.{name}", getattr(block_mask, name)) for name in _BLOCK_MASK_TENSORS
            if getattr(block_mask, name) is not None]

# --- variable length ------------------------------------------------------------------------


def check_int32_vector(t, name, length):
    """A per-sequence int32 vector the kernel indexes directly, so dense and of known length."""
    _require_dtype(t, name, torch.int32)
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")


def check_leftpad_k(leftpad_k, batch, paged):
    """flash-attn's leftpad_k of the varlen forward: int32 (batch,), not over a paged cache."""
    if paged:
        raise ValueError("leftpad_k with a paged KV cache (block_table) is not supported, as in flash-attn")
    check_int32_vector(leftpad_k, "leftpad_k", batch)


class UnsupportedOption(ValueError, RuntimeError):
    """An option flash-attn refuses with a RuntimeError: a ValueError here, as every bad option
    is, and a RuntimeError for code written against flash-attn's."""


def check_varlen_num_splits(num_splits, paged):
    """The newest flash-attn's num_splits of the varlen forward: an int >= 0, at most 1 over a
    paged cache (its message)."""
    if not _is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    if paged and num_splits > 1:
        raise UnsupportedOption(f"num_splits > 1 is not supported for varlen paged KV, got {num_splits}")


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, names):
    """int32 prefix sums of one batch (batch + 1 entries each) and non-negative int maxima.
    Their values live on the device and are not read here (that would sync)."""
    name_q, name_k, name_mq, name_mk = names
    _require_dtype(cu_seqlens_q, name_q, torch.int32)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(
            f"{name_q} must be 1-D of length batch + 1, got shape {tuple(cu_seqlens_q.shape)}"
        )
    check_int32_vector(cu_seqlens_q, name_q, cu_seqlens_q.shape[0])
    check_int32_vector(cu_seqlens_k, name_k, cu_seqlens_q.shape[0])
    for name, m in ((name_mq, max_seqlen_q), (name_mk, max_seqlen_k)):
        if not _is_int(m) or m < 0:
            raise ValueError(f"{name} must be an int >= 0, got {m!r}")


def check_block_table(block_table, batch, k_cache, k_name):
    """Paged KV: an int32 (batch, max_blocks) table of page indices into caches of pages of any
    size >= 1 (multiples of 16 rows take the faster copies). The indices are not read here: the
    kernels clamp them into [0, num_blocks)."""
    _require_dtype(block_table, "block_table", torch.int32)
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must have shape ({batch}, max_blocks), got {tuple(block_table.shape)}"
        )
    if block_table.shape[1] > 1 and block_table.stride(-1) != 1:
        raise ValueError(
            f"block_table must have a contiguous last dimension, got strides "
            f"{tuple(block_table.stride())}"
        )
    if k_cache.shape[1] < 1:
        raise ValueError(f"{k_name} page size (dim 1) must be at least 1, got {k_cache.shape[1]}")


def check_block_table_capacity(cache_seqlens, seqlen_new, block_table, page_size):
    """flash-attn's host guard of paged KV caches: the longest sequence after the append must
    fit in the pages block_table addresses. Reads cache_seqlens (a device sync, as in
    flash-attn): never call it while a CUDA graph is being captured. The kernels clamp anyway;
    this turns a caller's mistake into an error instead of undefined output."""
    capacity = block_table.shape[1] * page_size
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.numel() == 0:
            return
        longest = int(cache_seqlens.max()) + seqlen_new
    else:
        longest = cache_seqlens + seqlen_new
    if longest > capacity:
        new = " + seqlen_new" if seqlen_new else ""
        raise RuntimeError(
            f"paged KV cache: max(cache_seqlens){new} (= {longest}) exceeds what block_table "
            f"addresses (max_blocks {block_table.shape[1]} * page_size {page_size} = {capacity}); "
            "give block_table more columns, or the kernel would index it out of bounds"
        )


# --- kv cache -------------------------------------------------------------------------------


def check_kvcache_args(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                       num_splits, seqlen_k):
    """The per-sequence arguments of flash_attn_with_kvcache and what they imply about each
    other; `seqlen_k` is the cache capacity (max_blocks * page_size when paged)."""
    batch = q.shape[0]
    if k is not None and k.shape[1] > seqlen_k:
        raise ValueError(
            f"k must fit in the cache: seqlen_new ({k.shape[1]}) must be at most the cache "
            f"length ({seqlen_k})"
        )
    if k is not None and q.shape[1] > seqlen_k:
        raise ValueError(
            f"q seqlen_q ({q.shape[1]}) must be at most the cache length ({seqlen_k}) when k "
            "and v are appended (as flash-attn requires)"
        )
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens must be given with k and v (where to append them)")
    elif _is_int(cache_seqlens):
        room = seqlen_k - (0 if k is None else k.shape[1])
        if block_table is not None and cache_seqlens > room:  # flash-attn's error, as for a tensor
            check_block_table_capacity(cache_seqlens, seqlen_k - room, block_table, k_cache.shape[1])
        if not 0 <= cache_seqlens <= room:
            raise ValueError(
                f"cache_seqlens must be in [0, {room}] (cache length {seqlen_k} minus the "
                f"appended length), got {cache_seqlens}"
            )
    elif isinstance(cache_seqlens, torch.Tensor):
        check_int32_vector(cache_seqlens, "cache_seqlens", batch)
    else:
        raise TypeError(
            f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}"
        )
    if block_table is not None:
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise ValueError(f"{name} is not supported with a paged KV cache (block_table)")
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(
            f"k_cache must hold at least batch ({batch}) sequences when cache_batch_idx is not "
            f"given, got {k_cache.shape[0]}"
        )
    if cache_batch_idx is not None:
        check_int32_vector(cache_batch_idx, "cache_batch_idx", batch)
    if cache_leftpad is not None:
        check_int32_vector(cache_leftpad, "cache_leftpad", batch)
    if not _is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: heuristic), got {num_splits!r}")


def check_rotary(rotary_cos, rotary_sin, q, k, seqlen_k):
    """Rotary tables for the appended keys (and q): q's dtype, (seqlen_ro, rotary_dim / 2) with
    rotary_dim <= head dim, and a row for every cache position."""
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError(
            "rotary_cos and rotary_sin rotate the appended keys: k and v must be given"
        )
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _require_dtype(t, name, q.dtype)
        if t.dim() != 2 or t.shape[1] < 1:
            raise ValueError(
                f"{name} must be 2-D (seqlen_ro, rotary_dim / 2), got {tuple(t.shape)}"
            )
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(
            f"rotary_sin must have the shape of rotary_cos {tuple(rotary_cos.shape)}, "
            f"got {tuple(rotary_sin.shape)}"
        )
    seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
    if rotary_dim > q.shape[-1]:
        raise ValueError(
            f"rotary_cos rotary_dim (2 * {rotary_cos.shape[1]}) must be at most the head dim "
            f"({q.shape[-1]})"
        )
    if seqlen_ro < seqlen_k:
        raise ValueError(
            f"rotary_cos must have a row per cache position: seqlen_ro ({seqlen_ro}) must be at "
            f"least the cache length ({seqlen_k})"
        )
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
