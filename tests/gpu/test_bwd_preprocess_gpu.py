"""The backward's preprocess (kernels/sm80/bwd_preprocess.py) writing the Hopper backward's
padded rows (`PreprocessConfig.hopper_rows`): packed, each sequence's D and LSE times log2 e
from row (cu_seqlens_q[b] // block + b) * block, 0 and +inf past the sequence up to its last
block's end, the unpadded D as before, and no other row touched; dense, the same in rows padded
to whole blocks."""
import pytest
import torch

from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
from cute_flash.launch import compiled
from cute_flash.launch.backward import varlen_dq_tiles
from tests.helpers.gpu_utils import cu_seqlens

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("d, block, even_k", [(128, 64, True), (32, 128, True), (104, 64, False)],
                         ids=["d128-block64", "d32-block128", "d104-on-the-d128-bucket"])
def test_the_packed_preprocess_writes_the_hopper_rows(d, block, even_k):
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the kernels are sm_80+")
    torch.manual_seed(0)
    lq = [0, 1, 63, 64, 65, 200, 129, 0, 17]
    h, bucket = 3, (128 if d > 64 else d)
    total, batch = sum(lq), len(lq)
    cu = cu_seqlens(lq)
    out, dout = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(h, total, device="cuda")
    rows = varlen_dq_tiles(total, batch, block) * block
    dot = torch.empty(h, total, device="cuda")
    lse_padded, d_padded = (torch.full((h, rows), float("nan"), device="cuda") for _ in range(2))
    config = PreprocessConfig(bucket, "bf16", even_k, True, hopper_rows=block)
    compiled.kernel_for(config, torch.cuda.current_device())(out, dout, dot, cu, max(lq), lse, lse_padded, d_padded)
    torch.cuda.synchronize()
    expected = (out.float() * dout.float()).sum(-1).T
    torch.testing.assert_close(dot, expected, rtol=1e-5, atol=1e-4)
    written = torch.zeros(rows, dtype=torch.bool)
    starts = cu.tolist()
    for b, n in enumerate(lq):
        first, end = (starts[b] // block + b) * block, -(-n // block) * block
        assert torch.equal(lse_padded[:, first:first + n], lse[:, starts[b]:starts[b] + n] * LOG2E)
        assert torch.equal(d_padded[:, first:first + n], dot[:, starts[b]:starts[b] + n])
        assert (lse_padded[:, first + n:first + end] == float("inf")).all()
        assert (d_padded[:, first + n:first + end] == 0).all()
        written[first:first + end] = True
    assert lse_padded[:, ~written].isnan().all() and d_padded[:, ~written].isnan().all()


@pytest.mark.parametrize("sq, block", [(70, 64), (128, 128), (1, 64), (300, 128)])
def test_the_dense_preprocess_writes_the_hopper_rows(sq, block):
    """The dense entry: D into the padded rows (its (batch, heads, seqlen_q) view is the D the
    backward returns), LSE times log2 e beside it, 0 and +inf from seqlen_q to the last block's
    end."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the kernels are sm_80+")
    torch.manual_seed(sq)
    b, h, d = 2, 3, 64
    out, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(b, h, sq, device="cuda")
    rows = -(-sq // block) * block
    lse_padded, d_padded = (torch.full((b, h, rows), float("nan"), device="cuda") for _ in range(2))
    config = PreprocessConfig(d, "bf16", True, hopper_rows=block)
    compiled.kernel_for(config, torch.cuda.current_device())(out, dout, d_padded[..., :sq], lse, lse_padded, d_padded)
    torch.cuda.synchronize()
    torch.testing.assert_close(d_padded[..., :sq], (out.float() * dout.float()).sum(-1).transpose(1, 2),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(lse_padded[..., :sq], lse * LOG2E)
    assert (lse_padded[..., sq:] == float("inf")).all() and (d_padded[..., sq:] == 0).all()
