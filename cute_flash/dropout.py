"""S_dmask, dropout's debugging view (a call's dropout state: `launch/rng.py`).

S_dmask (`return_attn_probs=True` with dropout) is in flash-attn's representation, so that its
test helpers (`convert_flash_attn_S_to_softmax`, `normalize_flash_attn_S`, with
`flash_attn_interface._get_block_size_n`) decode it: (batch, heads, seqlen_q rounded up to 128,
seqlen_k rounded up to 128), zero past the lengths; in key block j of `block_n` columns,
exp(s - m_j) with m_j the row's maximum score over blocks j and later (a forward's running
maximum as it visits key blocks from the last), that is P / max(P over blocks j..); dropped
entries negated (a dropped zero is -0.0, so `~torch.signbit` is the keep mask). P is the
reference's (`cute_flash.reference`, float32), the mask the call's rng_state's
(`philox.keep_mask_of_state`), computed with torch on the device, then q's dtype. It costs
O(seqlen_q * seqlen_k) memory and is meant for tests and debugging, as flash-attn's is."""
from __future__ import annotations

import torch

from cute_flash import reference
from cute_flash.launch.rng import DropoutArgs
from layouts import philox
from layouts.traits import choose_fwd_traits, tile_arch


def s_dmask_shape(batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> tuple:
    """S_dmask's shape: flash-attn's, both lengths rounded up to 128."""
    return batch, heads, seqlen_q + -seqlen_q % 128, seqlen_k + -seqlen_k % 128


def s_dmask_block_n(device, head_dim: int) -> int:
    """The key-block width of S_dmask's representation: the SM80 forward's key block for
    `head_dim` on `device`'s GPU (`flash_attn_interface._get_block_size_n`)."""
    major, minor = torch.cuda.get_device_capability(device)
    return choose_fwd_traits(head_dim, "fp16", tile_arch(major * 10 + minor)).block_n


def _unnormalized(probs: torch.Tensor, block_n: int) -> torch.Tensor:
    """probs (b, h, sq, sk) -> P / max(P over key blocks j and later) in key block j (0 where
    those blocks hold no visible key)."""
    sk = probs.shape[-1]
    blocks = -(-sk // block_n)
    tiled = torch.nn.functional.pad(probs, (0, blocks * block_n - sk)).unflatten(-1, (blocks, block_n))
    running = tiled.amax(-1).flip(-1).cummax(-1).values.flip(-1)  # (b, h, sq, blocks)
    inverse = torch.where(running > 0, 1.0 / running.clamp_min(torch.finfo(running.dtype).tiny), 0.0)
    return (tiled * inverse.unsqueeze(-1)).flatten(-2)[..., :sk]


def _flash_representation(probs: torch.Tensor, dropout: DropoutArgs, block_n: int, dtype) -> torch.Tensor:
    """probs (b, h, sq, sk) as flash-attn's S_dmask: unnormalized per key block, the dropped
    entries negated, padded with zeros to lengths rounded up to 128, in `dtype`."""
    keep = philox.keep_mask_of_state(dropout.rng_state, dropout.p, *probs.shape)
    unnorm = _unnormalized(probs, block_n)
    signed = torch.where(keep, unnorm, -unnorm).to(dtype)
    *_, sq, sk = probs.shape
    *_, rows, cols = s_dmask_shape(1, 1, sq, sk)
    return torch.nn.functional.pad(signed, (0, cols - sk, 0, rows - sq))


def s_dmask(q, k, v, dropout: DropoutArgs, **options) -> torch.Tensor:
    """S_dmask of a dense call: q (b, sq, h, d), k/v (b, sk, hk, d); `options` are
    `reference.attention_ref`'s mask and score options."""
    probs = reference.attention_ref(q, k, v, return_probs=True, **options)[2]
    return _flash_representation(probs, dropout, s_dmask_block_n(q.device, q.shape[-1]), q.dtype)


def s_dmask_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout: DropoutArgs,
                   **options) -> torch.Tensor:
    """S_dmask of a packed call, (b, h, max_seqlen_q, max_seqlen_k) rounded up to 128, zero
    outside each sequence's (sq, sk) corner (rows, columns and key blocks count from the
    sequence's start, as its mask does); `options` are `reference.attention_varlen_ref`'s."""
    probs = reference.attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, return_probs=True, **options)[2]
    b, h, sq, sk = probs.shape
    padded = probs.new_zeros((b, h, max(sq, max_seqlen_q), max(sk, max_seqlen_k)))
    padded[..., :sq, :sk] = probs
    return _flash_representation(padded, dropout, s_dmask_block_n(q.device, q.shape[-1]), q.dtype)
