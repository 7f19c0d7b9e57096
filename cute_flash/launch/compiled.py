"""The compiled kernel of a config on a device: one lookup for every kernel, memoised per
(config, device) so that a launch hashes its config once (`compile.registry.cached` below it:
the compile cache in memory and on disk, then a compile)."""
from __future__ import annotations

import functools

from cute_flash.compile.registry import cached
from cute_flash.launch import gpu


@functools.lru_cache(maxsize=None)
def kernel_for(config, device_index: int):
    """The TVM-FFI function of `config` (any kernel's) for the device's arch, called positionally."""
    return cached(config, gpu.device_arch(device_index))
