"""Dropout on the host side: a call's run-time state, and S_dmask, its debugging view.

The state is the probability and flash-attn's `rng_state`, a (2,) int64 tensor
(seed, offset) on the call's device, from which the kernels' (4,) uint32 words are built on the
device (kernels/philox.py:Dropout.load reads key_lo, key_hi, offset_lo, threshold).

A call draws its rng_state from torch's default CUDA generator with one `torch.randint` on the
device (`DropoutArgs.draw`), the way torch.compile's generated kernels take their seeds: no host
sync, so a CUDA graph captures it and every replay draws afresh, and `torch.manual_seed` makes
runs repeatable. The backward rebuilds the same words from the saved rng_state
(docs/semantics.md, Dropout).

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

from dataclasses import dataclass

import torch

from cute_flash import philox, reference

_INT64 = 1 << 64


@dataclass(frozen=True, eq=False)
class DropoutArgs:
    """What one call draws its mask from: probability p in (0, 1) and rng_state (2,) int64
    (seed as the two's complement of its 64 bits, offset), on the device of the call."""
    p: float
    rng_state: torch.Tensor

    def __post_init__(self):
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"dropout p must be in (0, 1) here (p = 0 compiles no dropout), got {self.p!r}")
        if philox.keep_threshold(self.p) == 0:
            raise ValueError(f"dropout p = {self.p!r} keeps nothing at 14-bit resolution (p must be below 1 - 2^-15)")
        if self.rng_state.dtype != torch.int64 or self.rng_state.shape != (2,):
            raise ValueError(f"rng_state must be a (2,) int64 tensor (seed, offset), got "
                             f"{tuple(self.rng_state.shape)} {self.rng_state.dtype}")

    @classmethod
    def seeded(cls, p: float, seed: int, offset: int, device) -> DropoutArgs:
        """A given 64-bit seed and offset (tests, benchmarks)."""
        seed %= _INT64
        state = [seed - _INT64 if seed >= _INT64 // 2 else seed, offset % (_INT64 // 2)]
        return cls(p, torch.tensor(state, dtype=torch.int64, device=device))

    @classmethod
    def draw(cls, p: float, device) -> DropoutArgs:
        """A fresh seed and offset from torch's default generator of `device`, drawn on it: 62
        random bits each (a range of 2^62 stays inside int64 wherever torch.compile's generated
        code computes high - low)."""
        return cls(p, torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device))

    def rng_tensor(self, device) -> torch.Tensor:
        """(4,) uint32 on `device`: key_lo, key_hi, offset_lo (the little-endian halves of the
        state) and the keep threshold, built by two small device ops (graph-capturable)."""
        state = self.rng_state.to(device).view(torch.int32)[:3]
        threshold = state.new_full((1,), philox.keep_threshold(self.p))
        return torch.cat((state, threshold)).view(torch.uint32)


def rng_of(dropout: DropoutArgs | None, device):
    """The kernels' mRng argument: None without dropout (compiled as absent)."""
    return None if dropout is None else dropout.rng_tensor(device)


def s_dmask_block_n(device, head_dim: int) -> int:
    """The key-block width of S_dmask's representation: the SM80 forward's key block for
    `head_dim` on `device`'s GPU (`flash_attn_interface._get_block_size_n`)."""
    from layouts.traits import choose_fwd_traits, tile_arch

    major, minor = torch.cuda.get_device_capability(device)
    return choose_fwd_traits(head_dim, "fp16", tile_arch(major * 10 + minor)).block_n


def _unnormalized(probs: torch.Tensor, block_n: int) -> torch.Tensor:
    """probs (b, h, sq, sk) -> P / max(P over key blocks j and later) in key block j (0 where
    those blocks hold no visible key)."""
    *lead, sk = probs.shape
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
    sq, sk = probs.shape[-2:]
    return torch.nn.functional.pad(signed, (0, -sk % 128, 0, -sq % 128))


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
