"""The public API's calls on CPU tensors, shared by the CPU tests of the interface
(tests/cpu/test_interface_validation.py, test_compat.py, test_dropout_api.py): a valid call of
each public function by name, and the seam that stands a recorder in for the launch layer
(`no_gpu_needed`; the `gpu_free` fixture of tests/cpu/conftest.py)."""
import contextlib
import sys
import types

import pytest
import torch

from cute_flash import _validate
from cute_flash import interface as fi

B, SQ, SK, H, HK, D = 2, 5, 7, 4, 2, 64
PAGE, NBLOCKS, MAXBLOCKS, CACHE = 16, 5, 2, 16


def rnd(*shape, dtype=torch.float16):
    return torch.randn(shape).to(dtype)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def valid(name):
    """Keyword arguments of a valid call (on CPU) of the public function `name`."""
    if name == "func":
        return dict(q=rnd(B, SQ, H, D), k=rnd(B, SK, HK, D), v=rnd(B, SK, HK, D))
    if name == "qkvpacked":
        return dict(qkv=rnd(B, SQ, 3, H, D))
    if name == "kvpacked":
        return dict(q=rnd(B, SQ, H, D), kv=rnd(B, SK, 2, HK, D))
    varlen = dict(cu_seqlens_q=i32(0, 3, 5), cu_seqlens_k=i32(0, 4, 7), max_seqlen_q=3,
                  max_seqlen_k=4)
    if name == "varlen":
        return dict(q=rnd(5, H, D), k=rnd(7, HK, D), v=rnd(7, HK, D), **varlen)
    if name == "varlen_paged":
        return dict(q=rnd(5, H, D), k=rnd(NBLOCKS, PAGE, HK, D), v=rnd(NBLOCKS, PAGE, HK, D),
                    block_table=i32(0, 1, 2, 3).view(B, MAXBLOCKS), seqused_k=i32(9, 20),
                    **{**varlen, "max_seqlen_k": 20})
    if name == "varlen_qkvpacked":
        return dict(qkv=rnd(5, 3, H, D), cu_seqlens=i32(0, 3, 5), max_seqlen=3)
    if name == "varlen_kvpacked":
        return dict(q=rnd(5, H, D), kv=rnd(7, 2, HK, D), **varlen)
    if name == "kvcache":
        return dict(q=rnd(B, 1, H, D), k_cache=rnd(B, CACHE, HK, D), v_cache=rnd(B, CACHE, HK, D),
                    k=rnd(B, 1, HK, D), v=rnd(B, 1, HK, D), cache_seqlens=i32(3, 5))
    if name == "kvcache_paged":
        return dict(q=rnd(B, 1, H, D), k_cache=rnd(NBLOCKS, PAGE, HK, D),
                    v_cache=rnd(NBLOCKS, PAGE, HK, D), k=rnd(B, 1, HK, D), v=rnd(B, 1, HK, D),
                    cache_seqlens=i32(3, 20), block_table=i32(0, 1, 2, 3).view(B, MAXBLOCKS))
    raise KeyError(name)


FUNCS = {
    "func": fi.flash_attn_func,
    "qkvpacked": fi.flash_attn_qkvpacked_func,
    "kvpacked": fi.flash_attn_kvpacked_func,
    "varlen": fi.flash_attn_varlen_func,
    "varlen_paged": fi.flash_attn_varlen_func,
    "varlen_qkvpacked": fi.flash_attn_varlen_qkvpacked_func,
    "varlen_kvpacked": fi.flash_attn_varlen_kvpacked_func,
    "kvcache": fi.flash_attn_with_kvcache,
    "kvcache_paged": fi.flash_attn_with_kvcache,
}
# The half-precision tensor arguments of each call; the first is the dtype reference.
HALF_ARGS = {
    "func": ("q", "k", "v"),
    "qkvpacked": ("qkv",),
    "kvpacked": ("q", "kv"),
    "varlen": ("q", "k", "v"),
    "varlen_paged": ("q", "k", "v"),
    "varlen_qkvpacked": ("qkv",),
    "varlen_kvpacked": ("q", "kv"),
    "kvcache": ("q", "k_cache", "v_cache", "k", "v"),
    "kvcache_paged": ("q", "k_cache", "v_cache", "k", "v"),
}
FIRST = {name: args[0] for name, args in HALF_ARGS.items()}
ALL = sorted(FUNCS)
WITH_DROPOUT = [n for n in ALL if not n.startswith("kvcache")]
VARLEN = [n for n in ALL if n.startswith("varlen")]
HALF_CASES = [(n, a) for n in ALL for a in HALF_ARGS[n]]


def call(name, **args):
    return FUNCS[name](**args)


def with_(name, **over):
    return {**valid(name), **over}


# --- the seam -------------------------------------------------------------------------------


class FakeKernels(types.ModuleType):
    """Records each launch and returns outputs of the right shapes, filled with 7."""

    def __init__(self):
        super().__init__("cute_flash.launch")
        self.calls = []

    def _launch(self, fn, args, kwargs, q, lse_shape):
        self.calls.append((fn, args, kwargs))
        return torch.full_like(q, 7), torch.full(lse_shape, 7.0)

    def flash_fwd(self, q, k, v, **kw):
        return self._launch("flash_fwd", (q, k, v), kw, q, (q.shape[0], q.shape[2], q.shape[1]))

    def flash_fwd_varlen(self, q, k, v, **kw):
        return self._launch("flash_fwd_varlen", (q, k, v), kw, q, (q.shape[1], q.shape[0]))

    def flash_fwd_kvcache(self, q, k_cache, v_cache, **kw):
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
        return self._launch("flash_fwd_kvcache", (q, k_cache, v_cache), kw, q, lse_shape)

    def pack_kvcache_queries(self, q, q_pad, lengths, *args):
        """Packed queries' setup: recorded; every packed query's flat row 0."""
        self.calls.append(("pack_kvcache_queries", (q, q_pad, lengths, *args), {}))
        return torch.zeros(q.shape[0], dtype=torch.int64)

    def _backward(self, fn, dout, q, k, v, out, lse, dq=None, dk=None, dv=None, **kw):
        """Gradients filled with 1, 2, 3 (for q, k, v), written into the given tensors as the
        real launcher does."""
        self.calls.append((fn, (dout, q, k, v, out, lse), kw))
        grads = []
        for dest, x, fill in zip((dq, dk, dv), (q, k, v), (1, 2, 3)):
            g = torch.full_like(x, fill)
            grads.append(g if dest is None else dest.copy_(g))
        return (*grads, torch.zeros_like(lse))

    def flash_bwd(self, *args, **kw):
        return self._backward("flash_bwd", *args, **kw)

    def flash_bwd_varlen(self, *args, **kw):
        return self._backward("flash_bwd_varlen", *args, **kw)


@contextlib.contextmanager
def no_gpu_needed():
    with pytest.MonkeyPatch.context() as mp:
        fake = FakeKernels()
        mp.setitem(sys.modules, "cute_flash.launch", fake)
        mp.setattr(_validate, "check_cuda", lambda named: None)
        mp.setattr(fi, "_kvcache_checked", set())  # CPU calls pass only here: remember them only here
        yield fake
