"""Dropout's run-time state as the kernels read it (kernels/philox.py:Dropout.load): the Philox
key (a 64-bit seed), the offset's low 32 bits and the 16-bit keep threshold of p, as a (4,)
uint32 CUDA tensor (docs/semantics.md, Dropout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cute_flash import philox


@dataclass(frozen=True)
class DropoutArgs:
    """What one call draws its mask from: probability p in (0, 1), the generator's seed and offset."""
    p: float
    seed: int
    offset: int

    def __post_init__(self):
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"dropout p must be in (0, 1) here (p = 0 compiles no dropout), got {self.p!r}")
        if philox.keep_threshold(self.p) == 0:
            raise ValueError(f"dropout p = {self.p!r} keeps nothing at 16-bit resolution (p must be below 1 - 2^-17)")

    def rng_tensor(self, device) -> torch.Tensor:
        key_lo, key_hi = philox.split_seed(self.seed)
        words = [key_lo, key_hi, self.offset & philox.MASK32, philox.keep_threshold(self.p)]
        return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.uint32).to(device)


def rng_of(dropout: DropoutArgs | None, device):
    """The kernels' mRng argument: None without dropout (compiled as absent)."""
    return None if dropout is None else dropout.rng_tensor(device)
