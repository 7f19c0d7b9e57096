"""Host-side preparation of q/k/v for the 128-bit copies (CPU: no launch involved)."""
import pytest
import torch

pytest.importorskip("cutlass")

from cute_flash.kernels.fwd import _aligned  # noqa: E402


def _ok(x):
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
        s % 8 == 0 for s in x.stride()[:-1]) and x.shape[-1] % 8 == 0


def test_aligned_tensor_is_used_in_place():
    x = torch.randn(2, 5, 3, 64, dtype=torch.float16)
    assert _aligned(x) is x
    t = torch.randn(2, 3, 5, 64, dtype=torch.float16).transpose(1, 2)  # strided, still aligned
    assert _aligned(t).data_ptr() == t.data_ptr() and torch.equal(_aligned(t), t)


def test_head_dim_is_zero_padded_to_a_multiple_of_8():
    x = torch.randn(2, 5, 3, 20, dtype=torch.bfloat16)
    y = _aligned(x)
    assert y.shape == (2, 5, 3, 24) and _ok(y)
    assert torch.equal(y[..., :20], x) and (y[..., 20:] == 0).all()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 5, 3, 128, dtype=torch.float16)[..., ::2],               # last stride 2
    lambda: torch.randn(2 * 5 * 3 * 64 + 8, dtype=torch.float16)[4:4 + 1920].view(2, 5, 3, 64),
    lambda: torch.randn(2, 5, 3, 68, dtype=torch.float16)[..., :64],                # rows of 68
])
def test_misaligned_layouts_are_copied(make):
    x = make()
    y = _aligned(x)
    assert _ok(y) and torch.equal(y, x)


def test_size_one_dims_get_stride_zero():
    x = torch.empty_strided((1, 5, 3, 64), (3, 192, 64, 1), dtype=torch.float16).normal_()
    y = _aligned(x)
    assert y.stride()[0] == 0 and _ok(y) and torch.equal(y, x) and y.data_ptr() == x.data_ptr()


class _Recorder:
    """Stands in for a compiled kernel: records the call's arguments."""

    def __init__(self):
        self.lookups, self.calls = [], []

    def kernel_for(self, *key):
        self.lookups.append(key)
        return lambda *args: self.calls.append(args)


@pytest.fixture
def recorder(monkeypatch):
    import cute_flash.kernels.fwd as fwd

    rec = _Recorder()
    monkeypatch.setattr(fwd, "_kernel_for", rec.kernel_for)
    monkeypatch.setattr(fwd, "_no_alibi", lambda index: torch.zeros(1, 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return rec


def test_dense_launch_arguments(recorder):
    from cute_flash.kernels.fwd import LOG2E, flash_fwd

    q = torch.randn(2, 5, 4, 20, dtype=torch.float16)
    k, v = torch.randn(2, 7, 2, 20, dtype=torch.float16), torch.randn(2, 7, 2, 20, dtype=torch.float16)
    out, lse = flash_fwd(q, k, v, softmax_scale=0.5, causal=True, window_size=(3, 9))
    (d_pad, dtype, _, causal, has_left, has_right, has_alibi, has_softcap, traits), = recorder.lookups
    assert (d_pad, dtype, causal, has_left, has_right, has_alibi, has_softcap) == (
        24, torch.float16, True, True, True, False, False)
    qa, ka, va, o, l, alibi, scale_log2, premul, alibi_div, left, right = recorder.calls[0]
    assert qa.shape == (2, 5, 4, 24) and ka.shape == va.shape == (2, 7, 2, 24)
    assert o.shape == (2, 5, 4, 24) and l.shape == (2, 4, 5) and l.dtype == torch.float32
    assert (left, right) == (3, 0)  # causal: right edge 0
    assert scale_log2 == pytest.approx(0.5 * LOG2E) and premul == 1.0 and alibi_div == 2.0
    assert out.shape == q.shape and out.data_ptr() == o.data_ptr() and lse is l


def test_softcap_and_alibi_scales(recorder):
    from cute_flash.kernels.fwd import LOG2E, flash_fwd

    q = torch.randn(3, 5, 4, 64, dtype=torch.bfloat16)
    slopes = torch.rand(4)
    flash_fwd(q, q, q, softmax_scale=0.25, softcap=10.0, alibi_slopes=slopes)
    args = recorder.calls[0]
    assert args[5].shape == (3, 4) and torch.equal(args[5][2], slopes)
    assert args[6:9] == pytest.approx((10.0 * LOG2E, 0.025, 0.1))
    assert recorder.lookups[0][6:8] == (True, True)  # has_alibi, has_softcap


def test_varlen_launch_arguments(recorder):
    from cute_flash.kernels.fwd import flash_fwd_varlen

    q = torch.randn(9, 4, 64, dtype=torch.float16)
    k = torch.randn(11, 2, 64, dtype=torch.float16)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    used = torch.tensor([3, 5], dtype=torch.int32)
    out, lse = flash_fwd_varlen(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                max_seqlen_k=6, softmax_scale=0.125, seqused_k=used)
    assert recorder.lookups[0][-2:] == (True, True)  # varlen, has_seqused_k
    args = recorder.calls[0]
    assert args[3].shape == (9, 4, 64) and args[4].shape == (4, 9)
    assert args[6] is cu_q and args[7] is cu_k and args[8] is used and args[9] == 5
    assert out.shape == q.shape and lse.shape == (4, 9)
    with pytest.raises(NotImplementedError, match="paged KV"):
        flash_fwd_varlen(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                         softmax_scale=0.125, block_table=torch.zeros(2, 1, dtype=torch.int32))
