"""Helpers shared by the GPU tests: hypothesis settings, poisoned allocations and the error
criterion of docs/semantics.md."""
import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

UNDER_MEMCHECK = os.environ.get("CUTE_FLASH_MEMCHECK") == "1"  # set by the sanitizer commands
# The memcheck run switches torch's caching allocator off (each tensor its own cudaMalloc, so
# the tool sees each one's bounds); racecheck keeps it.
NO_CACHING_ALLOCATOR = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"
# A CUDA graph's capture needs the caching allocator (no cudaMalloc while a stream captures).
captures_graph = pytest.mark.skipif(NO_CACHING_ALLOCATOR, reason="captures a CUDA graph: needs the caching allocator")
# `poison_allocator` fills the caching allocator's free blocks: with no cache there are none.
poisons_the_cache = pytest.mark.skipif(NO_CACHING_ALLOCATOR,
                                       reason="checks the caching allocator's poisoning: the allocator is off")


@contextlib.contextmanager
def only_the_hopper_kernel(monkeypatch, kernels: set, part: str, what: str):
    """The body of a Hopper test module's autouse fixture: skipped off sm_90, the default path
    for the test, and after it the `kernels` fixture's record holds the Hopper `part` ("fwd" or
    "bwd") kernel and not the SM80 one (a silent fall back would pass the comparison); `what`
    names the calls in the message."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernel is sm_90a")
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)  # the default path
    yield
    assert f"sm90_{part}" in kernels and f"sm80_{part}" not in kernels, f"the {what} that ran: {sorted(kernels)}"


def config_lookups(monkeypatch, config_type, field=lambda config: config) -> list:
    """`field` of each config of `config_type` the test's calls look up at the compiled-kernel
    seam (`launch.compiled.kernel_for`), in order: which variant of a kernel the calls launched."""
    from cute_flash.launch import compiled

    seen, lookup = [], compiled.kernel_for

    def record(config, *args, **kwargs):
        if isinstance(config, config_type):
            seen.append(field(config))
        return lookup(config, *args, **kwargs)

    monkeypatch.setattr(compiled, "kernel_for", record)
    return seen


def on_path(path: str, *parts: str) -> set:
    """What the `kernels` fixture records when calls of `parts` ("fwd", "bwd") run on `path`:
    "sm80" (`CUTE_FLASH_ARCH_PATH=sm80`) the SM80 kernels; "sm90" or "default" the Hopper ones
    on an sm_90 GPU, the SM80 ones on any other."""
    hopper = path != "sm80" and torch.cuda.get_device_capability()[0] == 9
    return {f"{'sm90' if hopper else 'sm80'}_{part}" for part in parts}


def backward_on_path(path: str, head_dim: int) -> set:
    """What the `kernels` fixture records for a backward (dense or packed) on `path` whose
    kernels take `head_dim`: the Hopper backward in the buckets it serves
    (`layouts.hopper.BWD_SERVES`) where `on_path` takes the Hopper kernels, the SM80 one
    otherwise."""
    from layouts.hopper import BWD_SERVES
    from layouts.traits import head_dim_bucket

    hopper = on_path(path, "bwd") == {"sm90_bwd"} and head_dim_bucket(head_dim) in BWD_SERVES
    return {"sm90_bwd" if hopper else "sm80_bwd"}


def gpu_settings(max_examples: int):
    """Hypothesis settings of a GPU test: `max_examples` shapes, a quarter of them under
    compute-sanitizer (every kernel launch runs instrumented), no deadline (compiles)."""
    n = max(2, max_examples // 4) if UNDER_MEMCHECK else max_examples
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck))

from cute_flash.reference import attention_ref


def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Fill the caching allocator's free memory with NaN, so that an output element the kernel
    fails to write reads back as NaN (outputs come from torch.empty). Free segments go back to
    the driver first (so the cache does not grow from call to call); then every free block left
    (in segments that hold live tensors) is taken by a NaN tensor of its exact size, which the
    allocator's best fit hands out, and `nbytes` of fresh large blocks and 16 MB of fresh small
    ones are filled too: requests of 1 MB or less come from the small pool's 2 MB segments, so a
    large NaN block alone leaves small outputs holding stale values."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    here = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream
    free = [b["size"] for seg in torch.cuda.memory_snapshot() if (seg["device"], seg["stream"]) == here
            for b in seg["blocks"] if b["state"] == "inactive"]
    junk = [torch.full((size // 4,), float("nan"), device="cuda", dtype=torch.float32) for size in free]
    junk.append(torch.full((nbytes // 4,), float("nan"), device="cuda", dtype=torch.float32))
    junk += [torch.full((1 << 18,), float("nan"), device="cuda", dtype=torch.float32) for _ in range(16)]
    del junk
    torch.cuda.synchronize()


def one_step(ref: torch.Tensor) -> torch.Tensor:
    """float32, per element: the spacing of `ref`'s dtype just above |ref| (0 where ref is 0).

    The reference's output is rounded to the input dtype, as the kernel's is; where both float32
    results sit near one rounding boundary they round to neighbours, a difference of one step
    whatever the bar says (one bf16 step at 0.1 is 4.9e-4)."""
    mantissa, exponent = torch.frexp(ref.float())  # |mantissa| in [0.5, 1)
    step = torch.ldexp(torch.full_like(mantissa, torch.finfo(ref.dtype).eps), exponent - 1)
    return step.masked_fill(ref == 0, 0.0)


def assert_output_matches(out, ref, q, k, v, ref_fn=attention_ref, **opts):
    """The output half of `assert_matches_reference`, given the float32 reference `ref` (the
    backward tests take it from the reference run their gradients come from). Returns (max
    error, bar)."""
    ref_lp, _ = ref_fn(q, k, v, upcast=False, **opts)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    if out.numel() == 0:  # no query rows (e.g. a packed batch of empty sequences): nothing to compare
        return 0.0, 0.0
    assert not out.isnan().any(), "unwritten or NaN output elements"
    diff = (out.float() - ref.float()).abs()
    bar = 2 * (ref_lp.float() - ref.float()).abs().max().item() + 1e-5
    over = diff > torch.clamp(one_step(ref), min=bar)
    err = diff.max().item()
    assert not over.any(), f"max abs error {err:.3e} > {bar:.3e} (and more than one step of the dtype)"
    return err, bar


def assert_matches_reference(out, lse, q, k, v, ref_fn=attention_ref, **opts):
    """docs/semantics.md's criterion: |out - ref| <= 2 * max |ref_in_dtype - ref| + 1e-5, or one
    step of the dtype at ref; LSE within 1e-3; the same +inf rows."""
    ref, ref_lse = ref_fn(q, k, v, **opts)
    assert lse.shape == ref_lse.shape
    err, bar = assert_output_matches(out, ref, q, k, v, ref_fn, **opts)
    if out.numel() == 0:
        return err, bar
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE +inf rows differ"
    assert (lse[~fin] == float("inf")).all()
    if fin.any():
        lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert lse_err <= 1e-3, f"LSE error {lse_err:.3e}"
    return err, bar


def cu_seqlens(lengths):
    """int32 prefix sums (batch + 1,) of per-sequence lengths, on the GPU."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def varlen_attention(q, k, v, cu_q, cu_k, lq, lk, **opts):
    """flash_attn_varlen_func on a poisoned allocator: (out, lse)."""
    from cute_flash import flash_attn_varlen_func

    poison_allocator()
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True, **opts)
    torch.cuda.synchronize()
    return out, lse


def captured_nodes(fn) -> list[int]:
    """The node types (CUgraphNodeType: 0 kernel, 2 memset, ...) of a CUDA graph that captures
    one call of fn (run once eagerly before, as graph users warm up), read with the driver's
    cuGraphGetNodes / cuGraphNodeGetType."""
    import ctypes

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    libcuda = ctypes.CDLL("libcuda.so.1")
    handle, count = ctypes.c_void_p(graph.raw_cuda_graph()), ctypes.c_size_t(0)
    assert libcuda.cuGraphGetNodes(handle, None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert libcuda.cuGraphGetNodes(handle, nodes, ctypes.byref(count)) == 0
    types = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        assert libcuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
        types.append(kind.value)
    return types


def assert_counters_zeroed_before_capture(call, monkeypatch):
    """A launch whose counters come from `per_stream.zeroed_counters`, captured into a CUDA
    graph: one kernel node while the reserve (zeroed by an eager call before the capture) has
    counters left; without a reserve the zeroing is captured too, a node more."""
    from cute_flash.launch import per_stream

    assert captured_nodes(call) == [0]  # one kernel
    monkeypatch.setattr(per_stream, "_reserves", {})  # as if no eager call had made one
    nodes = captured_nodes(call)
    assert len(nodes) == 2 and 0 in nodes, nodes  # the kernel, and the zeroing before it
