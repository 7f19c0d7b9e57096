"""Block sparsity (`block_mask=`, a FlexAttention BlockMask of the mask_mod): the library's masks
with their block masks against `cute_flash.reference` on both paths, at BlockMask block sizes
other than our tiles, forward and gradients; and that the kernels do skip the blocks a mask
calls empty and run the full ones without the mask_mod. Each test asserts the kernels that ran,
every one of them its block-sparse variant."""
import operator

import cutlass.cute as cute
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from cute_flash import flash_attn_func, mods
from cute_flash.launch import compiled, dense
from tests.helpers import forward
from tests.helpers.backward import assert_grads_match, ours
from tests.helpers.gpu_utils import assert_matches_reference, on_path, poison_allocator

pytestmark = pytest.mark.gpu

B, S, H, HK = 2, 700, 4, 2


@pytest.fixture
def sparse_forwards(monkeypatch):
    """The block-sparse flag of every attention kernel looked up (a list, in order): SM80
    forwards at `dense.fwd_kernel` (which memoises them per call signature, flags included), the
    others at `compiled.kernel_for`."""
    from cute_flash.kernels.sm80.fwd import FwdConfig

    flags = []
    lookup, sm80_lookup = compiled.kernel_for, dense.fwd_kernel

    def record(config, index):
        if hasattr(config, "block_sparse") and not isinstance(config, FwdConfig):
            flags.append(config.block_sparse)
        return lookup(config, index)

    def record_sm80(*args):
        flags.append(dict(args[-1]).get("block_sparse", False))
        return sm80_lookup(*args)

    monkeypatch.setattr(compiled, "kernel_for", record)
    monkeypatch.setattr(dense, "fwd_kernel", record_sm80)
    return flags


def take_path(request, monkeypatch, kernels, sparse_forwards, parts):
    """The SM80 kernels (`CUTE_FLASH_ARCH_PATH=sm80`) or the default path's; after the test, the
    kernels of `parts` that ran are the path's, each its block-sparse variant."""
    if request.param == "sm80":
        monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    else:
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    yield request.param
    assert kernels == on_path(request.param, *parts), f"the kernels that ran: {sorted(kernels)}"
    assert sparse_forwards == [True] * len(kernels), "the kernels run their block-sparse variants"


@pytest.fixture(params=["sm80", "default"])
def path(request, monkeypatch, kernels, sparse_forwards):
    yield from take_path(request, monkeypatch, kernels, sparse_forwards, ("fwd",))


@pytest.fixture(params=["sm80", "default"])
def grad_path(request, monkeypatch, kernels, sparse_forwards):
    yield from take_path(request, monkeypatch, kernels, sparse_forwards, ("fwd", "bwd"))


def library(device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(0)
    docs = torch.cumsum(torch.rand(B, S, generator=gen) < 0.004, 1).to(torch.int32).to(device)
    return {
        "document": mods.document_mask(docs),
        "prefix_lm": mods.prefix_lm(torch.tensor([100, 333], dtype=torch.int32, device=device)),
        "window_sinks": mods.sliding_window_with_sinks(128, 4),
    }


def inputs(d, seed=0, s=S):
    torch.manual_seed(seed)
    return forward.inputs(B, s, s, H, HK, d, torch.bfloat16)


@pytest.mark.parametrize("name", list(library("cpu")))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("block_size", [128, 64, 256])
def test_library_masks_with_their_block_masks_match_reference(path, name, d, block_size):
    spec = library()[name]
    q, k, v = inputs(d)
    heads = 1 if name != "document" else H  # one mask for every head, or one per head
    block_mask = spec.block_mask(B, heads, S, S, block_size=block_size)
    poison_allocator()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **spec.kwargs(), block_mask=block_mask)
    torch.cuda.synchronize()
    assert_matches_reference(out, lse, q, k, v, **spec.ref_kwargs())


def test_gradients_with_a_block_mask_match_reference(grad_path):
    spec = library()["document"]
    q, k, v = inputs(128, seed=1)
    dout = torch.randn_like(q)
    block_mask = spec.block_mask(B, 1, S, S)
    out, grads = ours(lambda q, k, v: flash_attn_func(q, k, v, **spec.kwargs(), block_mask=block_mask), dout, q, k, v)
    assert_grads_match(grads, q, k, v, dout, out=out, **spec.ref_kwargs())


@cute.jit
def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return operator.ge(q_idx, kv_idx)


def listed_as(status: str, sq=S, sk=S):
    """A BlockMask over (sq, sk) that calls every block `status` ("empty" or "full"), whatever the mask."""
    keep = status == "full"
    return create_block_mask(lambda b, h, q, kv: (q >= 0) if keep else (q < 0), 1, 1, sq, sk, device="cuda")


def test_the_forward_skips_what_the_block_mask_calls_empty(path):
    """A block mask that lists no block for a causal mask_mod: the forward visits no key (output
    0, LSE +inf, as rows with no key), so the lists, not the mask, decide what runs."""
    q, k, v = inputs(64)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, mask_mod=causal, block_mask=listed_as("empty"))
    assert out.abs().max().item() == 0 and bool((lse == float("inf")).all())


def test_the_forward_runs_full_blocks_without_the_mask_mod(path):
    """A block mask that calls every block full beside a causal mask_mod: the mask_mod is not
    evaluated, so the output is the unmasked attention's. 768 = 6 x 128: FlexAttention calls a
    block the sequence ends inside partial, whatever the mask."""
    q, k, v = inputs(128, s=768)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, mask_mod=causal,
                                  block_mask=listed_as("full", 768, 768))
    assert_matches_reference(out, lse, q, k, v)


def test_causal_as_a_block_sparse_mask_mod_matches_the_flag(path):
    q, k, v = inputs(128, seed=2)
    block_mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, 1, 1, S, S, device="cuda")
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, mask_mod=causal, block_mask=block_mask)
    assert_matches_reference(out, lse, q, k, v, causal=True)


def test_the_hopper_backward_runs_full_blocks_without_the_mask_mod(kernels, sparse_forwards, monkeypatch):
    """As the forward: a block mask that calls every block full beside a causal mask_mod gives
    the unmasked attention's gradients."""
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    q, k, v = inputs(128, seed=3, s=768)
    dout = torch.randn_like(q)
    block_mask = listed_as("full", 768, 768)
    out, grads = ours(lambda q, k, v: flash_attn_func(q, k, v, mask_mod=causal, block_mask=block_mask), dout, q, k, v)
    assert kernels == {"sm90_fwd", "sm90_bwd"} and sparse_forwards == [True, True]
    assert_grads_match(grads, q, k, v, dout, out=out)
