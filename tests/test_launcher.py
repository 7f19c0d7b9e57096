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
