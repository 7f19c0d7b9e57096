"""What every benchmark section measures with: the timers, the peers' callables (torch SDPA's
backends, flash-attn-4 when importable), our kernel path, and the FLOPs a mask leaves."""
from __future__ import annotations

import contextlib


def visible_pairs(sq: int, sk: int, causal: bool, window=(-1, -1)) -> int:
    """Number of (query, key) pairs the mask leaves visible (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(sq):
        lo = 0 if left < 0 else max(0, i + sk - sq - left)
        hi = sk - 1 if right < 0 else min(sk - 1, i + sk - sq + right)
        total += max(0, hi - lo + 1)
    return total


def time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def grad_ms(fn, leaves, dout):
    """Forward + backward ms of fn(*leaves) -> out through autograd (`torch.autograd.grad`), or
    None where fn refuses the inputs, forward or backward (flash-attn-4 runs a score_mod's
    backward only given its hand-written derivative)."""
    import torch

    def step():
        return torch.autograd.grad(fn(*leaves), leaves, dout)

    try:
        step()
    except (RuntimeError, AssertionError, ValueError, TypeError):
        return None
    return time_ms(step)


def graph_time_ms(fn):
    """Median time of `fn` replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`: it
    warms `fn` up outside the capture): the GPU's time without the host's, as a decode loop
    under CUDA graphs sees it. None if `fn` cannot be captured."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except RuntimeError:
        return None


def sdpa(q, k, v, backend, causal, enable_gqa=False):
    """SDPA on (b, s, h, d) tensors through one backend, or None where it refuses them."""
    import torch
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = {"enable_gqa": True} if enable_gqa else {}  # a keyword torch < 2.5 does not know

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)

    try:
        run()
        return run
    except RuntimeError:
        return None


@contextlib.contextmanager
def arch_path(path):
    """Our calls inside take the `CUTE_FLASH_ARCH_PATH=path` kernels."""
    import os

    before = os.environ.get("CUTE_FLASH_ARCH_PATH")
    os.environ["CUTE_FLASH_ARCH_PATH"] = path
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUTE_FLASH_ARCH_PATH"]
        else:
            os.environ["CUTE_FLASH_ARCH_PATH"] = before


def hopper_gpu() -> bool:
    """The current GPU is sm_90 (False without one: `tune --splits` runs on the CPU in tests)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def fa4_func():
    """flash-attn-4's `flash_attn_func` (CuTe DSL, Hopper kernels on sm_90) when importable, as
    fn(q, k, v, causal) -> out (it returns (out, lse)), else None."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)[0]


def fa4_varlen_func():
    """flash-attn-4's `flash_attn_varlen_func` when importable, as fn(q, k, v, cu_seqlens,
    max_seqlen, causal) -> out (the same prefix sums for queries and keys), else None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    return lambda q, k, v, cu, smax, causal: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=smax, max_seqlen_k=smax, causal=causal)[0]
