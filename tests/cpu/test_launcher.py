"""Host-side launchers on CPU tensors, compiled kernels replaced by recorders at one seam
(`cute_flash.launch.compiled.kernel_for`, the `recorder` fixture): 128-bit preparation of
q/k/v, the kernel arguments of each entry, split counts, the GQA decode fold, append order.

Every recorded launch is bound to the parameter names of the entry point its config compiles
(`FlashFwd.__call__`, `call_varlen`, `call_kvcache`, `AppendKV.__call__`, ...:
`tests.helpers.recorder.Launch`), so the checks read arguments by name, and a host call whose
order differs from the compiled signature (two int32 vectors swapped, say) fails here on a CPU
instead of on a GPU."""
import functools
import inspect

import cutlass  # noqa: F401  (the DSL is a hard dependency: its absence fails here, never skips)
import pytest
import torch

from cute_flash.launch import gpu
from cute_flash.launch.align import aligned as _aligned
from tests.helpers.clusters import H200_CLUSTERS


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


def test_dense_launch_arguments(recorder):
    from cute_flash.kernels.common.constants import LOG2E
    from cute_flash.launch import flash_fwd

    q = torch.randn(2, 5, 4, 20, dtype=torch.float16)
    k, v = torch.randn(2, 7, 2, 20, dtype=torch.float16), torch.randn(2, 7, 2, 20, dtype=torch.float16)
    out, lse = flash_fwd(q, k, v, softmax_scale=0.5, causal=True, window_size=(3, 9))
    (launch,) = recorder.launches
    assert launch.config.flags() == dict(has_left=True, has_right=True)  # d 20 of 32: even_k off
    assert launch.config.traits.head_dim == 32 and launch.config.traits.dtype == "fp16"
    assert launch["mQ"].shape == (2, 5, 4, 24) and launch["mK"].shape == launch["mV"].shape == (2, 7, 2, 24)
    assert launch["mO"].shape == (2, 5, 4, 24) and launch["mLSE"].shape == (2, 4, 5)
    assert launch["mLSE"].dtype == torch.float32
    assert (launch["window_left"], launch["window_right"]) == (3, 0)  # causal: right edge 0
    assert launch["scale_log2"] == pytest.approx(0.5 * LOG2E) and launch["score_premul"] == 1.0
    assert launch["alibi_div"] == 2.0
    assert out.shape == q.shape and out.data_ptr() == launch["mO"].data_ptr() and lse is launch["mLSE"]


def test_dense_forwards_on_sm90_default_to_the_hopper_kernel(recorder, monkeypatch):
    """Without CUTE_FLASH_ARCH_PATH an sm_90 dense forward launches the Hopper kernel, with
    dropout too (given its Philox state); sm80 in the variable, given SM80 traits, or another
    GPU take the SM80 kernel."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd
    from layouts.traits import choose_fwd_traits

    q, k, v = (torch.randn(2, 5, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    flash_fwd(q, k, v, softmax_scale=0.5, causal=True)
    (launch,) = recorder.launches
    assert isinstance(launch.config, Sm90FwdConfig) and launch.config.has_right and not launch.config.has_left
    assert (launch["window_left"], launch["window_right"]) == (-1, 0) and launch["max_ctas"] == 132
    assert launch["section_heads"] >= 2 * 4  # causal: longest tiles first over all 8 (batch, head) pairs
    flash_fwd(q, k, v, softmax_scale=0.5, dropout=DropoutArgs.seeded(0.1, 1, 2, "cpu"))
    assert isinstance(recorder.launches[1].config, Sm90FwdConfig) and recorder.launches[1].config.has_dropout
    assert recorder.launches[1]["mRng"] is not None
    flash_fwd(q, k, v, softmax_scale=0.5, traits=choose_fwd_traits(64, "bf16", 90))
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_fwd(q, k, v, softmax_scale=0.5)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    monkeypatch.setattr(gpu, "device_arch", lambda index: 89)
    flash_fwd(q, k, v, softmax_scale=0.5)
    assert [type(x.config) for x in recorder.launches[2:]] == [FwdConfig] * 3


def test_packed_forwards_on_sm90_default_to_the_hopper_kernel(recorder, monkeypatch):
    """Without CUTE_FLASH_ARCH_PATH (or with sm90) an sm_90 packed forward over contiguous keys
    launches the Hopper kernel's varlen entry (persistent at d 64 and 128, whose tiles claim the
    list's entries from the tile counter; 128-row tiles even for d 64's long keys) with the
    prefix sums, seqused_k and the list of query blocks, the most key blocks first; pages, sm80
    in the variable, or another GPU take the SM80 kernel."""
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd_varlen

    q = torch.randn(9, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(5000, 2, 64, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 2500, 5000], dtype=torch.int32)
    used = torch.tensor([3, 7], dtype=torch.int32)
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=2500, softmax_scale=0.5)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    out, lse = flash_fwd_varlen(q, k, k, causal=True, **opts)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_varlen(q, k, k, seqused_k=used, **opts)
    first, used_launch = recorder.launches
    config = first.config
    assert isinstance(config, Sm90FwdConfig) and config.varlen and config.persistent
    assert first["mTileCounter"] is not None and first["max_ctas"] == gpu.num_sms(0)
    assert config.traits.block_m == 128 and config.has_right and not config.has_left and not config.has_seqused_k
    assert first["mCuSeqlensQ"] is cu_q and first["mCuSeqlensK"] is cu_k
    # (sequence, query block): one block each (9 // 128 + 2 entries), both visiting all 20 key blocks
    assert first["mTiles"].tolist() == [[0, 0], [1, 0]]
    assert first["mSeqUsedK"] is None
    assert first["mO"].shape == (9, 4, 64) and first["mLSE"].shape == (4, 9) and lse is first["mLSE"]
    assert out.data_ptr() == first["mO"].data_ptr()
    assert isinstance(used_launch.config, Sm90FwdConfig) and used_launch.config.has_seqused_k
    assert used_launch["mSeqUsedK"] is used
    pages = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
    flash_fwd_varlen(q, pages, pages, block_table=torch.zeros(2, 3, dtype=torch.int32), **opts)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_fwd_varlen(q, k, k, **opts)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    monkeypatch.setattr(gpu, "device_arch", lambda index: 89)
    flash_fwd_varlen(q, k, k, **opts)
    assert [type(x.config) for x in recorder.launches[2:]] == [FwdConfig] * 3


def test_the_packed_hopper_forwards_persistent_schedule(recorder, monkeypatch):
    """`flash_fwd_varlen_sm90(persistent=True)` (the default up to d 128) launches the persistent
    packed variant with the per-stream tile counter (zero) and the SM count as its CTA bound;
    one CTA per tile (`persistent=False`, the default above d 128) passes no counter."""
    from cute_flash.launch.hopper import flash_fwd_varlen_sm90, tile_counter

    tile_counter.cache_clear()
    q = torch.randn(9, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(500, 2, 128, dtype=torch.bfloat16)
    opts = dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 200, 500], dtype=torch.int32), max_seqlen_q=5, softmax_scale=0.5)
    flash_fwd_varlen_sm90(q, k, k, causal=True, **opts)
    flash_fwd_varlen_sm90(q, k, k, causal=True, persistent=False, **opts)
    q256, k256 = (torch.randn(x.shape[0], x.shape[1], 256, dtype=torch.bfloat16) for x in (q, k))
    flash_fwd_varlen_sm90(q256, k256, k256, causal=True, **opts)
    persistent, per_tile, wide = recorder.launches
    assert not wide.config.persistent and wide["mTileCounter"] is None
    assert persistent.config.persistent and persistent.config.varlen and persistent.config.has_right
    assert persistent["mTileCounter"] is tile_counter(q.device) and persistent["mTileCounter"].tolist() == [0, 0]
    assert persistent["max_ctas"] == gpu.num_sms(0)
    assert persistent.config.name.split("_")[-1].startswith("s2pv-")
    assert not per_tile.config.persistent and per_tile["mTileCounter"] is None


def test_a_learnable_sink_goes_to_either_kernels_epilogue(recorder, monkeypatch):
    """The forward kernels, Hopper and SM80, dense and packed, get the sink logits as fp32 (h,)
    (`learnable_sink` in their configs) and their O and LSE come back as the kernel wrote them,
    the sink in them; without a sink no variant has one."""
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd, flash_fwd_varlen

    q, k = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16), torch.randn(2, 7, 2, 64, dtype=torch.bfloat16)
    sink = torch.randn(4, dtype=torch.bfloat16)
    packed = dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=4,
                  softmax_scale=0.5, learnable_sink=sink)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    results = [flash_fwd(q, k, k, softmax_scale=0.5, causal=True, learnable_sink=sink),
               flash_fwd_varlen(q[0], k[0], k[0], **packed)]
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    results += [flash_fwd(q, k, k, softmax_scale=0.5, learnable_sink=sink),
                flash_fwd_varlen(q[0], k[0], k[0], **packed)]
    flash_fwd(q, k, k, softmax_scale=0.5, causal=True)
    *with_sink, plain = recorder.launches
    assert [type(x.config) for x in with_sink] == [Sm90FwdConfig] * 2 + [FwdConfig] * 2
    for launch, (out, lse) in zip(with_sink, results):
        assert launch.config.learnable_sink and launch["mSink"].dtype == torch.float32
        assert torch.equal(launch["mSink"], sink.float())
        assert out.data_ptr() == launch["mO"].data_ptr() and lse is launch["mLSE"]
    assert not plain.config.learnable_sink and plain["mSink"] is None


def test_paged_packed_forwards_take_the_hopper_kernel(recorder, monkeypatch):
    """A paged packed forward whose pages hold whole key blocks (256 rows; 128-key blocks at d
    64) launches the Hopper varlen entry with the pages and the block table; with pages of 64
    rows at d 64, or with CUTE_FLASH_ARCH_PATH=sm80, the SM80 kernel."""
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd_varlen

    q = torch.randn(9, 4, 64, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 300, 700], dtype=torch.int32)
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=400, softmax_scale=0.5)
    pages, table = torch.randn(5, 256, 2, 64, dtype=torch.bfloat16), torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    out, lse = flash_fwd_varlen(q, pages, pages, block_table=table, causal=True, **opts)
    (launch,) = recorder.launches
    assert isinstance(launch.config, Sm90FwdConfig) and launch.config.varlen and launch.config.paged
    assert launch["mK"] is pages and launch["mV"] is pages and launch["mBlockTable"] is table
    assert launch["mCuSeqlensK"] is cu_k and launch["mO"].data_ptr() == out.data_ptr() and launch["mLSE"] is lse
    small = torch.randn(20, 64, 2, 64, dtype=torch.bfloat16)
    flash_fwd_varlen(q, small, small, block_table=torch.zeros(2, 7, dtype=torch.int32), **opts)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_fwd_varlen(q, pages, pages, block_table=table, **opts)
    assert [type(x.config) for x in recorder.launches[1:]] == [FwdConfig] * 2


def test_a_value_head_dim_of_its_own_on_either_kernel(recorder, monkeypatch):
    """MLA's q / k 192 with v 128: the Hopper forward takes v as it is (traits with head_dim_v,
    O 128 wide), dense and packed; the SM80 kernel, which takes one head dim, gets v padded to
    192 with zero columns, and the caller the first 128 of O's. Pages fit the Hopper kernel by
    the key block of the wider head dim."""
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd, flash_fwd_varlen

    q, k = torch.randn(2, 5, 4, 192, dtype=torch.bfloat16), torch.randn(2, 7, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(2, 7, 2, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    out, _ = flash_fwd(q, k, v, softmax_scale=0.5, causal=True)
    packed, _ = flash_fwd_varlen(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                                 cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32), max_seqlen_q=3,
                                 max_seqlen_k=4, softmax_scale=0.5)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    sm80_out, _ = flash_fwd(q, k, v, softmax_scale=0.5, causal=True)
    dense, varlen, sm80 = recorder.launches
    for launch in (dense, varlen):
        assert isinstance(launch.config, Sm90FwdConfig)
        assert (launch.config.traits.head_dim, launch.config.traits.head_dim_v) == (192, 128)
        assert launch["mV"].shape[-1] == launch["mO"].shape[-1] == 128
    assert dense["mV"] is v and out.shape == (2, 5, 4, 128) and out.data_ptr() == dense["mO"].data_ptr()
    assert packed.shape == (5, 4, 128)
    assert isinstance(sm80.config, FwdConfig) and sm80.config.traits.head_dim == 192
    assert sm80["mV"].shape[-1] == sm80["mO"].shape[-1] == 192 and not sm80["mV"][..., 128:].any()
    assert sm80_out.shape == (2, 5, 4, 128) and sm80_out.data_ptr() == sm80["mO"].data_ptr()
    # pages of 64 rows hold whole key blocks of q / k 128 beside v 256 (64 keys a block, by v)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    k_pages = torch.randn(4, 64, 2, 128, dtype=torch.bfloat16)
    v_pages = torch.randn(4, 64, 2, 256, dtype=torch.bfloat16)
    flash_fwd_varlen(torch.randn(5, 4, 128, dtype=torch.bfloat16), k_pages, v_pages,
                     cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                     cu_seqlens_k=torch.tensor([0, 60, 100], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=60,
                     softmax_scale=0.5, block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    paged = recorder.launches[-1].config
    assert isinstance(paged, Sm90FwdConfig) and paged.paged and paged.traits.head_dim_v == 256


def test_backwards_pad_a_value_head_dim_of_their_own(recorder, monkeypatch):
    """The backward kernels take one head dim but for MLA's pair: a backward with v 128 wide
    beside q / k 64 runs the Hopper backward on q and k padded with zero columns to 128, and
    returns dq / dk 64 wide; the SM80 backward pads q / k 192 beside v 128 likewise (v, out and
    dout to 192, dv 128 wide), dense and packed."""
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen

    lse = torch.randn(2, 4, 5)
    for d, d_v, path, kind in ((64, 128, None, Sm90BwdConfig), (192, 128, "sm80", BwdConfig)):
        if path is None:
            monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
        else:
            monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
        q = torch.randn(2, 5, 4, d, dtype=torch.bfloat16)
        k = torch.randn(2, 7, 2, d, dtype=torch.bfloat16)
        v = torch.randn(2, 7, 2, d_v, dtype=torch.bfloat16)
        out, dout = (torch.randn(2, 5, 4, d_v, dtype=torch.bfloat16) for _ in range(2))
        start = len(recorder.launches)
        dq, dk, dv, _ = flash_bwd(dout, q, k, v, out, lse, softmax_scale=0.5, causal=True)
        (main,) = [x for x in recorder.launches[start:] if isinstance(x.config, kind)]
        wide = max(d, d_v)
        assert all(main[name].shape[-1] == wide for name in ("mQ", "mK", "mV", "mdO"))
        narrow = ("mQ", "mK") if d < d_v else ("mV", "mdO")
        assert all(not main[name][..., min(d, d_v):].any() for name in narrow)  # zero columns
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    dq, dk, dv, _ = flash_bwd_varlen(dout[0], q[0], k[0, :5], v[0, :5], out[0], lse[0], cu_seqlens_q=cu,
                                     cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, softmax_scale=0.5)
    assert (dq.shape, dk.shape, dv.shape) == ((5, 4, 192), (5, 2, 192), (5, 2, 128))
    (main,) = [x for x in recorder.launches[-3:] if isinstance(x.config, BwdConfig)]
    assert main["mV"].shape[-1] == 192


def test_the_hopper_backward_takes_mla_values_as_they_are(recorder, monkeypatch):
    """MLA's q / k 192 with v 128 on the Hopper backward, dense and packed: traits with
    head_dim_v 128, v, dout, dv and the preprocess's O / dO at 128 columns (no pad), q, k, dk and
    dq at 192; the dQ convert that of the plain d 192 tiles."""
    from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
    from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen
    from layouts.hopper import choose_hopper_bwd_traits

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    q, k = torch.randn(2, 5, 4, 192, dtype=torch.bfloat16), torch.randn(2, 7, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(2, 7, 2, 128, dtype=torch.bfloat16)
    out, dout = (torch.randn(2, 5, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    dense = flash_bwd(dout, q, k, v, out, torch.randn(2, 4, 5), softmax_scale=0.5, causal=True)
    packed = flash_bwd_varlen(dout[0], q[0], k[0, :5], v[0, :5], out[0], torch.randn(4, 5), cu_seqlens_q=cu,
                              cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, softmax_scale=0.5)
    assert [type(x.config) for x in recorder.launches] == [PreprocessConfig, Sm90BwdConfig, DQConvertConfig] * 2
    for (pre, main, convert), (dq, dk, dv, _), x in zip((recorder.launches[:3], recorder.launches[3:]),
                                                        (dense, packed), (q, q[0])):
        assert (main.config.traits.head_dim, main.config.traits.head_dim_v) == (192, 128)
        assert pre.config.head_dim == 128 and pre["mO"].shape[-1] == pre["mdO"].shape[-1] == 128
        assert all(main[name].shape[-1] == 128 for name in ("mV", "mdO", "mdV"))
        assert all(main[name].shape[-1] == 192 for name in ("mQ", "mK", "mdK"))
        assert convert.config == DQConvertConfig.of_hopper(choose_hopper_bwd_traits(192), True, convert.config.varlen)
        assert (dq.shape[-1], dk.shape[-1], dv.shape[-1]) == (192, 192, 128) and dq.shape[:-1] == x.shape[:-1]
    assert dense[2].shape == v.shape


def test_mla_backward_takes_96_key_blocks(recorder, monkeypatch):
    """MLA's 192 / 128 on FA3's 96-key tiles (`bwd_keys_on_n`), dense and packed, two Q / dO
    stages beside the dQ staging tile: a grid of 96-key blocks, the packed launch order's
    (sequence, key block) entries at 96 keys; d 192 with V 192 (and the bucket 160) takes them
    too, with one dO stage (`policy.hopper_bwd_dq`); both hand dQ to the writer warps."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    q, k = torch.randn(1, 300, 4, 192, dtype=torch.bfloat16), torch.randn(1, 300, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(1, 300, 2, 128, dtype=torch.bfloat16)
    out, dout = (torch.randn(1, 300, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    flash_bwd(dout, q, k, v, out, torch.randn(1, 4, 300), softmax_scale=0.5, causal=True)
    flash_bwd_varlen(dout[0], q[0], k[0], v[0], out[0], torch.randn(4, 300), cu_seqlens_q=cu, cu_seqlens_k=cu,
                     max_seqlen_q=200, max_seqlen_k=200, softmax_scale=0.5)
    for d in (192, 160):
        x = torch.randn(1, 300, 4, d, dtype=torch.bfloat16)
        flash_bwd(x, x, x, x, x, torch.randn(1, 4, 300), softmax_scale=0.5)
    dense, packed, *plain = [x.config for x in recorder.launches if isinstance(x.config, Sm90BwdConfig)]
    assert all((c.traits.block_n, c.traits.stages_do, c.dq_path) == (96, 2, "writer") for c in (dense, packed))
    assert [(c.traits.block_n, c.traits.stages_do, c.dq_path) for c in plain] == [(96, 1, "writer")] * 2
    entries = {tuple(e) for e in recorder.launches[4]["mTiles"].tolist()}  # (sequence, key block)
    assert {(0, 0), (0, 1), (1, 0), (1, 2)} <= entries and (1, 3) not in entries and (0, 2) not in entries


@pytest.mark.parametrize("d, sk, opts, block_m, persistent, speculative", [
    (64, 511, dict(causal=True), 128, True, False),    # masked: speculative maxima from 512 keys at d 64
    (64, 512, dict(causal=True), 128, True, True),
    (64, 2047, dict(causal=True), 128, True, True),    # 16 key blocks: persistent under a mask
    (64, 2048, dict(causal=True), 192, True, True),    # from 2048 keys d 64's 192-row tiles, always persistent,
    #                                                    speculating in place at any length under a causal mask
    (64, 8191, dict(window_size=(4096, 0)), 192, True, False),  # ... from 8192 keys under a window's left edge
    (64, 8192, dict(window_size=(4096, 0)), 192, True, True),
    (64, 1023, dict(), 128, True, True),
    (64, 1024, dict(), 192, True, True),               # without a mask from 1024 keys
    (64, 4096, dict(), 192, True, True),
    (64, 4096, dict(dropout_p=0.1), 128, True, False),  # with dropout 192-row tiles spill: 128
    (64, 4096, dict(alibi=True), 192, True, False),    # with ALiBi P over S spills: no speculation
    (128, 4096, dict(alibi=True), 128, True, False),   # ALiBi with no mask: maxima move along the row
    (128, 4096, dict(alibi=True, causal=True), 128, True, True),  # ... under a causal mask they hold
    (128, 2048, dict(window_size=(50, 50)), 128, True, True),
    (128, 1023, dict(causal=True), 128, True, False),  # masked: speculative maxima from 1024 keys
    (128, 1024, dict(causal=True), 128, True, True),
    (128, 8192, dict(causal=True), 128, True, True),   # 64 key blocks: persistent under a mask
    (128, 8193, dict(causal=True), 128, False, True),  # masked past 64 key blocks: one CTA per tile
    (128, 8192, dict(), 128, True, True),              # no mask: persistent at any length
    (128, 512, dict(), 128, True, True),               # no mask: speculative maxima at any length
    (256, 512, dict(), 128, False, True),              # no room for O's own tile
], ids=["d64-511-keys-causal", "d64-512-keys-causal", "d64-2047-keys-causal", "d64-2048-keys-causal",
        "d64-8191-keys-window", "d64-8192-keys-window", "d64-1023-keys", "d64-1024-keys", "d64-long",
        "d64-long-dropout", "d64-long-alibi", "d128-long-alibi", "d128-long-alibi-causal", "d128-window",
        "d128-1023-keys-causal", "d128-1024-keys-causal", "d128-64-blocks-causal", "d128-65-blocks-causal",
        "d128-long", "d128-short", "d256"])
def test_hopper_forward_tiles_and_schedule(recorder, monkeypatch, d, sk, opts, block_m, persistent, speculative):
    """The tiles, schedule, speculative maxima (and where P goes) and tile order the sm_90
    launcher picks (the rules measured in docs/tuning/hopper-forward.md: longest tiles first only for the
    persistent kernel under a mask), and the tile counter: one per stream, a fresh one under
    capture."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch import flash_fwd
    from cute_flash.launch.hopper import tile_counter

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    tile_counter.cache_clear()
    masked = bool(opts)
    if "dropout_p" in opts:
        opts, masked = dict(dropout=DropoutArgs.seeded(opts["dropout_p"], 1, 2, "cpu")), False
    if "alibi" in opts:
        opts = dict(alibi_slopes=torch.ones(2), causal=opts.get("causal", False))
        masked = opts["causal"]
    q = torch.randn(1, 3, 2, d, dtype=torch.bfloat16)
    k = v = torch.randn(1, sk, 2, d, dtype=torch.bfloat16)
    flash_fwd(q, k, v, softmax_scale=0.5, **opts)
    flash_fwd(q, k, v, softmax_scale=0.5, **opts)
    recorder.capturing = True
    flash_fwd(q, k, v, softmax_scale=0.5, **opts)
    first, second, captured = recorder.launches
    assert (first.config.traits.block_m, first.config.persistent) == (block_m, persistent)
    assert first.config.speculative_max == speculative
    assert first.config.speculative_in_place == (speculative and block_m == 192)  # P over S where 64 rows more
    longest_first = persistent and masked  # every masked case here has 2 (batch, head) pairs
    assert first["section_heads"] == (2 if longest_first else 1)
    assert first["mTileCounter"].tolist() == [0, 0] and first["mTileCounter"] is second["mTileCounter"]
    assert captured["mTileCounter"] is not first["mTileCounter"]


@pytest.mark.parametrize("b, sq, h, hk, expected", [
    (32, 512, 16, 16, 33),      # 4 query blocks a pair: the 33 pairs whose 132 tiles fill 132 SMs
    (16, 1024, 16, 16, 16),     # 8 blocks: 16 pairs, 128 tiles
    (16, 1025, 16, 16, 63),     # 9 blocks: 63 heads' K / V (2 * 1025 * 128 * 2 bytes each) in 32 MB
    (4, 4096, 16, 16, 16),      # 2 MB of K / V a head: 16 in 32 MB
    (4, 4096, 32, 8, 64),       # GQA 4: a K / V head counts once for its 4 query heads
    (1, 512, 8, 8, 8),          # never more than the pairs there are
])
def test_scheduling_sections_fill_one_wave_or_32_mb_of_l2(b, sq, h, hk, expected):
    """section_heads: short pairs (up to ONE_WAVE_MAX_M_BLOCKS query blocks of 128 rows) get
    sections of one wave of tiles on 132 SMs, longer ones as many heads as keep 32 MB of K / V
    (d 128, bf16); without longest-first scheduling a section is one pair."""
    from cute_flash.launch.policy import section_heads

    q = torch.empty(b, sq, h, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(b, sq, hk, 128, dtype=torch.bfloat16, device="meta")
    assert section_heads(q, k, True, 128, 132) == expected
    assert section_heads(q, k, False, 128, 132) == 1


@pytest.mark.parametrize("d, sk, opts, stages", [
    (64, 512, dict(), 3),              # three K / V stages up to 1024 keys on 128-row persistent tiles
    (64, 1024, dict(causal=True), 3),
    (64, 1025, dict(causal=True), 2),
    (64, 1024, dict(), 2),             # 192-row tiles from 1024 keys without a mask: two
    (32, 700, dict(window_size=(100, 100)), 3),
    (96, 1024, dict(), 3),
    (128, 512, dict(), 2),             # three do not fit beside O's own tile
    (160, 512, dict(), 2),             # they would (64-key blocks), but were not measured
], ids=["d64-512", "d64-1024-causal", "d64-1025-causal", "d64-1024-tall", "d32-window", "d96-1024", "d128", "d160"])
def test_hopper_forward_stages(recorder, monkeypatch, d, sk, opts, stages):
    """The K / V pipeline depth the sm_90 launcher picks (`kv_stages`, measured in docs/tuning/hopper-forward.md)."""
    from cute_flash.launch import flash_fwd

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(1, 3, 2, d, dtype=torch.bfloat16)
    k = v = torch.randn(1, sk, 2, d, dtype=torch.bfloat16)
    flash_fwd(q, k, v, softmax_scale=0.5, **opts)
    assert recorder.launches[0].config.stages == stages


@pytest.mark.parametrize("d, sq, sk, opts, multicast", [
    (128, 4096, 4096, dict(), True),
    (128, 4096, 2047, dict(), False),              # from 2048 keys
    (128, 4096, 2048, dict(), True),
    (120, 256, 8192, dict(), True),                # the d 128 bucket; two query blocks
    (128, 4096, 4096, dict(dtype=torch.float16), True),
    (128, 4096, 4096, dict(alibi=True, softcap=5.0), True),
    (128, 384, 4096, dict(), False),               # three query blocks: a cluster would straddle heads
    (128, 4096, 4096, dict(causal=True), False),
    (128, 4096, 4096, dict(window_size=(-1, 100)), False),
    (128, 4096, 4096, dict(dropout_p=0.1), False),  # not measured with dropout
    (64, 4096, 4096, dict(), False),               # 0.96-0.995x at d 64
    (256, 4096, 4096, dict(), False),
], ids=["d128", "d128-2047-keys", "d128-2048-keys", "d120-two-blocks", "d128-fp16", "d128-alibi-softcap",
        "d128-three-blocks", "d128-causal", "d128-window", "d128-dropout", "d64", "d256"])
def test_kv_multicast_by_default(recorder, monkeypatch, d, sq, sk, opts, multicast):
    """Dense forwards take K / V multicast (`takes_kv_multicast`) at d 128 without a mask from
    2048 keys, where a cluster's two tiles are one head's neighbouring query blocks."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch import flash_fwd

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.bfloat16)
    if opts.pop("dropout_p", None):
        opts["dropout"] = DropoutArgs.seeded(0.1, 1, 2, "cpu")
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.ones(2)
    q = torch.randn(1, sq, 2, d, dtype=dtype)
    k = torch.randn(1, sk, 2, d, dtype=dtype)
    flash_fwd(q, k, k, softmax_scale=0.5, **opts)
    config = recorder.launches[-1].config
    assert config.kv_multicast == multicast
    assert not multicast or config.persistent


def test_kv_multicast_can_be_forced_where_it_pairs_one_heads_blocks(recorder, monkeypatch):
    """`flash_fwd_sm90(kv_multicast=...)` overrides the default: off anywhere, on only where a
    cluster's two tiles are one head's neighbouring query blocks with the same key blocks:
    persistent, no causal / local mask, an even number of query blocks."""
    from cute_flash.launch.hopper import flash_fwd_sm90

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    k = torch.randn(1, 4096, 2, 128, dtype=torch.bfloat16)
    flash_fwd_sm90(torch.randn(1, 4096, 2, 128, dtype=torch.bfloat16), k, k, softmax_scale=0.5, kv_multicast=False)
    assert not recorder.launches[-1].config.kv_multicast
    short = torch.randn(1, 1024, 2, 128, dtype=torch.bfloat16)
    for sq, ok in ((256, True), (1000, True), (129, True), (384, False), (100, False)):  # 2, 8, 2, 3, 1 blocks
        q = torch.randn(1, sq, 2, 128, dtype=torch.bfloat16)
        if ok:
            flash_fwd_sm90(q, short, short, softmax_scale=0.5, kv_multicast=True)
            assert recorder.launches[-1].config.kv_multicast
        else:
            with pytest.raises(ValueError, match="kv_multicast"):
                flash_fwd_sm90(q, short, short, softmax_scale=0.5, kv_multicast=True)
    q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16)
    for refused in (dict(causal=True), dict(window_size=(100, -1)), dict(persistent=False)):
        with pytest.raises(ValueError, match="kv_multicast"):
            flash_fwd_sm90(q, k, k, softmax_scale=0.5, kv_multicast=True, **refused)


def test_hopper_forward_choices_are_in_the_full_compile_list(recorder, monkeypatch):
    """Every config the sm_90 launcher picks for a dense forward (tiles, schedule, speculation,
    stages, over head dims, key counts around each rule's edge, masks, modifiers, dropout and
    dtypes) is in `sm90_variants(full=True)`, the list `python -m cute_flash compile --full`
    builds ahead of time."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch import flash_fwd
    from cute_flash.launch.variants import sm90_variants

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    full = set(sm90_variants(full=True))
    options = [dict(), dict(causal=True), dict(window_size=(100, 0)), dict(window_size=(-1, 50)),
               dict(window_size=(50, -1)), dict(alibi_slopes=torch.ones(2)), dict(softcap=5.0),
               dict(dropout=DropoutArgs.seeded(0.1, 1, 2, "cpu"))]
    for dtype in (torch.bfloat16, torch.float16):
        for d in (32, 64, 96, 128, 160, 256):
            for sq in (3, 256):  # one query block or two (K / V multicast where it takes them)
                q = torch.empty(1, sq, 2, d, dtype=dtype)
                for sk in (511, 512, 1023, 1024, 1025, 2047, 2048, 8191, 8192, 8193):
                    k = torch.empty(1, sk, 2, d, dtype=dtype)
                    for opts in options:
                        flash_fwd(q, k, k, softmax_scale=0.5, **opts)
    configs = {launch.config for launch in recorder.launches}
    assert len(recorder.launches) == 2 * 6 * 2 * 10 * len(options)
    assert any(c.kv_multicast for c in configs)
    assert configs <= full, sorted(c.name for c in configs - full)


def test_the_kernels_fixture_names_the_attention_kernels_that_ran(recorder, kernels, monkeypatch):
    """tests/conftest.py's `kernels`, which the GPU tests assert their path with, here over the
    recorder (its lookups after the recorder's): each forward and backward names its kernel by
    its config's type, a memoised SM80 forward too; the preprocess, the dQ convert and the append
    kernel are not named."""
    from cute_flash.launch import flash_fwd, flash_fwd_kvcache
    from cute_flash.launch.backward import flash_bwd

    q, dout = (torch.randn(2, 70, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(2, 4, 70)
    for _ in range(2):  # the second call finds the SM80 forward in the launcher's memo
        flash_fwd(q, q, q, softmax_scale=0.5)
        assert kernels == {"sm80_fwd"}
        kernels.clear()
    flash_bwd(dout, q, q, q, q, lse, softmax_scale=0.5)
    assert kernels == {"sm80_bwd"}
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")  # the Hopper default
    kernels.clear()
    flash_fwd(q, q, q, softmax_scale=0.5)
    assert kernels == {"sm90_fwd"}
    kernels.clear()
    flash_bwd(dout, q, q, q, q, lse, softmax_scale=0.5)
    assert kernels == {"sm90_bwd"}
    kernels.clear()
    cache, new = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16), torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    flash_fwd_kvcache(q[:, :1], cache, cache, k=new, v=new, cache_seqlens=7, softmax_scale=0.5, num_splits=1)
    assert kernels == {"sm90_fwd"}
    kinds = [type(launch.config).__name__ for launch in recorder.launches]
    assert kinds[-1:] == ["Sm90FwdConfig"] and {"PreprocessConfig", "DQConvertConfig", "AppendConfig"} <= set(kinds)


def test_dense_backwards_on_sm90_default_to_the_hopper_kernel(recorder, monkeypatch):
    """Without CUTE_FLASH_ARCH_PATH an sm_90 dense backward launches the preprocess, the Hopper
    kernel and the Hopper dQ convert, with LSE (times log2 e) and D in rows padded to whole
    query blocks (+inf and 0 past seqlen_q; the preprocess writes both there), and
    with dropout too (given the forward's Philox state), the bucket 96 on tiles of its own (at
    d 80 the preprocess and the convert predicating the columns), deterministic (with one zeroed
    semaphore per dQaccum tile), the bucket 160 on the d 192 tiles (64 keys a CTA); sm80 in the
    variable, or another GPU, take the SM80 kernel."""
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
    from cute_flash.launch.backward import flash_bwd

    q, dout = (torch.randn(2, 70, 4, 20, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 90, 2, 20, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(2, 4, 70)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    dq, dk, dv, softmax_d = flash_bwd(dout, q, k, v, q, lse, softmax_scale=0.5, causal=True, softcap=5.0)
    pre, main, convert = recorder.launches
    assert [type(x.config) for x in (pre, main, convert)] == [PreprocessConfig, Sm90BwdConfig, DQConvertConfig]
    assert main.config.has_right and main.config.has_softcap and not main.config.has_left
    assert main.config.traits.head_dim == 32 and main.config.traits.block_m == 128 and convert.config.hopper
    assert not convert.config.even_k  # d 20 of 32: the convert predicates the columns
    padded = (2, 4, 128)
    # the preprocess writes LSE times log2 e and D (0 and +inf past the 70 rows) where the kernel reads them
    assert pre.config.hopper_rows == 128 and pre["mLSE"] is lse
    assert main["mLSE"].shape == padded and pre["mLSEPadded"] is main["mLSE"] and pre["mDPadded"] is main["mD"]
    assert pre["mD"].data_ptr() == main["mD"].data_ptr() and pre["mD"].shape == (2, 4, 70)
    assert softmax_d.shape == (2, 4, 70) and softmax_d.data_ptr() == main["mD"].data_ptr()
    assert main["mdQaccum"].shape == (1, 2, 4, 1, 128 * 32) and convert["mdQaccum"] is main["mdQaccum"]
    assert main["mdK"].shape == (2, 90, 4, 24)  # per query head, summed over the group after
    assert (main["window_left"], main["window_right"]) == (-1, 0) and main["softmax_scale"] == 0.5
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape

    flash_bwd(dout, q, k, v, q, lse, softmax_scale=0.5, dropout=DropoutArgs.seeded(0.1, 1, 2, "cpu"))
    pre, main, convert = recorder.launches[3:6]
    assert [type(x.config) for x in (pre, main, convert)] == [PreprocessConfig, Sm90BwdConfig, DQConvertConfig]
    assert main.config.has_dropout and main["mRng"] is not None and main["mSemaphore"] is None
    for d, even in ((96, True), (80, False)):  # the bucket 96 on tiles of its own, columns past d 80 zero
        q96 = torch.randn(2, 70, 4, d, dtype=torch.bfloat16)
        flash_bwd(q96, q96, q96, q96, q96, lse, softmax_scale=0.5)
        pre, main, convert = recorder.launches[-3:]
        assert main.config.traits.head_dim == 96 and main["mQ"].shape[-1] == d
        assert pre.config.head_dim == 96 and pre.config.even_k == convert.config.even_k == even
    flash_bwd(dout, q, k, v, q, lse, softmax_scale=0.5, deterministic=True)
    main = recorder.launches[-2]
    assert isinstance(main.config, Sm90BwdConfig) and main.config.deterministic
    assert main["mSemaphore"].dtype == torch.int32 and main["mSemaphore"].shape == (2, 4, 1)
    assert not main["mSemaphore"].any()
    q160 = torch.randn(2, 70, 4, 160, dtype=torch.bfloat16)  # the bucket 160 on the d 192 tiles
    flash_bwd(q160, q160, q160, q160, q160, lse, softmax_scale=0.5)
    pre, main, convert = recorder.launches[-3:]
    assert isinstance(main.config, Sm90BwdConfig) and main.config.traits.head_dim == 192
    assert main.config.traits.block_n == 96 and main["mQ"].shape[-1] == 160
    assert pre.config.head_dim == 192 and not pre.config.even_k and not convert.config.even_k
    del recorder.launches[3:]  # the calls below all take the SM80 kernel
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_bwd(dout, q, k, v, q, lse, softmax_scale=0.5)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    monkeypatch.setattr(gpu, "device_arch", lambda index: 80)
    flash_bwd(dout, q, k, v, q, lse, softmax_scale=0.5)
    mains = [x.config for x in recorder.launches[3:] if not isinstance(x.config, (PreprocessConfig, DQConvertConfig))]
    assert [type(c) for c in mains] == [BwdConfig] * 2


def test_packed_backwards_on_sm90_take_the_hopper_kernel(recorder, monkeypatch):
    """Without CUTE_FLASH_ARCH_PATH an sm_90 packed backward launches the packed preprocess, the
    Hopper kernel's `call_varlen` and the packed Hopper dQ convert, the preprocess writing LSE
    (times log2 e) and D in the rows the Hopper kernel reads, padded per sequence to whole query
    blocks (`PreprocessConfig.hopper_rows`); deterministic too, with one zeroed semaphore per
    dQaccum tile; causal, deterministic or not, with each sequence's key blocks listed last first
    (`policy.packed_bwd_by_sequence`; deterministic: `dq_descending`)."""
    from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
    from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd_varlen
    from cute_flash.launch.varlen_order import key_blocks_longest_first

    q, dout = (torch.randn(75, 4, 20, dtype=torch.bfloat16) for _ in range(2))
    k = torch.randn(90, 2, 20, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 70, 70, 75], dtype=torch.int32), torch.tensor([0, 50, 60, 90], dtype=torch.int32)
    lse = torch.randn(4, 75)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    lens = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=70, max_seqlen_k=50, softmax_scale=0.5)
    dq, dk, dv, softmax_d = flash_bwd_varlen(dout, q, k, k, q, lse, causal=True, **lens)
    pre, main, convert = recorder.launches
    assert [type(x.config) for x in (pre, main, convert)] == [PreprocessConfig, Sm90BwdConfig, DQConvertConfig]
    assert main.config.varlen and main.config.has_right and not main.config.has_seqused_k
    assert pre.config.varlen and convert.config.varlen and convert.config.hopper
    assert main["mCuSeqlensQ"] is cu_q and main["mCuSeqlensK"] is cu_k
    # (sequence, key block) by sequence under the causal mask (`policy.packed_bwd_by_sequence`),
    # those whose first key block the most query blocks see first: sequence 1 has no query
    assert main["mTiles"].tolist() == [[0, 0], [2, 0], [1, 0]]  # 90 // 128 + 3 entries, all listed
    assert torch.equal(main["mTiles"], key_blocks_longest_first(cu_q, cu_k, 90, 128, 128, 0, descending=True))
    tiles = 75 // 128 + 3 + 1
    assert main["mLSE"].shape == main["mD"].shape == (4, tiles * 128)
    # the preprocess writes them: the forward's LSE in, LSE times log2 e and D out, padded per sequence
    assert pre.config.hopper_rows == main.config.traits.block_m == 128
    assert pre["mLSE"] is lse and pre["mLSEPadded"] is main["mLSE"] and pre["mDPadded"] is main["mD"]
    assert pre["mD"].shape == (4, 75) and softmax_d.data_ptr() == pre["mD"].data_ptr()
    assert main["mdQaccum"].shape == (1, 4, tiles, 128 * 32) and convert["mdQaccum"] is main["mdQaccum"]
    assert main["mdK"].shape == (90, 4, 24)  # per query head, summed over the group after
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape

    flash_bwd_varlen(dout, q, k, k, q, lse, deterministic=True, **lens)
    assert [type(x.config) for x in recorder.launches[3:]] == [PreprocessConfig, Sm90BwdConfig, DQConvertConfig]
    main = recorder.launches[4]
    assert main.config.deterministic and main.config.varlen and main["mSemaphore"].shape == (4, tiles)
    assert main["mSemaphore"].dtype == torch.int32 and not main["mSemaphore"].any()
    assert not main.config.dq_descending  # no right edge: key blocks by their work, not by sequence
    assert torch.equal(main["mTiles"], key_blocks_longest_first(cu_q, cu_k, 90, 128, 128, -1))
    flash_bwd_varlen(dout, q, k, k, q, lse, deterministic=True, causal=True, **lens)
    main = recorder.launches[7]
    assert main.config.dq_descending  # a right edge: each sequence's key blocks listed last first
    assert torch.equal(main["mTiles"], key_blocks_longest_first(lens["cu_seqlens_q"], lens["cu_seqlens_k"], 90,
                                                                main.config.traits.block_m, 128, 0, descending=True))


@pytest.mark.parametrize("arch", [86, 89, 120, 121])
def test_99_kb_gpus_get_tiles_that_fit(recorder, monkeypatch, arch):
    """On GPUs with 99 KB of shared memory per block (sm_86 / sm_89, and consumer Blackwell,
    sm_120 / sm_121: 101376 bytes opt-in) the forward, the KV-cache kernel and the backward
    launch tiles that fit (the backward's dQ adds: one float per atomic before sm_90, four
    after); a backward no tiles fit (d 256) is refused with the limit, not launched to fail."""
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.launch import flash_fwd, kvcache
    from cute_flash.launch.backward import flash_bwd

    limit = 101376
    monkeypatch.setattr(gpu, "device_arch", lambda index: arch)
    q, k, v, dout = (torch.randn(2, 70, 4, 128, dtype=torch.float16) for _ in range(4))
    flash_bwd(dout, q, k, v, q, torch.randn(2, 4, 70), softmax_scale=0.5, causal=True)
    (main,) = [x.config for x in recorder.launches if isinstance(x.config, BwdConfig)]
    assert main.traits.block_n == 64 and main.smem_bytes <= limit and main.dq_vec == (1 if arch < 90 else 4)
    q256 = torch.randn(2, 70, 4, 256, dtype=torch.float16)
    flash_fwd(q256, q256, q256, softmax_scale=0.5)
    assert recorder.launches[-1].config.traits.block_m == 64
    assert recorder.launches[-1].config.smem_bytes <= limit
    cache = torch.randn(2, 300, 4, 256, dtype=torch.float16)
    kvcache.flash_fwd_kvcache(q256[:, :1], cache, cache, cache_seqlens=300, softmax_scale=0.125)
    assert recorder.launches[-1].config.smem_bytes <= limit
    with pytest.raises(ValueError, match=f"{limit} bytes"):
        flash_bwd(q256, q256, q256, q256, q256, torch.randn(2, 4, 70), softmax_scale=0.5)


def test_gpus_before_sm80_are_refused(monkeypatch):
    from cute_flash.launch import gpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    gpu.device_arch.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="sm_75"):
            gpu.device_arch(0)
    finally:
        gpu.device_arch.cache_clear()


def test_softcap_and_alibi_scales(recorder):
    from cute_flash.kernels.common.constants import LOG2E
    from cute_flash.launch import flash_fwd

    q = torch.randn(3, 5, 4, 64, dtype=torch.bfloat16)
    slopes = torch.rand(4)
    flash_fwd(q, q, q, softmax_scale=0.25, softcap=10.0, alibi_slopes=slopes)
    (launch,) = recorder.launches
    assert launch["mAlibi"].shape == (3, 4) and torch.equal(launch["mAlibi"][2], slopes)
    assert (launch["scale_log2"], launch["score_premul"], launch["alibi_div"]) == pytest.approx(
        (10.0 * LOG2E, 0.025, 0.1))
    assert launch.config.has_alibi and launch.config.has_softcap


@pytest.mark.parametrize("scale, q_sign", [(-0.5, -1), (0.0, 0)])
def test_scales_at_or_below_zero_reach_the_kernels_positive(recorder, monkeypatch, scale, q_sign):
    """launch/args.py:positive_scale: every entry point hands the kernels |scale| with -q
    (scale 1 with q = 0 at scale 0); the backward's dq is multiplied back by the sign."""
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.common.constants import LOG2E
    from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
    from cute_flash.launch import flash_fwd, flash_fwd_kvcache, flash_fwd_varlen
    from cute_flash.launch.backward import flash_bwd

    kernel_scale = -scale if scale else 1.0
    q = torch.randn(2, 5, 4, 64, dtype=torch.float16)
    q_before = q.clone()
    flash_fwd(q, q, q, softmax_scale=scale, causal=True)
    varlen_q = q.flatten(0, 1)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    flash_fwd_varlen(varlen_q, varlen_q, varlen_q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                     max_seqlen_k=6, softmax_scale=scale)
    flash_fwd_kvcache(q, q, q, cache_seqlens=5, softmax_scale=scale, num_splits=1)
    for launch, given in zip(recorder.launches, (q, varlen_q, q)):
        assert torch.equal(launch["mQ"], given * q_sign)
        assert launch["scale_log2"] == pytest.approx(kernel_scale * LOG2E)
        assert launch["alibi_div"] == pytest.approx(1 / kernel_scale)
    assert torch.equal(q, q_before)  # the caller's q is untouched

    recorder.launches.clear()
    dq = torch.ones_like(q)
    got, *_ = flash_bwd(q, q, q, q, q, torch.randn(2, 4, 5), softmax_scale=scale, dq=dq)
    main, convert = (x for x in recorder.launches if isinstance(x.config, (BwdConfig, DQConvertConfig)))
    assert torch.equal(main["mQ"], q * q_sign) and main["softmax_scale"] == kernel_scale
    assert convert["scale"] == kernel_scale
    assert got is dq  # the caller's dq, written then signed in place


def test_signed_dq():
    from cute_flash.launch.backward import _signed_dq

    dq, dk = torch.tensor([1.0, -2.0]), torch.tensor([3.0])
    assert _signed_dq((dq, dk, dk, None), 1)[0].tolist() == [1.0, -2.0]
    assert _signed_dq((dq, dk, dk, None), -1)[0].tolist() == [-1.0, 2.0] and dk.tolist() == [3.0]
    assert _signed_dq((dq, dk, dk, None), 0)[0].tolist() == [0.0, 0.0]


def test_varlen_launch_arguments(recorder):
    from cute_flash.launch import flash_fwd_varlen

    q = torch.randn(9, 4, 64, dtype=torch.float16)
    k = torch.randn(11, 2, 64, dtype=torch.float16)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    used = torch.tensor([3, 5], dtype=torch.int32)
    out, lse = flash_fwd_varlen(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                max_seqlen_k=6, softmax_scale=0.125, seqused_k=used)
    launch = recorder.launches[-1]
    assert launch.config.varlen and launch.config.has_seqused_k and not launch.config.paged
    assert launch["mO"].shape == (9, 4, 64) and launch["mLSE"].shape == (4, 9)
    assert launch["mCuSeqlensQ"] is cu_q and launch["mCuSeqlensK"] is cu_k and launch["mSeqUsedK"] is used
    assert launch["max_seqlen_q"] == 5
    assert out.shape == q.shape and lse.shape == (4, 9)

    pages = torch.randn(3, 16, 2, 64, dtype=torch.float16)
    table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    flash_fwd_varlen(q, pages, pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                     softmax_scale=0.125, block_table=table)
    launch = recorder.launches[-1]
    assert launch.config.paged and not launch.config.any_page_size
    assert launch["mBlockTable"] is table and launch["mK"] is pages

    odd = torch.randn(7, 3, 2, 64, dtype=torch.float16)  # pages of 3 rows: the per-row kernel
    flash_fwd_varlen(q, odd, odd, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                     softmax_scale=0.125, block_table=table)
    launch = recorder.launches[-1]
    assert launch.config.paged and launch.config.any_page_size and launch["mK"] is odd


def test_gqa_decode_folds_the_group_into_m_and_splits(recorder):
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.float16)
    seqlens = torch.tensor([1000, 3], dtype=torch.int32)
    out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=3)
    (launch,) = recorder.launches  # one launch: the merge runs inside it
    assert [(c.split, c.pack_gqa) for c in recorder.configs] == [(True, True)]  # no unsplit kernel alongside
    assert launch["mQ"] is q and launch["mO"] is out and launch["mLSE"] is lse  # the kernel folds the heads
    # partials by (split, b, nheads_k, group row)
    assert launch["mOaccum"].shape == (3, 2, 2, 4, 64) and launch["mLSEaccum"].shape == (3, 2, 2, 4)
    counters = launch["mCounters"]
    assert counters.shape == (1 * 2 * 2,) and not counters.any()  # m_blocks x b x nheads_k, zeroed
    assert launch["num_splits"] == 3 and launch["mCacheSeqlens"] is seqlens
    assert lse.shape == (2, 8, 1) and out.shape == q.shape


@pytest.mark.parametrize("max_q, max_k", [(0, 9), (4, 0)])
def test_packed_backward_with_a_zero_maximum_launches_nothing(recorder, max_q, max_k):
    """max_seqlen_q or max_seqlen_k 0 (the forward answered 0 / +inf without a launch): zero
    gradients, written into the caller's tensors, and no kernel (its grid would be empty)."""
    from cute_flash.launch.backward import flash_bwd_varlen

    q, k = torch.randn(9, 4, 64, dtype=torch.bfloat16), torch.randn(9, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    dq = torch.ones_like(q)
    grads = flash_bwd_varlen(q, q, k, k, q, torch.randn(4, 9), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_q,
                             max_seqlen_k=max_k, softmax_scale=0.5, dq=dq)
    assert recorder.launches == []
    assert grads[0] is dq and not dq.any() and not grads[1].any() and not grads[2].any()
    assert grads[1].shape == k.shape and grads[3].shape == (4, 9) and not grads[3].any()


@pytest.mark.parametrize("path", ["sm90", "sm80"])
@pytest.mark.parametrize("num_splits, window", [(1, -1), (3, -1), (12, -1), (0, 100)])
def test_a_learnable_sink_goes_into_either_kv_cache_kernel(recorder, monkeypatch, path, num_splits, window):
    """Both KV-cache kernels add a learnable sink in their epilogue (`gqa_fold.row_sinks`): the
    config has the sink, the kernel gets the logits as contiguous fp32 (heads,), and no fold
    runs on the host, unsplit, split (on the Hopper entry in a cluster, or through the
    workspace) and, with a window, under the Hopper entry's query fold; the caller's out and
    LSE are the kernel's where nothing is folded on the host."""
    from cute_flash import sinks
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd_kvcache

    monkeypatch.setattr(sinks, "fold", lambda *args: pytest.fail("a sink folded on the host"))
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q = torch.randn(2, 4 if window > 0 else 1, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(2, 2000, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([1999, 3], dtype=torch.int32)
    sink = torch.randn(16, dtype=torch.bfloat16)[::2]  # strided, not fp32: the launcher's copy goes in
    out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=num_splits,
                                 learnable_sink=sink, window_size=(window, 0) if window > 0 else (-1, -1))
    launch = recorder.launches[-1]
    config = launch.config
    assert isinstance(config, Sm90FwdConfig if path == "sm90" else FwdConfig) and config.learnable_sink
    assert launch["mSink"].dtype == torch.float32 and launch["mSink"].is_contiguous()
    assert torch.equal(launch["mSink"], sink.float())
    assert config.split == (launch["num_splits"] > 1) and lse.shape == (2, 8, q.shape[1])
    if path == "sm90":
        assert config.cluster_merge == (num_splits == 3) and config.query_group == (4 if window > 0 else 1)
    if window < 0 or path == "sm80":
        assert launch["mO"] is out and launch["mLSE"] is lse


def test_kvcache_on_sm90_defaults_to_the_hopper_entry(recorder, monkeypatch):
    """Without CUTE_FLASH_ARCH_PATH (or with sm90) a KV-cache call on sm_90 launches the Hopper
    kernel's KV-cache entry (64-row tiles) after the append, with the SM80 entry's parameters:
    the caller's q, out and LSE themselves (the GQA group is folded into rows inside the entry,
    `pack_gqa`), cache_seqlens and the appended row count as the key lengths; split, the
    partials and counters laid out as the SM80 kernel's; paged, in pages of a multiple of its
    128-key blocks, with the block table. Pages of 16 rows, cache_batch_idx, a window (the
    host's query fold in place of pack_gqa) or `CUTE_FLASH_ARCH_PATH=sm80` change what is
    launched as said below."""
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([999, 3], dtype=torch.int32)
    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    out, lse = flash_fwd_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=seqlens, softmax_scale=0.125,
                                 num_splits=1)
    _, launch = recorder.launches  # the append, then attention
    config = launch.config
    assert isinstance(config, Sm90FwdConfig) and config.kvcache and not config.split and not config.persistent
    assert config.pack_gqa and config.traits.block_m == 64 and not (config.has_left or config.has_right)
    assert launch["mQ"] is q and launch["mO"] is out and launch["mLSE"] is lse
    assert out.shape == q.shape and lse.shape == (2, 8, 1)
    assert launch["mSeqlensK"] is seqlens and launch["k_extra"] == 1 and launch["mK"] is cache
    assert launch["mOaccum"] is None and launch["num_splits"] == 1
    assert launch["mLeftpadK"] is None and launch["mBatchIdx"] is None

    out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=3)
    split = recorder.launches[-1]
    # up to 8 splits: one cluster, merged in shared memory, no workspace
    assert isinstance(split.config, Sm90FwdConfig) and split.config.split and split["num_splits"] == 3
    assert split.config.cluster_merge and split["mOaccum"] is None and split["mCounters"] is None
    assert split["mO"] is out and split["mLSE"] is lse

    long_cache = torch.randn(2, 2000, 2, 64, dtype=torch.bfloat16)
    for splits in (8, 9):  # a portable cluster's limit, and one past it
        flash_fwd_kvcache(q, long_cache, long_cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=splits)
        assert recorder.launches[-1]["num_splits"] == splits
        assert recorder.launches[-1].config.cluster_merge == (splits <= 8)
    out, lse = flash_fwd_kvcache(q, long_cache, long_cache, cache_seqlens=seqlens, softmax_scale=0.125,
                                 num_splits=12)
    split = recorder.launches[-1]
    assert split.config.split and not split.config.cluster_merge and split["num_splits"] == 12
    # partials by (split, b, nheads_k, group row), one zeroed counter per (m-block, b, nheads_k)
    assert split["mOaccum"].shape == (12, 2, 2, 4, 64) and split["mLSEaccum"].shape == (12, 2, 2, 4)
    assert split["mCounters"].shape == (4,) and not split["mCounters"].any()
    assert split["mO"] is out and split["mLSE"] is lse

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    big_table = torch.arange(2 * 4, dtype=torch.int32).view(2, 4)
    big_pages = torch.randn(8, 256, 2, 64, dtype=torch.bfloat16)
    flash_fwd_kvcache(q, big_pages, big_pages, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=1,
                      block_table=big_table, window_size=(5, -1))
    paged = recorder.launches[-1]
    assert isinstance(paged.config, Sm90FwdConfig) and paged.config.paged and paged["mBlockTable"] is big_table
    assert paged["mK"] is big_pages and paged.config.has_left and not paged.config.pack_gqa
    # a window edge: the host's query fold (`query_group`), the group's 4 heads as 4 rows of each kv head
    assert paged.config.query_group == 4 and paged["window_left"] == 5
    assert paged["mQ"].shape == (2, 4, 2, 64) and torch.equal(paged["mQ"][:, 3, 1], q[:, 0, 7])
    assert paged["mO"].shape == (2, 4, 2, 64) and paged["mLSE"].shape == (2, 2, 4)

    table = torch.arange(2 * 63, dtype=torch.int32).view(2, 63)
    pages = torch.randn(126, 16, 2, 64, dtype=torch.bfloat16)
    flash_fwd_kvcache(q, pages, pages, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=1, block_table=table)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=1,
                      cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32))
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=1)
    assert [type(x.config) for x in recorder.launches[7:]] == [FwdConfig] * 3


def test_hopper_entry_folds_several_query_rows(recorder, monkeypatch):
    """Five causal query rows of 8 heads over 2 kv heads (speculative decoding's verify step):
    the Hopper entry's query fold, q copied to 20 rows of each kv head (row j + 4 i: query i of
    head 4 kh + j), the kernel's O and LSE in that layout, the caller's back in theirs (the
    kernel's rows unfolded); ALiBi or a fold that does not halve the tiles keeps the rows."""
    from cute_flash.launch import flash_fwd_kvcache
    from cute_flash.launch.kvcache import fold_queries

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    q = torch.randn(2, 5, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([999, 3], dtype=torch.int32)
    out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, causal=True,
                                 num_splits=1)
    launch = recorder.launches[-1]
    assert launch.config.query_group == 4 and launch.config.has_right and not launch.config.pack_gqa
    assert torch.equal(launch["mQ"], fold_queries(q, 4)) and torch.equal(launch["mQ"][:, 4 * 3 + 2, 1], q[:, 3, 6])
    assert launch["mO"].shape == (2, 20, 2, 64) and launch["mLSE"].shape == (2, 2, 20)
    assert out.shape == q.shape and lse.shape == (2, 8, 5)

    flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, causal=True, num_splits=1,
                      alibi_slopes=torch.rand(8))
    assert recorder.launches[-1].config.query_group == 1 and recorder.launches[-1]["mQ"] is q
    q_long = torch.randn(2, 64, 8, 64, dtype=torch.bfloat16)  # 4 x 1 tiles against 4 folded: no gain
    flash_fwd_kvcache(q_long, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, causal=True, num_splits=1)
    assert recorder.launches[-1].config.query_group == 1


def test_queries_written_in_the_folds_order_take_no_fold_copy(recorder, monkeypatch):
    """`kvcache_query_group` names the fold a call takes (4 for five causal rows of 8 heads over
    2, as above; 1 with ALiBi), under the signature the call then finds; q whose heads already
    come in that order (`folded_q`: the packed call's packing launch writes them so) reaches the
    kernel as a view of the same memory, and out / LSE come back folded. `folded_q` on a call
    that does not fold is refused."""
    from cute_flash.launch import flash_fwd_kvcache, kvcache_query_group
    from cute_flash.launch import kvcache
    from cute_flash.launch.kvcache import fold_queries

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    monkeypatch.setattr(kvcache, "_calls", {})
    q = torch.randn(2, 5, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([999, 3], dtype=torch.int32)
    opts = dict(cache_seqlens=seqlens, block_table=None, softmax_scale=0.125, causal=True, num_splits=1)
    assert kvcache_query_group(q, cache, cache, signature="sig", **opts) == 4
    assert list(kvcache._calls) == [("sig", "sm90")] and recorder.launches == []
    assert kvcache_query_group(q, cache, cache, alibi_slopes=torch.rand(8), **opts) == 1
    q_folded = fold_queries(q, 4).view(q.shape)
    out, lse = flash_fwd_kvcache(q_folded, cache, cache, signature="sig", folded_q=True, **opts)
    launch = recorder.launches[-1]
    assert launch.config.query_group == 4 and launch["mQ"].data_ptr() == q_folded.data_ptr()
    assert torch.equal(launch["mQ"], fold_queries(q, 4))
    assert out is launch["mO"] and out.shape == (2, 20, 2, 64) and lse.shape == (2, 2, 20)
    with pytest.raises(ValueError, match="folded_q"):
        flash_fwd_kvcache(q, cache, cache, alibi_slopes=torch.rand(8), folded_q=True, **opts)


def test_hopper_entry_splits_for_one_cta_per_sm(recorder, monkeypatch):
    """The split count of the Hopper entry (num_splits=0) fits its CTAs in one per SM (132 on
    the recorder's GPU): one sequence of 2 kv heads over 1000 keys (8 blocks of 128) splits 8
    ways (16 CTAs); the SM80 kernel's count for the same call assumes two per SM."""
    from cute_flash.launch.policy import num_splits_heuristic
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(1, 1000, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=1000, softmax_scale=0.125, num_splits=0)
    (launch,) = recorder.launches
    assert launch["num_splits"] == num_splits_heuristic(2, 132, 8, ctas_per_sm=1) == 8


def test_hopper_entry_splits_count_the_clusters_the_gpu_holds(recorder, monkeypatch):
    """The Hopper entry's splits (up to 8) merge in one cluster, and an H200 holds 15 clusters of
    8 at once, not 16: 2 sequences of 8 kv heads (16 tiles) over 1000 keys (8 blocks of 128)
    split 4 ways (16 clusters of 4, 30 at once), where counting every SM would give 8. The SM80
    kernel merges through global memory: its count reads no clusters (8 splits, where the
    two-CTAs-an-SM table would give 4)."""
    from cute_flash.launch.policy import num_splits_heuristic
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.randn(2, 1000, 8, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=1000, softmax_scale=0.125, num_splits=0)
    assert recorder.launches[-1]["num_splits"] == 4
    assert num_splits_heuristic(16, 132, 8, ctas_per_sm=1) == 8
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=1000, softmax_scale=0.125, num_splits=0)
    sm80 = recorder.launches[-1]
    assert sm80.config.traits.block_n == 128 and sm80["num_splits"] == 8


def test_hopper_entry_streams_where_the_rule_takes_many_waves(recorder, monkeypatch):
    """Where the split rule takes many waves of equal splits (11 sequences of 8 kv heads, 88
    tiles, over 8192 keys: 64 blocks of 128, 11 splits, `split_choice`), the Hopper entry
    launches stream-K instead: one CTA on each of the 132 SMs (the kernel's num_splits), and a
    workspace of 2 partials a tile (a tile is 132 units and a CTA 88; a tile starts 0 or 44
    units into a CTA's, so it meets two). The SM80 kernel keeps its equal splits."""
    from cute_flash.launch.policy import SplitChoice, split_choice
    from cute_flash.launch import flash_fwd_kvcache

    assert split_choice(88, 132, 64, ctas_per_sm=1, clusters=H200_CLUSTERS[1]) == SplitChoice(11, stream_k=True)
    q = torch.randn(11, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.randn(11, 8192, 8, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=8192, softmax_scale=0.125, num_splits=0)
    stream = recorder.launches[-1]
    assert stream.config.stream_k and stream.config.split and not stream.config.cluster_merge
    assert stream["num_splits"] == 132
    assert stream["mOaccum"].shape == (2, 11, 8, 4, 128) and stream["mCounters"].shape == (88,)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=8192, softmax_scale=0.125, num_splits=0)
    assert not getattr(recorder.launches[-1].config, "stream_k", False)


@pytest.mark.parametrize("b, capacity, pdl", [
    (8, 32768, False),   # 64 tiles x 2 splits: 128 CTAs on 132 SMs, 16k keys each
    (8, 131072, False),  # 64k keys each
    (16, 16384, False),  # 128 tiles unsplit, 16k keys each
    (8, 8192, True),     # 4096 keys each
    (1, 131072, True),   # 8 tiles x 16 splits of 8192 keys: at the limit
    (32, 131072, True),  # 256 tiles: more CTAs than SMs
    (11, 131072, True),  # stream-K: one CTA on every SM
    (40, 1024, True),    # 320 tiles at two CTAs an SM
])
def test_hopper_entry_launches_as_a_dependent_where_it_pays(recorder, monkeypatch, b, capacity, pdl):
    """The Hopper entry launches as a programmatic dependent (`takes_dependent_launch`) unless
    its CTAs fit in one wave that leaves SMs idle and each streams more than 8192 keys (32 / 8
    heads, d 128, the default split count; the recorder's GPU has 132 SMs). The tuning override
    sets it either way."""
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(b, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.empty(b, capacity, 8, 128, dtype=torch.bfloat16)  # never read on the host
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=capacity, softmax_scale=0.125, num_splits=0)
    launch = recorder.launches[-1]
    assert launch.config.dependent_launch == pdl
    assert launch.config.stream_k == (b == 11) and launch.config.ctas_per_sm == (2 if b == 40 else 1)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=capacity, softmax_scale=0.125, num_splits=0,
                      hopper_variant=dict(dependent_launch=not pdl))
    assert recorder.launches[-1].config.dependent_launch == (not pdl)


def test_hopper_variant_sets_the_cache_stages(recorder, monkeypatch):
    """`hopper_variant`'s stages reach the KV-cache config (d 64 at one CTA an SM: 3 by default,
    `cache_stages`); stages that do not fit an SM's shared memory raise before any compile."""
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(8, 1, 32, 64, dtype=torch.bfloat16)
    cache = torch.empty(8, 32768, 8, 64, dtype=torch.bfloat16)  # never read on the host
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    for stages in (None, 3, 4):
        variant = {} if stages is None else dict(stages=stages)
        flash_fwd_kvcache(q, cache, cache, cache_seqlens=32768, softmax_scale=0.125, num_splits=0,
                          hopper_variant=variant)
        assert recorder.launches[-1].config.stages == (stages or 3)
    launches = len(recorder.launches)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        flash_fwd_kvcache(q, cache, cache, cache_seqlens=32768, softmax_scale=0.125, num_splits=0,
                          hopper_variant=dict(stages=8))
    assert len(recorder.launches) == launches


@pytest.mark.parametrize("d, b, cache, stages", [
    (64, 8, 32768, 3),   # one CTA an SM, split: three stages
    (64, 32, 8192, 3),   # one CTA an SM, unsplit
    (32, 1, 131072, 3),
    (64, 40, 1024, 2),   # two CTAs an SM (`takes_two_ctas_per_sm`): not measured deeper
    (128, 8, 32768, 2),  # d 128: three stages gained nothing
])
def test_cache_stages_by_head_dim(recorder, monkeypatch, d, b, cache, stages):
    """The KV-cache entry's K / V pipeline depth (`policy.cache_stages`, measured in
    docs/tuning/decode.md): three stages at d <= 64 and one CTA an SM, else two."""
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(b, 1, 32, d, dtype=torch.bfloat16)
    k = torch.empty(b, cache, 8, d, dtype=torch.bfloat16)  # never read on the host
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_kvcache(q, k, k, cache_seqlens=cache, softmax_scale=0.125, num_splits=0)
    config = recorder.launches[-1].config
    assert config.stages == stages and config.ctas_per_sm == (2 if b == 40 else 1)


def test_hopper_configs_that_overflow_shared_memory_are_refused(recorder, monkeypatch):
    """The check lives in `Sm90FwdConfig`, so the dense entry's `stages` override meets it too:
    8 K / V stages of d 128 tiles do not fit an SM, and nothing launches."""
    from cute_flash.launch.hopper import flash_fwd_sm90

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(1, 1024, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        flash_fwd_sm90(q, q, q, softmax_scale=0.5, stages=8)
    assert not recorder.launches
    flash_fwd_sm90(q, q, q, softmax_scale=0.5, stages=2)
    assert recorder.launches[-1].config.stages == 2


def test_only_the_sm80_kernel_caps_splits_by_its_grid(recorder, monkeypatch):
    """The SM80 KV-cache kernel puts splits x heads on grid z (at most 65535), so 600 heads
    take at most 109 splits there; the Hopper entry puts the splits on grid x and keeps the 128
    asked for (32k keys: 128 key blocks of 256 for the SM80 kernel, 256 of 128 for Hopper)."""
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(1, 1, 600, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 256 * 128, 600, 8, dtype=torch.bfloat16)
    for path, splits in (("sm80", 65535 // 600), ("sm90", 128)):
        monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
        flash_fwd_kvcache(q, cache, cache, cache_seqlens=256 * 128, softmax_scale=0.125, num_splits=128)
        assert recorder.launches[-1]["num_splits"] == splits


def test_the_grid_cap_leaves_one_split(recorder, monkeypatch):
    """More heads than the grid's z holds (the batch-chunk tests shrink the limit to 2) leave
    the SM80 kernel one split, not zero: a grid with no split fails to launch on the GPU
    (tests/gpu/test_batch_chunks_gpu.py failed so when the cap lost its lower bound)."""
    from cute_flash.launch import batch_chunks, flash_fwd_kvcache

    monkeypatch.setattr(batch_chunks, "GRID_MAX_BATCH", 2)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    q = torch.randn(1, 1, 8, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1024, 8, 8, dtype=torch.bfloat16)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=1024, softmax_scale=0.125, num_splits=4)
    assert recorder.launches[-1]["num_splits"] == 1


def test_hopper_variant_overrides_the_cache_tiles(recorder, monkeypatch):
    """`tune --decode`'s override: the given tiles and CTAs an SM reach the config, and the split
    count is the one for that many CTAs an SM and its clusters: 6 sequences of 8 kv heads (48
    tiles) over 2000 keys in 32 blocks of 64 split 4 ways at two CTAs an SM (48 clusters of 4,
    62 at once; 5 ways would need 48 clusters of 5, 47 at once), 2 ways at one."""
    from cute_flash.launch.policy import num_splits_heuristic
    from cute_flash.launch import flash_fwd_kvcache
    from layouts.hopper import HopperTileTraits

    q = torch.randn(6, 1, 32, 64, dtype=torch.bfloat16)
    cache = torch.randn(6, 2000, 8, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    traits = HopperTileTraits(64, 64, 64, "bf16")
    for ctas in (2, 1):
        flash_fwd_kvcache(q, cache, cache, cache_seqlens=2000, softmax_scale=0.125, num_splits=0,
                          hopper_variant=dict(traits=traits, ctas_per_sm=ctas))
    two, one = recorder.launches
    assert two.config.traits == traits and two.config.ctas_per_sm == 2 and two.config.pack_gqa
    assert one.config.traits == traits and one.config.ctas_per_sm == 1
    assert two["num_splits"] == num_splits_heuristic(48, 132, 32, ctas_per_sm=2, clusters=H200_CLUSTERS[2]) == 4
    assert one["num_splits"] == num_splits_heuristic(48, 132, 32, ctas_per_sm=1, clusters=H200_CLUSTERS[1]) == 2
    assert num_splits_heuristic(48, 132, 32, ctas_per_sm=2) == 5  # every SM taking part: 240 CTAs in 264 slots


@pytest.mark.parametrize("b, capacity, d, num_splits, two", [
    (17, 1024, 128, 0, True),    # 136 tiles > 132 SMs, 1k keys: two CTAs an SM, unsplit
    (17, 4096, 64, 1, True),     # at the key limit, an explicit single split
    (16, 1024, 128, 0, False),   # 128 tiles fit one wave of one CTA an SM
    (17, 4097, 128, 0, False),   # past TWO_CTAS_MAX_KEYS
    (17, 1024, 160, 0, False),   # past TWO_CTAS_MAX_HEAD_DIM
    (17, 1024, 128, 2, False),   # an explicit split
])
def test_hopper_cache_entry_two_ctas_per_sm_rule(recorder, monkeypatch, b, capacity, d, num_splits, two):
    """The Hopper entry takes 64 x 64 tiles at two CTAs an SM (`takes_two_ctas_per_sm`) for
    unsplit decode over short caches whose tiles (b x 8 kv heads, the GQA fold: one 64-row
    tile each) outnumber the recorder's 132 SMs; otherwise its 64 x 128 tiles, one an SM."""
    from cute_flash.launch import flash_fwd_kvcache
    from layouts.hopper import choose_hopper_cache_traits

    q = torch.randn(b, 1, 32, d, dtype=torch.bfloat16)
    cache = torch.randn(b, capacity, 8, d, dtype=torch.bfloat16)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm90")
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=capacity, softmax_scale=0.125, num_splits=num_splits)
    (launch,) = recorder.launches
    assert launch.config.ctas_per_sm == (2 if two else 1)
    assert launch.config.traits == choose_hopper_cache_traits(d, "bf16", ctas_per_sm=2 if two else 1)
    assert launch["num_splits"] == max(num_splits, 1) and launch.config.pack_gqa


@pytest.mark.parametrize("sq, window, alibi", [(2, (-1, -1), False), (1, (8, -1), False), (1, (-1, -1), True)])
def test_no_gqa_fold_with_query_rows_window_or_alibi(recorder, sq, window, alibi):
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(2, sq, 8, 64, dtype=torch.float16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=9, softmax_scale=0.125, num_splits=2, window_size=window,
                      alibi_slopes=torch.rand(8) if alibi else None)
    (launch,) = recorder.launches
    assert launch.config.split and not launch.config.pack_gqa
    assert launch["mOaccum"].shape == (2, 2, 8, sq, 64)  # partials by (split, b, nheads, query row)


def test_call_setup_is_kept_per_signature(recorder, monkeypatch):
    from cute_flash.launch import kvcache

    setups = []
    real = kvcache._kvcache_call
    monkeypatch.setattr(kvcache, "_kvcache_call", lambda *a, **kw: setups.append(a) or real(*a, **kw))
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.float16)
    for signature in ("sig", "sig", None, None, "other"):
        recorder.launches.clear()
        out, _ = kvcache.flash_fwd_kvcache(q, cache, cache, cache_seqlens=17, softmax_scale=0.125, num_splits=3,
                                           signature=signature)
        (launch,) = recorder.launches
        assert torch.equal(launch["mCacheSeqlens"], torch.full((2,), 17, dtype=torch.int32))
        assert launch["num_splits"] == 3 and launch["mQ"] is q and out.shape == q.shape
    assert len(setups) == 4  # "sig" once, each call without a signature, "other" once


def test_split_workspace_is_kept_per_stream_and_fresh_under_capture(recorder):
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    cache = torch.randn(1, 4096, 2, 64, dtype=torch.float16)
    names = ("mLSE", "mOaccum", "mLSEaccum", "mCounters")

    def workspace():
        recorder.launches.clear()
        out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=9, softmax_scale=0.1, num_splits=4,
                                     return_lse=False, signature="sig")
        (launch,) = recorder.launches
        assert lse is None and launch["mLSE"].shape == (1, 8, 1)  # the final LSE goes to scratch
        return [launch[n] for n in names]

    first = workspace()
    assert all(a is b for a, b in zip(workspace(), first))  # same plan, same stream: reused
    recorder.stream = 8
    other = workspace()
    assert not any(a is b for a, b in zip(other, first))
    recorder.capturing = True
    captured = workspace()
    again = workspace()
    assert not any(a is b for a, b in zip(again, captured))  # each captured launch: its own
    assert not captured[3].any() and not again[3].any()  # fresh counters start at zero
    spans = sorted((c.data_ptr(), c.data_ptr() + 4 * c.numel()) for c in (first[3], other[3], captured[3], again[3]))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no counter shared


def test_captured_counters_come_from_a_reserve_zeroed_before_the_capture(monkeypatch):
    """`per_stream.zeroed_counters`: a launch being captured takes unused counters of the
    device's reserve, which the first call outside a capture zeroed, rather than zeroing
    some in the graph; with no reserve made, or none left, it zeroes them in the capture."""
    from cute_flash.launch import per_stream

    monkeypatch.setattr(per_stream, "_reserves", {})
    monkeypatch.setattr(per_stream, "RESERVE_COUNTERS", 8)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    zeroings = []  # for each torch.zeros: was a capture on?
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: zeroings.append(capturing[0]) or real_zeros(*a, **kw))
    cpu = torch.device("cpu")

    capturing[0] = True
    early = per_stream.zeroed_counters((2,), cpu)  # no reserve yet
    assert zeroings == [True] and early.tolist() == [0, 0]
    capturing[0] = False
    eager = per_stream.zeroed_counters((3,), cpu)
    assert zeroings == [True, False, False]  # the reserve, then this call's own
    capturing[0] = True
    first = per_stream.zeroed_counters((2,), cpu)
    second = per_stream.zeroed_counters((3, 2), cpu)  # 2 + 6: all 8 of the reserve
    assert zeroings == [True, False, False]  # nothing zeroed while capturing
    assert first.shape == (2,) and second.shape == (3, 2) and not first.any() and not second.any()
    first.fill_(1)
    assert not second.any() and not eager.any()  # disjoint
    third = per_stream.zeroed_counters((1,), cpu)  # none left
    assert zeroings == [True, False, False, True] and third.tolist() == [0]


def test_heuristic_split_count_and_unsplit_path(recorder):
    from cute_flash.launch.policy import num_splits_heuristic
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(1, 1, 4, 128, dtype=torch.float16)
    cache = torch.randn(1, 8192, 4, 128, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=5, softmax_scale=0.1, num_splits=0)
    (launch,) = recorder.launches
    assert launch.config.split and launch["num_splits"] == num_splits_heuristic(4, 132, 64)  # h_k * m_blocks = 4
    assert torch.equal(launch["mCacheSeqlens"], torch.full((1,), 5, dtype=torch.int32))  # int as a tensor

    recorder.launches.clear()
    flash_fwd_kvcache(q, cache[:, :100], cache[:, :100], cache_seqlens=5, softmax_scale=0.1, num_splits=0)
    (launch,) = recorder.launches  # one key block: no split
    assert not launch.config.split and launch["mO"].shape == (1, 1, 4, 128)


def test_append_is_launched_before_attention_with_rotary_options(recorder):
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(2, 3, 4, 64, dtype=torch.float16)
    cache = torch.randn(2, 64, 2, 64, dtype=torch.float16)
    k = torch.randn(2, 3, 2, 64, dtype=torch.float16)
    cos = torch.randn(64, 16, dtype=torch.float16)
    seqlens = torch.tensor([0, 10], dtype=torch.int32)
    flash_fwd_kvcache(q, cache, cache, k=k, v=k, rotary_cos=cos, rotary_sin=cos, cache_seqlens=seqlens,
                      softmax_scale=0.1, causal=True, rotary_interleaved=False, num_splits=1)
    append, attn = recorder.launches
    assert (append.config.paged, append.config.has_batch_idx, append.config.rotary, append.config.interleaved,
            append.config.q_per_row) == (False, False, True, False, True) and attn.config.kvcache
    assert append["mBatchIdx"] is None and append["mBlockTable"] is None  # absent: specialised away
    assert append["mKnew"] is k and append["mCacheSeqlens"] is seqlens and append["mQ"] is q
    assert append["mCos"].data_ptr() == cos.data_ptr() and append["mKcache"] is cache
    assert attn["mQ"] is append["mQrot"]  # attention reads the rotated q
    assert attn["num_splits"] == 1 and attn["k_extra"] == 3  # k_extra = seqlen_new


def test_empty_append_without_rotary_launches_attention_only(recorder):
    from cute_flash.launch import flash_fwd_kvcache

    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    cache = torch.randn(2, 64, 2, 64, dtype=torch.float16)
    k = torch.randn(2, 0, 2, 64, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=3, softmax_scale=0.1, num_splits=1)
    (launch,) = recorder.launches
    assert launch.config.kvcache and launch["k_extra"] == 0


def _entry_kind(config) -> str:
    """A config's kernel module and the entry it compiles, e.g. "sm80.fwd.call_varlen"."""
    from cute_flash.compile import registry

    module = registry.kernel_module(config)
    entry = getattr(module.entry(config), "__name__", "__call__")  # a kernel object: its __call__
    return f"{module.__name__.removeprefix('cute_flash.kernels.')}.{entry}"


@functools.cache
def _variants_by_entry() -> dict:
    """Every variant of every kernel (`every_variant(full=True)`) by `_entry_kind`."""
    from cute_flash.launch.variants import every_variant

    groups = {}
    for _, config in every_variant((80, 90), full=True):
        groups.setdefault(_entry_kind(config), []).append(config)
    return groups


def _entry_kinds() -> list:
    """The kinds of the CI subset's variants: every kernel and entry (the full lists add none)."""
    from cute_flash.launch.variants import every_variant

    return sorted({_entry_kind(config) for _, config in every_variant((80, 90))})


@pytest.mark.parametrize("kind", _entry_kinds())
def test_fake_arguments_follow_the_entry_signature(kind):
    """What a compile traces with (`registry.kernel_module(config).fake_args`) has one value per
    parameter of the entry the config compiles, in its order: for every variant of every kernel
    (`every_variant(full=True)`), grouped by kernel and entry."""
    from cute_flash.compile import registry

    assert set(_variants_by_entry()) == set(_entry_kinds())
    for config in _variants_by_entry()[kind]:
        module = registry.kernel_module(config)
        signature = inspect.signature(module.entry(config))
        args = module.fake_args(config)
        assert len(args) == len(signature.parameters), config.name
        signature.bind(*args)


def test_a_transposed_lse_reaches_the_sm80_backward_dense(recorder):
    """ring-flash-attn hands `_flash_attn_backward` its merged LSE as a transposed view (b, h, sq)
    of (b, sq, h): the kernel reads the LSE with a unit last stride, so the launcher passes a
    dense copy, equal to the view."""
    from cute_flash.launch.backward import flash_bwd

    q, dout = (torch.randn(2, 70, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(2, 70, 4).transpose(1, 2)
    flash_bwd(dout, q, q, q, q, lse, softmax_scale=0.5)
    main = next(launch for launch in recorder.launches if type(launch.config).__name__ == "BwdConfig")
    assert main["mLSE"].is_contiguous() and torch.equal(main["mLSE"], lse)


def test_packed_kvcache_queries_take_one_packing_launch(recorder):
    """`pack_kvcache_queries` is one launch of the packed append: its config from the call
    (paged, new keys, rotary; interleaving and per-row angles only with rotary; 16-byte copies
    where every tensor's rows allow them), q_pad viewed as (batch * max_seqlen_q) rows, the
    int64 flat row of each packed query returned, the query fold's order a run-time argument."""
    from cute_flash.kernels.sm80.append_packed import PackedAppendConfig
    from cute_flash.launch.kvcache import pack_kvcache_queries

    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    q_pad = torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16)
    lengths = torch.empty(2, dtype=torch.int32)
    cu, lens = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    k_cache, v_cache = (torch.randn(2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(5, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    flat = pack_kvcache_queries(q, q_pad, lengths, k_cache, v_cache, k, v, cu, cu, lens, None, None, True)
    (launch,) = recorder.launches
    assert launch.config == PackedAppendConfig("bf16", False, True, False, False, False, 8)
    assert launch["mQpad"].shape == (6, 4, 64) and launch["mQpad"].data_ptr() == q_pad.data_ptr()
    assert launch["mFlat"] is flat and flat.dtype == torch.int64 and flat.shape == (5,)
    assert launch["mLengths"] is lengths and launch["mCuSeqlensK"] is cu and launch["mBlockTable"] is None
    assert launch["fold"] == 1  # each row's heads as they come
    table = torch.zeros(2, 4, dtype=torch.int32)
    cos, sin = (torch.randn(32, 16, dtype=torch.bfloat16) for _ in range(2))
    pack_kvcache_queries(q, q_pad, lengths, k_cache, v_cache, None, None, cu, None, lens, table, (cos, sin, True),
                         False, 2)
    launch = recorder.launches[-1]
    assert launch.config == PackedAppendConfig("bf16", True, False, True, True, False, 8) and launch["fold"] == 2
    assert launch["mKnew"] is None and launch["mCuSeqlensK"] is None and launch["mBlockTable"] is table
    off = torch.randn(5 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(5, 4, 64)  # 2 bytes past an aligned start
    pack_kvcache_queries(off, q_pad, lengths, k_cache, v_cache, k, v, cu, cu, lens, None, None, True)
    assert recorder.launches[-1].config.vec == 1  # one element at a time
    wide = torch.randn(2, 16, 2, 65, dtype=torch.bfloat16)[..., :64]  # a head's row 65 elements apart
    pack_kvcache_queries(q, q_pad, lengths, wide, v_cache, k, v, cu, cu, lens, None, None, True)
    assert recorder.launches[-1].config.vec == 1


def test_a_hopper_variant_reaches_the_hopper_backward(recorder, monkeypatch):
    """`hopper_variant`'s Sm90BwdConfig fields replace the Hopper backward's (the dQ path, the
    tiles: `tune --bwd-dq`) on the bucket's config, the policy's path left out; the call's
    other choices stay the dispatcher's. Deterministic mode refuses another dQ path (its adds
    are its writer warps', in turn), and a config whose tiles do not fit shared memory is
    refused before it compiles (d 256's second Q / dO stage beside the dQ staging tile)."""
    from dataclasses import replace

    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd
    from layouts.hopper import choose_hopper_bwd_traits

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 70, 4, 128, dtype=torch.bfloat16)
    lse = torch.randn(2, 4, 70)
    for path, letters in (("bulk", ""), ("writer", "-W"), ("atomic", "-A")):
        flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, causal=True, hopper_variant=dict(dq_path=path))
        main = [launch for launch in recorder.launches if isinstance(launch.config, Sm90BwdConfig)][-1]
        assert main.config == Sm90BwdConfig(main.config.traits, has_right=True, dq_path=path)
        assert main.config.writes_dq_apart == (path == "writer") and main.config.stages_dq == (path != "atomic")
        assert main.config.name.endswith("_bf16-.R...." + letters)
    with pytest.raises(ValueError, match="dq_path"):
        flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, deterministic=True, hopper_variant=dict(dq_path="writer"))
    one_stage = choose_hopper_bwd_traits(256)
    two_stages = replace(one_stage, q_stages=2)
    assert Sm90BwdConfig(two_stages, dq_path="atomic").smem_bytes <= 232448
    with pytest.raises(ValueError, match="shared memory"):
        Sm90BwdConfig(two_stages)
    del recorder.launches[:]
    q256 = torch.randn(2, 70, 4, 256, dtype=torch.bfloat16)
    flash_bwd(q256, q256, q256, q256, q256, lse, softmax_scale=0.5, hopper_variant=dict(dq_path="bulk",
                                                                                          traits=one_stage))
    pre, main, convert = recorder.launches
    assert main.config == Sm90BwdConfig(one_stage) and main.config.name.startswith("sm90_bwd_d256_m64_n64_q1_")


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_hopper_backward_takes_the_policy_dq_path(recorder, monkeypatch, deterministic):
    """The default mode's dQ path per head dim, dense and packed (docs/tuning/backward.md, "The
    dQ paths measured"): the consumers' own bulk adds at d 32, the writer warps' at d 64 / 96 /
    128 and at d 160 / 192 (on 96-key tiles, one dO stage), vector atomics with two Q / dO
    stages at d 224 / 256; 128-row query blocks at d 32 and 64. Deterministic mode keeps its
    turns (bulk adds, staged), 64-row blocks at d 64, d 160 / 192's 96-key tiles, 64-key tiles
    above and d 256's one stage. The dQ convert is keyed by the tiles alone: the same config
    whatever the main kernel's stages."""
    from cute_flash.kernels.sm80.dq_convert import DQConvertConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    expected = {32: ("bulk", 2), 64: ("writer", 2), 96: ("writer", 2), 128: ("writer", 2), 160: ("writer", 2),
                192: ("writer", 2), 224: ("atomic", 2), 256: ("atomic", 2)}
    for d, (path, stages) in expected.items():
        keys = 96 if d in (160, 192) else (128 if d <= 128 else 64)
        if deterministic:
            path, stages = "bulk", 1 if d > 192 else 2
        q = torch.randn(2, 70, 4, d, dtype=torch.bfloat16)
        lse = torch.randn(2, 4, 70)
        cu = torch.tensor([0, 30, 70], dtype=torch.int32)
        del recorder.launches[:]
        flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, causal=True, deterministic=deterministic)
        flash_bwd_varlen(q[0], q[0], q[0], q[0], q[0], lse[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40,
                         max_seqlen_k=40, softmax_scale=0.5, deterministic=deterministic)
        mains = [x.config for x in recorder.launches if isinstance(x.config, Sm90BwdConfig)]
        converts = [x.config for x in recorder.launches if isinstance(x.config, DQConvertConfig)]
        assert [c.varlen for c in mains] == [False, True] and len(converts) == 2, d
        rows = 128 if d == 32 or (d == 64 and not deterministic) else 64
        assert all((c.dq_path, c.traits.q_stages, c.traits.block_n, c.traits.block_m) == (path, stages, keys, rows)
                   for c in mains), (d, [c.name for c in mains])
        assert all(c.traits.q_stages == 1 for c in converts)


def test_softcap_keeps_64_query_rows_at_d64(recorder, monkeypatch):
    """d 64 with softcap keeps 64-row query blocks: its derivative spills on the 128 x 128 tiles
    (`policy.hopper_bwd_dq`)."""
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 70, 4, 64, dtype=torch.bfloat16)
    lse = torch.randn(2, 4, 70)
    flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, causal=True, softcap=5.0)
    flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, causal=True)
    capped, plain = [x.config for x in recorder.launches if isinstance(x.config, Sm90BwdConfig)]
    assert (capped.has_softcap, capped.traits.block_m, plain.traits.block_m) == (True, 64, 128)


def test_mla_decode_takes_the_latent_tiles(recorder, monkeypatch):
    """q / k_cache 576 wide with v_cache its first 512 columns (MLA decode): the Hopper entry's
    latent tiles, unsplit whatever the split rule would pick, the GQA fold of 128 heads into two
    64-row blocks, out 512 wide; under a causal mask with two query rows, the query fold; on the
    SM80 path, or over pages of 32 rows, a ValueError (no other kernel runs the shape)."""
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import flash_fwd_kvcache

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    cache = torch.randn(1, 8192, 1, 576, dtype=torch.bfloat16)
    q = torch.randn(1, 1, 128, 576, dtype=torch.bfloat16)
    out, lse = flash_fwd_kvcache(q, cache, cache[..., :512], cache_seqlens=8000, softmax_scale=0.1)
    launch = recorder.launches[-1]
    config = launch.config
    assert isinstance(config, Sm90FwdConfig) and config.traits.latent and config.pack_gqa
    assert not config.split and launch["num_splits"] == 1 and config.stages == 2
    assert out.shape == (1, 1, 128, 512) and launch["mO"] is out and lse.shape == (1, 128, 1)
    q2 = torch.randn(1, 2, 16, 576, dtype=torch.bfloat16)
    out, _ = flash_fwd_kvcache(q2, cache, cache[..., :512], cache_seqlens=8000, softmax_scale=0.1, causal=True)
    config = recorder.launches[-1].config
    assert config.traits.latent and config.query_group > 1 and config.has_right and out.shape == (1, 2, 16, 512)
    pages = torch.randn(4, 32, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        flash_fwd_kvcache(q, pages, pages[..., :512], cache_seqlens=100, softmax_scale=0.1,
                          block_table=torch.zeros(1, 4, dtype=torch.int32))
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    with pytest.raises(ValueError, match="Hopper KV-cache kernel only"):
        flash_fwd_kvcache(q, cache, cache[..., :512], cache_seqlens=8000, softmax_scale=0.1)


def test_latent_configs_are_the_unsplit_kvcache_entrys():
    """Latent tiles (MLA decode) compile only as the KV-cache entry, unsplit, one CTA an SM."""
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_latent_traits
    from layouts.traits import SMEM_LIMIT

    latent = choose_hopper_latent_traits("bf16")
    assert Sm90FwdConfig(latent, 2, kvcache=True, paged=True).smem_bytes <= SMEM_LIMIT[90]
    for bad in (dict(), dict(kvcache=True, split=True), dict(kvcache=True, split=True, cluster_merge=True)):
        with pytest.raises(ValueError, match="latent tiles"):
            Sm90FwdConfig(latent, 2, **bad)
