"""Tensors made fit for the kernels' 128-bit copies: unit last stride, every other stride and
the base address 16-byte aligned, head dim a multiple of 8 (flash-attn pads it with zeros)."""
import torch

from layouts.traits import ALIGN, COPY_BYTES


def is_aligned(x) -> bool:
    """Do x's rows suit 128-bit copies. Checked without generators: this runs on every call."""
    shape, stride = x.shape, x.stride()
    low_bits = 0
    for s in stride[:-1]:
        low_bits |= s
    return shape[-1] % ALIGN == 0 and stride[-1] == 1 and low_bits % ALIGN == 0 and x.data_ptr() % COPY_BYTES == 0


def aligned(x):
    """x itself when `is_aligned`, else a view or copy that is: zero-padded to a multiple of 8
    in the head dim, as flash-attn pads, or a fresh contiguous copy. A size-1 dim whose stride is
    not a multiple of 8 gets stride 0 (never stepped, and trivially aligned), without a copy."""
    if is_aligned(x):
        return x
    shape, stride = x.shape, x.stride()
    if shape[-1] % ALIGN:
        x = torch.nn.functional.pad(x, (0, ALIGN - shape[-1] % ALIGN))
    elif stride[-1] != 1 or x.data_ptr() % COPY_BYTES or any(
            s % ALIGN for n, s in zip(shape[:-1], stride[:-1]) if n > 1):
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
    if any(s % ALIGN for s in x.stride()[:-1]):  # only size-1 dims can be left here
        x = x.as_strided(x.shape, [s if s % ALIGN == 0 else 0 for s in x.stride()[:-1]] + [1])
    return x
