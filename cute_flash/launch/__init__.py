"""The torch side of the kernels: run-time rules, alignment, compiled-kernel lookup, plans,
workspaces and launch on torch tensors. `cute_flash.kernels` holds the device code (CuTe DSL
only); the interface validates and dispatches here.

- `gpu`: the device a call runs on (index, arch, SM count) and the configs' dtype names.
- `args`: a call's options as the kernels take them (scales, window edges, score flags).
- `rng`: a call's dropout state and the words the kernels draw its mask from.
- `policy`: every run-time rule: the kernel path, the Hopper kernels' schedule and choices,
  split counts, the dQ reduction.
- `align`: inputs made fit for 128-bit copies (views when possible, copies otherwise).
- `batch_chunks`: calls over more sequences than a launch grid's y / z holds, in chunks.
- `compiled`: the compiled kernel of any config on a device (`compile.registry` below it).
- `variants`: the configs the dispatcher can choose: the set CI and `compile` build, and all.
- `dense`, `hopper`: the dense and packed-varlen forwards (the SM80 and the Hopper kernel).
- `kvcache`: `flash_attn_with_kvcache`: its per-signature call setup, the split workspace, the
  append launch, and packed queries' (`pack_kvcache_queries`, in the order of the call's query
  fold, `kvcache_query_group`).
- `backward`: the gradients of the dense and packed-varlen forwards.
- `block_sparse`: a FlexAttention BlockMask as the kernels' block lists, at their tile sizes.

The entry points below import their modules (and the CuTe DSL) on first use, so the API layer
can import `rng` without the DSL.
"""
import importlib

_ENTRIES = {"flash_fwd": "dense", "flash_fwd_varlen": "dense", "flash_fwd_kvcache": "kvcache",
            "pack_kvcache_queries": "kvcache", "kvcache_query_group": "kvcache", "flash_bwd": "backward",
            "flash_bwd_varlen": "backward"}

__all__ = ["backward", *_ENTRIES]


def __getattr__(name):
    if name in _ENTRIES:
        return getattr(importlib.import_module(f"{__name__}.{_ENTRIES[name]}"), name)
    if name == "backward":
        return importlib.import_module(f"{__name__}.backward")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
