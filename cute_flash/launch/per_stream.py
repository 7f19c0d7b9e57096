"""Device buffers a launcher keeps from launch to launch, one per stream.

Some kernels leave a buffer ready for their next launch (split-KV arrival counters and the
Hopper forward's tile counter back at zero; partials that each launch overwrites), so a call
can reuse it instead of allocating and zeroing one.

A launch captured into a CUDA graph takes buffers of its own, and its zeroed counters come from
a reserve zeroed before any capture (`zeroed_counters`): zeroing them in the graph would add a
node before the kernel on every replay.
"""
from __future__ import annotations

import functools
import math
import threading

import torch

# int32 counters a device keeps zeroed for captured launches (4 MB). A benchmark's graph holds
# thousands of calls (`do_bench_cudagraph`: as many as fill 100 ms), each taking its tiles'
# counters for good. At 1 << 16, one sequence of 32k keys (8 counters a call) ran out of the
# reserve after the first three graphs of a process, and each later call, its zeros a node of
# their own, ran slower, so the decode bench's figure for it depended on the run; at 1 << 20 it
# held (docs/tuning/decode.md, "The decode bench with the larger counter reserve").
RESERVE_COUNTERS = 1 << 20
_reserves: dict[torch.device, list] = {}  # device -> [reserve, counters handed out]
_reserve_lock = threading.Lock()


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


def zeroed_counters(shape, device: torch.device) -> torch.Tensor:
    """int32 zeros of `shape`, for counters the kernel leaves at zero. Outside a graph capture
    a new tensor; the first such call on a device also zeroes its reserve (and waits for it, so
    that any stream may replay a graph that uses it). A launch being captured takes the next
    unused counters of that reserve, never handed out again, so the graph holds no zeroing node
    (torch.zeros, run before our kernel on every replay; docs/tuning/decode-splits.md, "Counters
    zeroed before the capture"). With no reserve left, or none made, the zeros are captured."""
    count = math.prod(shape)
    if not torch.cuda.is_current_stream_capturing():
        if device not in _reserves:
            with _reserve_lock:  # one reserve a device: a replaced one could be freed under a graph
                if device not in _reserves:
                    reserve = torch.zeros(RESERVE_COUNTERS, dtype=torch.int32, device=device)
                    if reserve.is_cuda:
                        torch.cuda.synchronize(device)
                    _reserves[device] = [reserve, 0]
        return torch.zeros(shape, dtype=torch.int32, device=device)
    with _reserve_lock:
        reserve = _reserves.get(device)
        if reserve is None or reserve[1] + count > RESERVE_COUNTERS:
            return torch.zeros(shape, dtype=torch.int32, device=device)
        start = reserve[1]
        reserve[1] += count
    return reserve[0][start:start + count].view(shape)
