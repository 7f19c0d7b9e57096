"""In-memory cache of compiled kernels: one cubin per (kernel configuration, arch).

A key is everything the kernel specialises on at compile time (traits, Constexpr flags) plus
the target arch; run-time values (lengths, strides, scales, window sizes) never enter it, so a
model's whole run typically compiles a handful of kernels once.
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable

_cache: dict[Hashable, object] = {}
_lock = threading.Lock()


def get_or_compile(key: Hashable, build: Callable[[], object]):
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = _cache[key] = build()
    return fn

