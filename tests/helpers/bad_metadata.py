"""Calls whose metadata points outside the tensors they come with, one per kind the kernels must
survive: block ids outside [0, num_blocks), cache lengths beyond capacity (inside a CUDA graph,
where the host check cannot run), negative lengths, cache_batch_idx out of range, cache_leftpad
past the length, cu_seqlens that decrease or pass the packed total, seqused_k past the sequence,
rotary positions past the cos/sin table; packed backwards and dropout (forward and backward,
contiguous and paged keys) on both kernel paths. The output of such a call is undefined; what
must hold is that no kernel reads or writes outside its tensors.

Each case checks what it can by itself: every tensor a kernel writes, the caller's and those
the library allocates (`Guarded`), sits between guard elements that must come back unchanged,
and the values are far enough out (2**30) that an unclamped read would fault, not land in a
neighbouring allocation. Reads just past a tensor only compute-sanitizer sees: `python -m
tests.helpers.bad_metadata [case ...]` runs the cases and is what tests/gpu/test_bad_metadata_gpu.py runs
under `compute-sanitizer --tool memcheck`, with torch's caching allocator off so that each
tensor is its own allocation. CUDA graph capture needs that allocator, so the graph case is
skipped (`Skipped`) in such a process and run in another.
"""
import contextlib
import math
import os
import sys

import torch

from cute_flash import flash_attn_varlen_func, flash_attn_with_kvcache

HUGE = 1 << 30
GUARD = 4096  # elements on each side of a guarded tensor
SENTINEL = 7.0  # exact in fp16/bf16, and not what any kernel here writes by chance
DTYPE = torch.bfloat16


class Guarded:
    """Tensors carved out of buffers with SENTINEL guards on both sides: the inputs a case makes
    with `g(*shape)`, and, inside `with g:`, every CUDA tensor the library allocates (out, lse,
    gradients, split workspaces, dQ accumulators: torch.empty / zeros / full and their _like
    forms), so a kernel writing past any tensor it was handed or made for itself is caught."""

    _ALLOCATORS = ("empty", "zeros", "full", "empty_like", "zeros_like")

    def __init__(self):
        self.buffers = []
        self._saved = {}

    def __call__(self, *shape, dtype=DTYPE, fill="randn"):
        """A guarded (shape) tensor: normal values, `fill`'s value, or (None) the sentinel."""
        n = math.prod(shape)
        full = self._saved.get("full", torch.full)
        buf = full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device="cuda")
        t = buf[GUARD:GUARD + n].view(shape)
        if fill == "randn":
            t.normal_()
        elif fill is not None:
            t.fill_(fill)
        self.buffers.append(buf)
        return t

    def _allocator(self, name):
        original = self._saved[name]

        def allocate(*args, **kwargs):
            if name.endswith("_like"):
                ref = args[0]
                shape, dtype, device = ref.shape, kwargs.get("dtype") or ref.dtype, kwargs.get("device") or ref.device
            else:
                sized = name == "full" or (len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)))
                shape = tuple(args[0]) if sized else args
                dtype, device = kwargs.get("dtype") or torch.get_default_dtype(), kwargs.get("device", "cpu")
            if torch.device(device).type != "cuda":
                return original(*args, **kwargs)
            if name == "full":
                fill = args[1] if len(args) > 1 else kwargs["fill_value"]
            else:
                fill = 0 if name.startswith("zeros") else None  # empty: the sentinel inside too, as garbage
            return self(*shape, dtype=dtype, fill=fill)

        return allocate

    def __enter__(self):
        self._saved = {name: getattr(torch, name) for name in self._ALLOCATORS}
        for name in self._ALLOCATORS:
            setattr(torch, name, self._allocator(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch, name, fn)
        self._saved = {}
        return False

    def check(self):
        torch.cuda.synchronize()
        for buf in self.buffers:
            for guard in (buf[:GUARD], buf[-GUARD:]):
                assert (guard == SENTINEL).all(), "a kernel wrote outside its tensor"


def i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def i32_cpu(*values):
    """Metadata made at import, before any CUDA use: moved to the GPU by the case."""
    return torch.tensor(values, dtype=torch.int32)


def _cache_call(g, cache_rows=64, b=2, h=4, hk=2, d=64, seqlen_new=3, sq=None, **opts):
    """flash_attn_with_kvcache on guarded tensors (contiguous caches unless block_table is given)."""
    sq = (seqlen_new or 1) if sq is None else sq
    pages = (opts.pop("num_blocks", 8), opts.pop("page_size", 16))
    k_cache = g(*pages, hk, d) if opts.get("block_table") is not None else g(b + 1, cache_rows, hk, d)
    v_cache = g(*k_cache.shape)
    q = g(b, sq, h, d)
    k = v = None
    if seqlen_new:
        k, v = g(b, seqlen_new, hk, d), g(b, seqlen_new, hk, d)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **opts)
    g.check()
    return out


def kvcache_seqlens_past_capacity():
    with Guarded() as g:
        for splits in (1, 0, 7):
            _cache_call(g, cache_seqlens=i32(1000, HUGE), num_splits=splits)
            _cache_call(g, cache_seqlens=i32(62, 64), num_splits=splits, causal=True)  # + 3 appended rows


def kvcache_negative_seqlens():
    with Guarded() as g:
        _cache_call(g, cache_seqlens=i32(-5, -HUGE))
        _cache_call(g, cache_seqlens=i32(-1, 3), seqlen_new=0, num_splits=4)


def kvcache_batch_idx_out_of_range():
    with Guarded() as g:
        for idx in (i32(-1, HUGE), i32(3, -HUGE)):
            _cache_call(g, cache_seqlens=i32(5, 60), cache_batch_idx=idx)
            _cache_call(g, cache_seqlens=i32(5, 60), cache_batch_idx=idx, seqlen_new=0, num_splits=3)


def kvcache_leftpad_past_length():
    with Guarded() as g:
        _cache_call(g, cache_seqlens=i32(10, 20), cache_leftpad=i32(100, HUGE))
        _cache_call(g, cache_seqlens=i32(10, 20), cache_leftpad=i32(-50, -HUGE), causal=True)
        _cache_call(g, cache_seqlens=i32(10, 1000), cache_leftpad=i32(11, 500), seqlen_new=0, num_splits=5)


def _rotary(rows, d, dtype=DTYPE):
    angle = torch.rand(rows, d // 2, device="cuda")
    return angle.cos().to(dtype), angle.sin().to(dtype)


def kvcache_rotary_positions_past_table():
    """q rows are rotated at cache_seqlens + i (causal): with more query rows than appended
    ones, or with bad lengths, those positions pass the cos/sin table."""
    with Guarded() as g:
        cos, sin = _rotary(64, 64)
        _cache_call(g, cache_seqlens=i32(60, 61), sq=20, seqlen_new=3, rotary_cos=cos, rotary_sin=sin, causal=True)
        _cache_call(g, cache_seqlens=i32(-HUGE, HUGE), rotary_cos=cos, rotary_sin=sin, causal=True)


def paged_kvcache_bad_block_ids():
    with Guarded() as g:
        for page_size, num_blocks in ((16, 8), (5, 20)):
            table = i32(-1, HUGE, 8, -HUGE, 0, 1 << 20, 7, 2).view(2, 4)
            for splits in (1, 0):
                _cache_call(g, cache_seqlens=i32(4 * page_size - 3, 2), block_table=table, page_size=page_size,
                            num_blocks=num_blocks, num_splits=splits)


class Skipped(Exception):
    """A case this process's set-up cannot run."""


def paged_kvcache_seqlens_past_table():
    """A one-column table with cache_seqlens past its page, straight to the launcher: the
    interface would refuse it on the host (flash-attn's RuntimeError), the kernels must clamp."""
    from cute_flash.launch import flash_fwd_kvcache

    for page_size in (256, 24):
        with Guarded() as g:
            k_cache, v_cache = g(4, page_size, 1, 64), g(4, page_size, 1, 64)
            q, k, v = g(1, 1, 1, 64), g(1, 1, 1, 64), g(1, 1, 1, 64)
            table = i32(0).view(1, 1)
            for bad in (page_size + 1, page_size, HUGE, -HUGE):
                for new in ((None, None), (k, v)):
                    flash_fwd_kvcache(q, k_cache, v_cache, k=new[0], v=new[1], cache_seqlens=i32(bad),
                                      block_table=table, softmax_scale=0.125)
                    g.check()


def paged_kvcache_seqlens_past_table_in_graph():
    """The same where the host check cannot run: inside a CUDA graph. Captured with good
    lengths, replayed with bad ones, as a server replays a decode graph."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        raise Skipped("CUDA graph capture needs torch's caching allocator")
    for page_size in (256, 24):
        with Guarded() as g:
            k_cache, v_cache = g(4, page_size, 1, 64), g(4, page_size, 1, 64)
            q, k, v = g(1, 1, 1, 64), g(1, 1, 1, 64), g(1, 1, 1, 64)
            seqlens = i32(page_size - 1)
            table = i32(0).view(1, 1)
            for append in (False, True):
                def step():
                    return flash_attn_with_kvcache(q, k_cache, v_cache, k if append else None, v if append else None,
                                                   cache_seqlens=seqlens, block_table=table)
                step()  # compile and warm up outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                for bad in (page_size + 1, page_size, HUGE, -HUGE):
                    seqlens.fill_(bad)
                    graph.replay()
                    g.check()
                seqlens.fill_(page_size - 1)


def varlen_cu_seqlens_out_of_order():
    with Guarded() as g:
        q, k, v = g(60, 4, 64), g(70, 2, 64), g(70, 2, 64)
        for cu_q, cu_k in ((i32(0, 50, 10, 60), i32(0, 70, 20, 70)),
                           (i32(0, 30, 60, HUGE), i32(0, 30, HUGE, HUGE)),
                           (i32(-HUGE, 10, 20, 60), i32(-5, 70, -HUGE, 70))):
            for causal in (False, True):
                flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=causal)
                g.check()


def varlen_seqused_k_past_sequence():
    with Guarded() as g:
        q, k, v = g(60, 4, 64), g(70, 2, 64), g(70, 2, 64)
        cu_q, cu_k = i32(0, 20, 40, 60), i32(0, 30, 50, 70)
        for used in (i32(HUGE, 71, 40), i32(-3, -HUGE, 0)):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 30, seqused_k=used)
            g.check()


def varlen_paged_bad_metadata():
    with Guarded() as g:
        for page_size in (16, 5):
            q = g(60, 4, 64)
            k_pages, v_pages = g(8, page_size, 2, 64), g(8, page_size, 2, 64)
            cu_q = i32(0, 20, 40, 60)
            table = i32(-1, HUGE, 8, -HUGE, 0, 1 << 20, 7, 2, 3).view(3, 3)
            for cu_k, used in ((i32(0, 3 * page_size, 6 * page_size, 9 * page_size), None),  # bad ids only
                               (i32(0, HUGE, HUGE, HUGE), None),                              # lengths past the table
                               (i32(0, 10, 5, -HUGE), i32(HUGE, 40, -7))):
                flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 20, 64, block_table=table, seqused_k=used,
                                       causal=True)
                g.check()


@contextlib.contextmanager
def _path(path):
    """CUTE_FLASH_ARCH_PATH=path inside ("default": unset, the sm_90 Hopper kernels where they apply)."""
    before = os.environ.pop("CUTE_FLASH_ARCH_PATH", None)
    if path != "default":
        os.environ["CUTE_FLASH_ARCH_PATH"] = path
    try:
        yield
    finally:
        os.environ.pop("CUTE_FLASH_ARCH_PATH", None)
        if before is not None:
            os.environ["CUTE_FLASH_ARCH_PATH"] = before


BAD_CU_SEQLENS = ((i32_cpu(0, 50, 10, 60), i32_cpu(0, 70, 20, 70)),
                  (i32_cpu(0, 30, 60, HUGE), i32_cpu(0, 30, HUGE, HUGE)),
                  (i32_cpu(-HUGE, 10, 20, 60), i32_cpu(-5, 70, -HUGE, 70)))


def varlen_backward_bad_metadata():
    """The packed backward (preprocess, main kernel, dQ convert) over bad prefix sums and
    seqused_k, its gradients and workspaces guarded, forward on both paths."""
    for path in ("default", "sm80"):
        with _path(path), Guarded() as g:
            q, k, v = (x.requires_grad_() for x in (g(60, 4, 64), g(70, 2, 64), g(70, 2, 64)))
            dout = g(60, 4, 64)
            for cu_q, cu_k in BAD_CU_SEQLENS:
                for used in (None, i32(HUGE, -7, 40)):
                    out = flash_attn_varlen_func(q, k, v, cu_q.cuda(), cu_k.cuda(), 64, 64, causal=True,
                                                 seqused_k=used, window_size=(9, 0), softcap=5.0)
                    out.backward(dout)
                    g.check()


def varlen_dropout_bad_metadata():
    """Dropout forwards and backwards over bad prefix sums (contiguous and paged keys), both paths."""
    for path in ("default", "sm80"):
        with _path(path), Guarded() as g:
            q, k, v = (x.requires_grad_() for x in (g(60, 4, 64), g(70, 2, 64), g(70, 2, 64)))
            dout = g(60, 4, 64)
            for cu_q, cu_k in BAD_CU_SEQLENS:
                out = flash_attn_varlen_func(q, k, v, cu_q.cuda(), cu_k.cuda(), 64, 64, dropout_p=0.3)
                out.backward(dout)
                g.check()
            k_pages, v_pages = g(8, 16, 2, 64), g(8, 16, 2, 64)
            table = i32(-1, HUGE, 8, -HUGE, 0, 1 << 20, 7, 2, 3).view(3, 3)
            with torch.no_grad():
                for cu_q, cu_k in BAD_CU_SEQLENS:
                    flash_attn_varlen_func(q, k_pages, v_pages, cu_q.cuda(), cu_k.cuda(), 20, 64, block_table=table,
                                           dropout_p=0.2, causal=True)
                    g.check()


CASES = {f.__name__: f for f in (
    kvcache_seqlens_past_capacity, kvcache_negative_seqlens, kvcache_batch_idx_out_of_range,
    kvcache_leftpad_past_length, kvcache_rotary_positions_past_table, paged_kvcache_bad_block_ids,
    paged_kvcache_seqlens_past_table, paged_kvcache_seqlens_past_table_in_graph, varlen_cu_seqlens_out_of_order,
    varlen_seqused_k_past_sequence, varlen_paged_bad_metadata, varlen_backward_bad_metadata,
    varlen_dropout_bad_metadata,
)}


def main(names):
    for name in names or CASES:
        try:
            CASES[name]()
        except Skipped as why:
            print(f"skipped: {name}: {why}", flush=True)
        else:
            print(f"survived: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
