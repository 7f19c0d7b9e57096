"""Dropout through the public and private functions, on the CPU (the kernels replaced by the
recording fake of tests/helpers/interface.py): each call draws a fresh state from torch's
generator and hands it to the launcher; autograd hands the same state to the backward; S_dmask
carries the mask of that state (checked against the numpy Philox, an implementation of its
own) on the reference's probabilities."""
import math

import numpy as np
import pytest
import torch

from cute_flash import flash_attn_interface as fai
from layouts import philox
from cute_flash.launch.rng import DropoutArgs
from tests.helpers.interface import B, H, SK, SQ, WITH_DROPOUT, call, valid, with_


def _seed_offset(dropout: DropoutArgs):
    seed, offset = dropout.rng_state.tolist()
    return seed % (1 << 64), offset


@pytest.mark.parametrize("name", WITH_DROPOUT)
def test_each_call_draws_a_state_for_the_launch(gpu_free, name):
    """The launcher gets DropoutArgs with the caller's p; two calls draw different states, and
    the same torch.manual_seed draws the same one."""
    states = []
    for seed in (5, None, 5):
        if seed is not None:
            torch.manual_seed(seed)
        call(name, **with_(name, dropout_p=0.25))
        dropout = gpu_free.calls[-1][2]["dropout"]
        assert isinstance(dropout, DropoutArgs) and dropout.p == 0.25
        states.append(dropout.rng_state)
    assert torch.equal(states[0], states[2]) and not torch.equal(states[0], states[1])


@pytest.mark.parametrize("name", WITH_DROPOUT)
def test_no_dropout_passes_none(gpu_free, name):
    call(name, **valid(name))
    assert gpu_free.calls[-1][2]["dropout"] is None


BLOCK_N = 4  # S_dmask's key blocks in these tests (the GPU's forward tile otherwise): SK = 7 spans two


@pytest.fixture
def block_n(monkeypatch):
    from cute_flash import dropout

    monkeypatch.setattr(dropout, "s_dmask_block_n", lambda device, head_dim: BLOCK_N)


def _unnormalized(q, k, causal):
    """flash-attn's representation from its definition: exp(s - m_j), s the scaled scores (-inf
    where masked), m_j the row's maximum over key blocks j and later; q (b, sq, h, d), k (b, sk, h
    or hk, d) float32."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    sq, sk = s.shape[-2:]
    if causal:
        rows, cols = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
        s = s.masked_fill(cols > rows + sk - sq, float("-inf"))
    out = torch.zeros_like(s)
    for j in range(0, sk, BLOCK_N):
        m = s[..., j:].amax(-1, keepdim=True)
        out[..., j:j + BLOCK_N] = torch.where(m > float("-inf"), torch.exp(s[..., j:j + BLOCK_N] - m), 0.0)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_s_dmask_is_flash_attns_representation(gpu_free, block_n, causal):
    """S_dmask (b, h, sq and sk rounded up to 128) in q's dtype: its sign bits are the numpy keep
    mask of the call's seed and offset, its magnitudes exp(s - m_j) per key block, zero in the
    padding."""
    q, k, v = (valid("func")[n] for n in "qkv")
    out, lse, s = call("func", q=q, k=k, v=v, dropout_p=0.4, causal=causal, return_attn_probs=True)
    assert s.shape == (B, H, 128, 128) and s.dtype == q.dtype
    assert s[:, :, SQ:].abs().sum() == 0 and s[:, :, :, SK:].abs().sum() == 0
    s = s[:, :, :SQ, :SK]
    seed, offset = _seed_offset(gpu_free.calls[-1][2]["dropout"])
    keep = philox.keep_mask(seed, offset, B, H, SQ, SK, 0.4)
    assert np.array_equal(~torch.signbit(s).numpy(), keep)
    assert 0.3 < keep.mean() < 0.9  # both signs present: the sign check above can fail
    expected = _unnormalized(q.float(), k.float(), causal)
    assert torch.allclose(s.float().abs(), expected, atol=2e-3, rtol=2e-3)
    assert (s.float().abs().amax(-1) == 1).any()  # a row's maximum is its own block's: exp(0)


def test_varlen_s_dmask_counts_from_each_sequence(gpu_free, block_n):
    """Varlen S_dmask is (b, h, max_seqlen_q and max_seqlen_k rounded up to 128): sequence i's
    corner carries the signs of batch row i of the mask and the representation of its own
    scores, rows, columns and key blocks from the sequence's start; zero elsewhere."""
    args = valid("varlen")
    out, lse, s = call("varlen", **{**args, "dropout_p": 0.3, "return_attn_probs": True})
    b = args["cu_seqlens_q"].numel() - 1
    mq, mk = args["max_seqlen_q"], args["max_seqlen_k"]
    assert s.shape == (b, H, 128, 128)
    seed, offset = _seed_offset(gpu_free.calls[-1][2]["dropout"])
    keep = philox.keep_mask(seed, offset, b, H, mq, mk, 0.3)
    cq, ck = args["cu_seqlens_q"].tolist(), args["cu_seqlens_k"].tolist()
    for i in range(b):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        corner = s[i, :, :lq, :lk]
        assert np.array_equal(~torch.signbit(corner).numpy(), keep[i, :, :lq, :lk])
        expected = _unnormalized(args["q"][None, cq[i]:cq[i + 1]].float(), args["k"][None, ck[i]:ck[i + 1]].float(),
                                 False)[0]
        assert torch.allclose(corner.float().abs(), expected, atol=2e-3, rtol=2e-3)
        assert s[i, :, lq:].abs().sum() == 0 and s[i, :, :, lk:].abs().sum() == 0


def test_backward_gets_the_forwards_state(gpu_free):
    q, k, v = (valid("func")[n].requires_grad_() for n in "qkv")
    out = call("func", q=q, k=k, v=v, dropout_p=0.1)
    out.sum().backward()
    (_, _, fwd_kw), (fn, _, bwd_kw) = gpu_free.calls
    assert fn == "flash_bwd" and bwd_kw["dropout"] is fwd_kw["dropout"]


def test_private_forward_returns_the_state_and_backward_takes_it(gpu_free):
    q, k, v = (valid("func")[n] for n in "qkv")
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.2, 0.5, False, -1, -1, 0.0, None, False)
    drawn = gpu_free.calls[-1][2]["dropout"]
    assert rng_state is drawn.rng_state and s_dmask.shape == (0,)
    with pytest.raises(ValueError, match="needs the forward's rng_state"):
        fai._flash_attn_backward(out, q, k, v, out, lse, None, None, None, 0.2, 0.5, False, -1, -1, 0.0, None, False)
    fai._flash_attn_backward(out, q, k, v, out, lse, None, None, None, 0.2, 0.5, False, -1, -1, 0.0, None, False,
                             rng_state)
    bwd = gpu_free.calls[-1][2]["dropout"]
    assert bwd.p == 0.2 and torch.equal(bwd.rng_state, rng_state)


def test_empty_problem_draws_nothing(gpu_free):
    q = torch.empty(B, 0, H, valid("func")["q"].shape[-1], dtype=torch.float16)
    k, v = valid("func")["k"], valid("func")["v"]
    out, lse, s = call("func", q=q, k=k, v=v, dropout_p=0.5, return_attn_probs=True)
    assert gpu_free.calls == [] and s.shape == (B, H, 0, 128)  # flash-attn's lengths, rounded up to 128
    assert not math.isnan(out.sum().item())


def test_s_dmask_has_no_gradient(gpu_free, block_n):
    """S_dmask is built outside autograd, as flash-attn's has no gradient: under torch.compile a
    differentiable one joined the traced backward and put NaN into dq (its masked blocks' zero
    cotangents against infinite local derivatives)."""
    q, k, v = (valid("func")[n].clone().requires_grad_() for n in "qkv")
    out, lse, s = call("func", q=q, k=k, v=v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert out.requires_grad and not s.requires_grad and s.grad_fn is None
