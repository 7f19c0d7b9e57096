"""A library of Python-written attention variants (`score_mod` / `mask_mod` with flash-attn-4's
conventions, kernels/common/user_mods.py), each with its torch twin in FlexAttention's
conventions (what `cute_flash.reference` and FlexAttention take), so a variant is checked
against the reference and against FlexAttention with the same definition.

    spec = mods.prefix_lm(prefix_lengths)
    out = flash_attn_func(q, k, v, **spec.kwargs())
    out = flash_attn_func(q, k, v, **spec.kwargs(), block_mask=spec.block_mask(b, 1, sq, sk))  # empty blocks skipped

Positions count from each sequence's first query / key; with q and k of different lengths the
causal parts below align the last query with the last key (flash-attn's bottom-right rule),
through `seqlen_info`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
import torch


@dataclass(frozen=True)
class ModSpec:
    """One variant: the kernel mods, the aux tensors they read, and their torch twins."""
    score_mod: object = None
    mask_mod: object = None
    aux_tensors: tuple = ()
    score_mod_bwd: object = None  # the score_mod's derivative (its gradient's way back)
    ref_score_mod: object = field(default=None, repr=False)  # (score, b, h, q_idx, kv_idx) -> score
    ref_mask_mod: object = field(default=None, repr=False)   # (b, h, q_idx, kv_idx) -> bool

    def kwargs(self) -> dict:
        """The attention functions' keyword arguments."""
        return dict(score_mod=self.score_mod, mask_mod=self.mask_mod, aux_tensors=list(self.aux_tensors) or None,
                    score_mod_bwd=self.score_mod_bwd)

    def ref_kwargs(self) -> dict:
        """`cute_flash.reference.attention_ref`'s keyword arguments."""
        return dict(score_mod=self.ref_score_mod, mask_mod=self.ref_mask_mod)

    def block_mask(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device="cuda", block_size=128):
        """The FlexAttention BlockMask of the mask_mod (from its torch twin, `create_block_mask`),
        for `flash_attn_func(..., block_mask=)`: the kernels then skip the blocks it
        leaves empty. batch or heads 1: one mask for all of them."""
        from torch.nn.attention.flex_attention import create_block_mask

        if self.ref_mask_mod is None:
            raise ValueError("a block mask lists the blocks of a mask_mod; this variant has none")
        return create_block_mask(self.ref_mask_mod, batch, heads, seqlen_q, seqlen_k, device=device,
                                 BLOCK_SIZE=block_size)


def document_mask(doc_ids: torch.Tensor) -> ModSpec:
    """Packed documents in a dense batch: query i sees key j only within its document
    (doc_ids (batch, seqlen) int32, the same for queries and keys), causally."""
    doc_ids = doc_ids.to(torch.int32).contiguous()

    @cute.jit
    def same_document(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        docs = aux_tensors[0]
        same = docs[b_idx[0], q_idx[0]] == docs[b_idx[0], kv_idx[0]]
        return operator.and_(operator.ge(q_idx, kv_idx), _bool(same))

    def ref(b, h, q, k):
        return (doc_ids.long()[b, q] == doc_ids.long()[b, k]) & (q >= k)

    return ModSpec(mask_mod=same_document, aux_tensors=(doc_ids,), ref_mask_mod=ref)


def prefix_lm(prefix_lengths: torch.Tensor) -> ModSpec:
    """Prefix LM: every query sees its sequence's first prefix_lengths[b] keys, and the rest
    causally (prefix_lengths (batch,) int32)."""
    prefix_lengths = prefix_lengths.to(torch.int32).contiguous()

    @cute.jit
    def prefix_or_causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        prefix = aux_tensors[0][b_idx[0]]
        return operator.or_(operator.ge(q_idx, kv_idx), operator.lt(kv_idx, _splat(prefix)))

    def ref(b, h, q, k):
        return (q >= k) | (k < prefix_lengths.long()[b])

    return ModSpec(mask_mod=prefix_or_causal, aux_tensors=(prefix_lengths,), ref_mask_mod=ref)


def sliding_window_with_sinks(window: int, sink_tokens: int) -> ModSpec:
    """Causal attention to the last `window` + 1 keys and to the first `sink_tokens` keys
    (StreamingLLM's attention sinks)."""
    window, sink_tokens = int(window), int(sink_tokens)

    @cute.jit
    def window_or_sink(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        diag = q_idx - kv_idx
        near = operator.and_(operator.ge(diag, 0), operator.le(diag, window))
        return operator.or_(near, operator.lt(kv_idx, sink_tokens))

    def ref(b, h, q, k):
        return ((q - k >= 0) & (q - k <= window)) | (k < sink_tokens)

    return ModSpec(mask_mod=window_or_sink, ref_mask_mod=ref)


def relative_bias(table: torch.Tensor) -> ModSpec:
    """A learned relative-position bias: score + table[h, q_idx - kv_idx + max_distance] (table
    (heads, 2 * max_distance + 1) float32; distances past max_distance clamp to it)."""
    table = table.to(torch.float32).contiguous()
    reach = (table.shape[1] - 1) // 2

    @cute.jit
    def add_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        dist = cutlass.min(cutlass.max(q_idx[0] - kv_idx[0], -reach), reach)
        return score + _splat(aux_tensors[0][h_idx[0], dist + reach])

    def ref(score, b, h, q, k):
        return score + table[h, (q - k).clamp(-reach, reach) + reach].to(score.dtype)

    return ModSpec(score_mod=add_bias, aux_tensors=(table,), score_mod_bwd=_through, ref_score_mod=ref)


def alibi(slopes: torch.Tensor) -> ModSpec:
    """ALiBi as a score_mod: score - slopes[h] * |q_idx + seqlen_k - seqlen_q - kv_idx| (slopes
    (heads,) float32), what `alibi_slopes` does built in."""
    slopes = slopes.to(torch.float32).contiguous()

    @cute.jit
    def alibi_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        # each index converted on its own, a row's and a column's conversions shared by their
        # scores; exact below 2^24, as the int distance it replaces
        dist = cutlass.Float32(q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q) - cutlass.Float32(kv_idx[0])
        return score - _splat(aux_tensors[0][h_idx[0]] * cute.arch.fmax(dist, -dist))

    def ref(score, b, h, q, k):
        shift = score.shape[-1] - score.shape[-2] if score.dim() >= 2 else 0  # FlexAttention's: one score, sq = sk
        return score - (slopes[h] * (q + shift - k).abs()).to(score.dtype)

    return ModSpec(score_mod=alibi_bias, aux_tensors=(slopes,), score_mod_bwd=_through, ref_score_mod=ref)


def softcap(cap: float) -> ModSpec:
    """Softcap as a score_mod: cap * tanh(score / cap), what `softcap` does built in, and as
    it does: a multiply by 1 / cap and the fast tanh (MUFU.TANH), not a division and the
    precise tanh (docs/tuning/mods.md, "The softcap mod's tanh and division")."""
    cap = float(cap)
    inv_cap = 1.0 / cap

    @cute.jit
    def capped(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return _splat(cap * cute.math.tanh(score[0] * inv_cap, fastmath=True))

    @cute.jit
    def capped_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        th = cute.math.tanh(score[0] * inv_cap, fastmath=True)
        return _splat(grad[0] * (1.0 - th * th))

    def ref(score, b, h, q, k):
        return cap * torch.tanh(score / cap)

    return ModSpec(score_mod=capped, score_mod_bwd=capped_bwd, ref_score_mod=ref)


@cute.jit
def _through(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """The backward of a score_mod that adds a bias: the gradient passes unchanged."""
    return grad


def _splat(value):
    """A scalar as a TensorSSA of one element (what a mod returns and compares with); plain
    Python, run while the mod is traced."""
    dtype = cutlass.Float32 if isinstance(value, (float, cutlass.Float32)) else cutlass.Int32
    vec = cute.make_rmem_tensor(1, dtype)
    vec[0] = value
    return vec.load()


def _bool(value):
    vec = cute.make_rmem_tensor(1, cutlass.Boolean)
    vec[0] = value
    return vec.load()
