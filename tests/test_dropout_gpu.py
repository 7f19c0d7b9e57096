"""Dropout in the SM80 forward (kernels/philox.py:Dropout, FwdConfig.has_dropout) against
`cute_flash.reference` computed with the mask `philox.keep_mask` draws for the same seed and
offset (docs/semantics.md, Dropout): a wrong counter, word, threshold or scale in any element
moves the output far past the criterion. Reached through `launch.dense` (the public functions
still refuse dropout_p > 0 until these pass)."""
import functools

import pytest
import torch

from cute_flash import philox
from cute_flash.reference import attention_ref
from tests.gpu_utils import assert_matches_reference, poison_allocator

pytestmark = pytest.mark.gpu


def _mask(seed, offset, b, h, sq, sk, p):
    return torch.from_numpy(philox.keep_mask(seed, offset, b, h, sq, sk, p)).cuda()


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("b, sq, sk, h, hk, d, opts", [
    (2, 257, 300, 4, 2, 64, {}),
    (1, 513, 129, 6, 3, 128, dict(causal=True)),
    (3, 100, 700, 8, 1, 96, dict(window_size=(200, 30), softcap=15.0)),
], ids=["d64-gqa", "d128-causal", "d96-window-softcap"])
def test_dense_dropout_matches_reference(p, b, sq, sk, h, hk, d, opts):
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.dropout import DropoutArgs

    seed, offset = 0x1234_5678_9ABC, 40
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    poison_allocator()
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, dropout=DropoutArgs(p, seed, offset), **opts)
    torch.cuda.synchronize()
    ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=_mask(seed, offset, b, h, sq, sk, p))
    assert_matches_reference(out, lse, q, k, v, ref_fn=ref, **opts)


def test_varlen_dropout_counts_rows_and_columns_per_sequence():
    from cute_flash.launch.dense import flash_fwd_varlen
    from cute_flash.launch.dropout import DropoutArgs

    lengths_q, lengths_k, h, d, p, seed, offset = [70, 1, 300], [90, 200, 33], 4, 64, 0.2, 99, 7
    cu_q = torch.tensor([0, 70, 71, 371], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 290, 323], dtype=torch.int32, device="cuda")
    q = torch.randn(371, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(323, h, d, device="cuda", dtype=torch.float16) for _ in range(2))
    poison_allocator()
    out, lse = flash_fwd_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=200,
                                softmax_scale=d ** -0.5, causal=True, dropout=DropoutArgs(p, seed, offset))
    torch.cuda.synchronize()
    mask = _mask(seed, offset, 3, h, 300, 200, p)
    for i, (sq, sk) in enumerate(zip(lengths_q, lengths_k)):
        qs, ks, vs = q[cu_q[i]:cu_q[i] + sq], k[cu_k[i]:cu_k[i] + sk], v[cu_k[i]:cu_k[i] + sk]
        ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=mask[i:i + 1, :, :sq, :sk])
        assert_matches_reference(out[cu_q[i]:cu_q[i] + sq][None], lse[:, cu_q[i]:cu_q[i] + sq][None], qs[None],
                                 ks[None], vs[None], ref_fn=ref, causal=True)


def test_same_seed_same_output_other_offset_other_output():
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.dropout import DropoutArgs

    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = [flash_fwd(q, k, v, softmax_scale=0.125, dropout=DropoutArgs(0.3, 5, off))[0] for off in (0, 0, 1)]
    assert torch.equal(run[0], run[1]) and not torch.equal(run[0], run[2])


@pytest.mark.parametrize("b, sq, sk, h, hk, d, opts", [
    (2, 257, 300, 4, 2, 64, {}),
    (1, 200, 333, 6, 3, 128, dict(causal=True)),
    (2, 129, 65, 4, 4, 96, dict(window_size=(40, 10), softcap=20.0)),
], ids=["d64-gqa", "d128-causal", "d96-window-softcap"])
def test_dense_dropout_grads_match_reference(b, sq, sk, h, hk, d, opts):
    """The backward recomputes the forward's mask from the same seed and offset: dq, dk, dv
    against the reference's autograd with that mask, by the backward tests' rule."""
    from cute_flash.launch.backward import flash_bwd
    from cute_flash.launch.dense import flash_fwd
    from cute_flash.launch.dropout import DropoutArgs
    from tests.test_bwd_gpu import assert_grads_match

    p, seed, offset = 0.25, 31337, 3
    drop = DropoutArgs(p, seed, offset)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, dropout=drop, **opts)
    poison_allocator()
    dq, dk, dv, _ = flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, dropout=drop, **opts)
    torch.cuda.synchronize()
    ref = functools.partial(attention_ref, dropout_p=p, dropout_mask=_mask(seed, offset, b, h, sq, sk, p))
    assert_grads_match([dq, dk, dv], q, k, v, dout, ref_fn=ref, **opts)
