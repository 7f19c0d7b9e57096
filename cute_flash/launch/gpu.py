"""The GPU a call runs on: its index, compute capability and SM count, and the names the
kernel configs give torch's dtypes."""
from __future__ import annotations

import functools

import torch

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> int:
    """The GPU's compute capability as 80, 86, 89, 90, ...; refuses GPUs before sm_80 (the
    kernels need cp.async and bf16 mma.sync), as flash-attn 2 does."""
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        raise RuntimeError(f"cute-flash needs an Ampere (sm_80) or newer GPU; device {index} is sm_{major}{minor}")
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
