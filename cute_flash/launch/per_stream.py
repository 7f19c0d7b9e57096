"""Device buffers a launcher keeps from launch to launch, one per stream.

Some kernels leave a buffer ready for their next launch (split-KV arrival counters and the
Hopper forward's tile counter back at zero; partials that each launch overwrites), so a call
can reuse it instead of allocating and zeroing one.
"""
from __future__ import annotations

import functools

import torch


def per_stream(make):
    """Decorator for make(*key, device) -> buffer: the result returns one buffer per (key,
    device, stream). Launches on a stream run in order, so they can share it. A launch being
    captured into a CUDA graph gets a fresh one, since the graph may replay beside eager calls.
    `cache_clear()` forgets the kept ones."""
    cached = functools.lru_cache(maxsize=64)(lambda stream, *args: make(*args))

    @functools.wraps(make)
    def get(*args):
        if torch.cuda.is_current_stream_capturing():
            return make(*args)
        return cached(torch._C._cuda_getCurrentRawStream(args[-1].index), *args)

    get.cache_clear = cached.cache_clear
    return get
