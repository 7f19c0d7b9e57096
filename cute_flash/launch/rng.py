"""A call's dropout state, and the words the kernels draw its mask from.

The state is the probability and flash-attn's `rng_state`, a (2,) int64 tensor (seed,
offset) on the call's device, from which the kernels' (4,) uint32 words are built on the
device (kernels/common/philox.py:Dropout.load reads key_lo, key_hi, offset_lo, threshold).

A call draws its rng_state from torch's default CUDA generator with one `torch.randint` on the
device (`DropoutArgs.draw`), the way torch.compile's generated kernels take their seeds: no host
sync, so a CUDA graph captures it and every replay draws afresh, and `torch.manual_seed` makes
runs repeatable. The backward rebuilds the same words from the saved rng_state
(docs/semantics.md, Dropout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layouts import philox

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
