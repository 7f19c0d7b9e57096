"""The torch side of the kernels: alignment, compiled-kernel lookup, plans, workspaces and
launch on torch tensors. `cute_flash.kernels` holds the device code (CuTe DSL only); the
interface validates and dispatches here.

- `align`: inputs made fit for 128-bit copies (views when possible, copies otherwise).
- `batch_chunks`: calls over more sequences than a launch grid's y / z holds, in chunks.
- `compiled`: the compiled kernel of a config on a device (the in-process compile cache),
  the fake arguments a compile needs, and the variant lists CI and `compile` build.
- `dense`: the dense and packed-varlen forwards.
- `kvcache`: `flash_attn_with_kvcache`: its per-signature call setup, the split workspace, the
  append launch.
- `backward`: the gradients of the dense and packed-varlen forwards.
"""
from cute_flash.launch import backward
from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen
from cute_flash.launch.dense import flash_fwd, flash_fwd_varlen
from cute_flash.launch.kvcache import flash_fwd_kvcache

__all__ = ["backward", "flash_fwd", "flash_fwd_varlen", "flash_fwd_kvcache", "flash_bwd", "flash_bwd_varlen"]
