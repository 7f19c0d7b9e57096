"""Tensors of more than 2^31 elements (a million-row sequence of 16 heads at d 128): element
offsets past int32 in every kernel's addressing, forward and backward, on both paths. A causal
window of 128 keys keeps the work small; the last rows are compared with the reference over a
slice that holds everything they depend on (queries s-200.., keys s-328..), by the criterion
in docs/semantics.md, and the first rows likewise."""
import pytest
import torch

from cute_flash import flash_attn_func
from cute_flash.reference import attention_ref
from tests.helpers.backward import GRAD_FLOOR, reference
from tests.helpers.gpu_utils import assert_matches_reference, on_path, poison_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu]  # ~40 GB: sanitized alone

S, H, D, WINDOW, ROWS = (1 << 20) + 4096, 16, 128, (128, 0), 200


@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_past_two_to_the_31_elements(path, monkeypatch, kernels):
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    assert q.numel() > 2 ** 31
    leaves = [x.requires_grad_() for x in (q, k, v)]
    poison_allocator()
    out, lse, _ = flash_attn_func(*leaves, causal=True, window_size=WINDOW, return_attn_probs=True)
    out.backward(dout)
    torch.cuda.synchronize()
    assert kernels == on_path(path, "fwd", "bwd")  # d 128: the Hopper backward's too
    for lo in (0, S - ROWS):
        kl = max(0, lo - WINDOW[0])
        q_s, k_s, v_s, do_s = (x.detach()[:, a:lo + ROWS] for x, a in ((q, lo), (k, kl), (v, kl), (dout, lo)))
        assert_matches_reference(out[:, lo:lo + ROWS], lse[:, :, lo:lo + ROWS], q_s, k_s, v_s, causal=True,
                                 window_size=WINDOW)
        if lo == 0:
            continue  # the first keys also take gradient from queries past the slice
        want = reference(attention_ref, do_s, q_s, k_s, v_s, stored_out=out.detach()[:, lo:lo + ROWS], causal=True,
                         window_size=WINDOW)
        lowp = reference(attention_ref, do_s, q_s, k_s, v_s, upcast=False, causal=True, window_size=WINDOW)
        for name, x, w, lp in zip(("dq", "dk", "dv"), leaves, want, lowp):
            rows = slice(lo, lo + ROWS)
            w, lp = (t[:, -ROWS:] for t in (w, lp))  # dk, dv: the keys every query of theirs is in the slice
            err = (x.grad[:, rows].float() - w).abs().max().item()
            bar = 2 * (lp.float() - w).abs().max().item() + GRAD_FLOOR
            assert err <= bar, f"{name}: max abs error {err:.3e} > {bar:.3e}"
