"""Host-side launchers on CPU tensors, kernels replaced by recorders: 128-bit preparation of
q/k/v, the kernel arguments of each entry, split counts, the GQA decode fold, append order."""
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
    monkeypatch.setattr(fwd, "_no_table", lambda index: torch.zeros(1, 1, dtype=torch.int32))
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
    assert recorder.lookups[0][-4:] == (True, True, False, False)  # varlen, has_seqused_k, paged, any_page_size
    args = recorder.calls[0]
    assert args[3].shape == (9, 4, 64) and args[4].shape == (4, 9)
    assert args[6] is cu_q and args[7] is cu_k and args[8] is used and args[10] == 5
    assert out.shape == q.shape and lse.shape == (4, 9)

    pages = torch.randn(3, 16, 2, 64, dtype=torch.float16)
    table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    flash_fwd_varlen(q, pages, pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                     softmax_scale=0.125, block_table=table)
    assert recorder.lookups[1][-2:] == (True, False) and recorder.calls[1][9] is table
    assert recorder.calls[1][1] is pages

    odd = torch.randn(7, 3, 2, 64, dtype=torch.float16)  # pages of 3 rows: the per-row kernel
    flash_fwd_varlen(q, odd, odd, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                     softmax_scale=0.125, block_table=table)
    assert recorder.lookups[2][-2:] == (True, True) and recorder.calls[2][1] is odd


class _CacheRecorder:
    """Stands in for the KV-cache kernels: records (kind, split flag, args) per launch."""

    def __init__(self):
        self.calls, self.compiled = [], []

    def kernel_for(self, traits, d_pad, index, *flags):
        split, pack_gqa = flags[5], flags[8]
        self.compiled.append((split, pack_gqa))
        return lambda *args: self.calls.append(("attn", split, args))

    def append_for(self, *key):
        return lambda *args: self.calls.append(("append", key, args))


@pytest.fixture
def cache_recorder(monkeypatch):
    import cute_flash.kernels.fwd as fwd

    rec = _CacheRecorder()
    monkeypatch.setattr(fwd, "_kvcache_kernel_for", rec.kernel_for)
    monkeypatch.setattr(fwd, "ffi_function", lambda compiled: compiled)
    monkeypatch.setattr(fwd, "_append_for", rec.append_for)
    rec.stream, rec.capturing = 7, False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: rec.capturing)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: rec.stream, raising=False)
    monkeypatch.setattr(fwd, "_num_sms", lambda index: 132)
    monkeypatch.setattr(fwd, "_device_arch", lambda index: 90)
    monkeypatch.setattr(fwd, "_no_alibi", lambda index: torch.zeros(1, 1))
    monkeypatch.setattr(fwd, "_no_table", lambda index: torch.zeros(1, 1, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fwd, "_kvcache_calls", {})
    fwd._kvcache_plan.cache_clear()
    fwd._stream_workspace.cache_clear()
    yield rec
    fwd._kvcache_plan.cache_clear()
    fwd._stream_workspace.cache_clear()


def test_gqa_decode_folds_the_group_into_m_and_splits(cache_recorder):
    from cute_flash.kernels.fwd import flash_fwd_kvcache

    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.float16)
    seqlens = torch.tensor([1000, 3], dtype=torch.int32)
    out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=seqlens, softmax_scale=0.125, num_splits=3)
    (kind, split, args), = cache_recorder.calls  # one launch: the merge runs inside it
    assert (kind, split) == ("attn", True)
    assert cache_recorder.compiled == [(True, True)]  # (split, pack_gqa); no unsplit kernel alongside
    assert args[0] is q and args[3] is out and args[4] is lse  # the kernel folds the heads itself
    o_acc, lse_acc, counters = args[5], args[6], args[7]
    # partials by (split, b, nheads_k, group row)
    assert o_acc.shape == (3, 2, 2, 4, 64) and lse_acc.shape == (3, 2, 2, 4)
    assert counters.shape == (1 * 2 * 2,) and not counters.any()  # m_blocks x b x nheads_k, zeroed
    assert args[14] == 3  # num_splits
    assert lse.shape == (2, 8, 1) and out.shape == q.shape


@pytest.mark.parametrize("sq, window, alibi", [(2, (-1, -1), False), (1, (8, -1), False), (1, (-1, -1), True)])
def test_no_gqa_fold_with_query_rows_window_or_alibi(cache_recorder, sq, window, alibi):
    from cute_flash.kernels.fwd import flash_fwd_kvcache

    q = torch.randn(2, sq, 8, 64, dtype=torch.float16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=9, softmax_scale=0.125, num_splits=2, window_size=window,
                      alibi_slopes=torch.rand(8) if alibi else None)
    (_, _, args), = cache_recorder.calls
    assert cache_recorder.compiled == [(True, False)]
    assert args[5].shape == (2, 2, 8, sq, 64)  # partials by (split, b, nheads, query row)


def test_call_setup_is_kept_per_signature(cache_recorder, monkeypatch):
    import cute_flash.kernels.fwd as fwd

    setups = []
    real = fwd._kvcache_call
    monkeypatch.setattr(fwd, "_kvcache_call", lambda *a: setups.append(a) or real(*a))
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    cache = torch.randn(2, 1000, 2, 64, dtype=torch.float16)
    for signature in ("sig", "sig", None, None, "other"):
        cache_recorder.calls.clear()
        out, _ = fwd.flash_fwd_kvcache(q, cache, cache, cache_seqlens=17, softmax_scale=0.125, num_splits=3,
                                       signature=signature)
        (_, _, args), = cache_recorder.calls
        assert torch.equal(args[9], torch.full((2,), 17, dtype=torch.int32)) and args[14] == 3
        assert args[0] is q and out.shape == q.shape
    assert len(setups) == 4  # "sig" once, each call without a signature, "other" once


def test_split_workspace_is_kept_per_stream_and_fresh_under_capture(cache_recorder):
    from cute_flash.kernels.fwd import flash_fwd_kvcache

    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    cache = torch.randn(1, 4096, 2, 64, dtype=torch.float16)

    def workspace():
        cache_recorder.calls.clear()
        out, lse = flash_fwd_kvcache(q, cache, cache, cache_seqlens=9, softmax_scale=0.1, num_splits=4,
                                     return_lse=False)
        (_, _, args), = cache_recorder.calls
        assert lse is None and args[4].shape == (1, 8, 1)  # the final LSE goes to scratch
        return args[4:8]

    first = workspace()
    assert all(a is b for a, b in zip(workspace(), first))  # same plan, same stream: reused
    cache_recorder.stream = 8
    other = workspace()
    assert not any(a is b for a, b in zip(other, first))
    cache_recorder.capturing = True
    captured = workspace()
    assert not any(a is b for a, b in zip(workspace(), captured))  # each captured launch: its own
    assert not captured[3].any()  # fresh counters start at zero


def test_heuristic_split_count_and_unsplit_path(cache_recorder):
    from cute_flash.kernels.fwd import flash_fwd_kvcache
    from layouts.traits import num_splits_heuristic

    q = torch.randn(1, 1, 4, 128, dtype=torch.float16)
    cache = torch.randn(1, 8192, 4, 128, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=5, softmax_scale=0.1, num_splits=0)
    kind, split, args = cache_recorder.calls[0]
    assert kind == "attn" and split and args[14] == num_splits_heuristic(4, 132, 64)  # h_k * m_blocks = 4
    assert torch.equal(args[9], torch.full((1,), 5, dtype=torch.int32))  # int cache_seqlens as a tensor

    cache_recorder.calls.clear()
    flash_fwd_kvcache(q, cache[:, :100], cache[:, :100], cache_seqlens=5, softmax_scale=0.1, num_splits=0)
    (kind, split, args), = cache_recorder.calls  # one key block: no split
    assert kind == "attn" and not split and args[3].shape == (1, 1, 4, 128)


def test_append_is_launched_before_attention_with_rotary_options(cache_recorder):
    from cute_flash.kernels.fwd import flash_fwd_kvcache

    q = torch.randn(2, 3, 4, 64, dtype=torch.float16)
    cache = torch.randn(2, 64, 2, 64, dtype=torch.float16)
    k = torch.randn(2, 3, 2, 64, dtype=torch.float16)
    cos = torch.randn(64, 16, dtype=torch.float16)
    seqlens = torch.tensor([0, 10], dtype=torch.int32)
    flash_fwd_kvcache(q, cache, cache, k=k, v=k, rotary_cos=cos, rotary_sin=cos, cache_seqlens=seqlens,
                      softmax_scale=0.1, causal=True, rotary_interleaved=False, num_splits=1)
    (kind, key, args), (kind2, _, attn) = cache_recorder.calls
    assert kind == "append" and kind2 == "attn"
    assert key[2:] == (False, False, True, False, True)  # paged, batch_idx, rotary, interleaved, q_per_row
    assert args[0] is k and args[4] is seqlens and args[9] is q
    assert attn[0] is args[10]  # attention reads the rotated q
    assert attn[14] == 1 and attn[13] == 3  # num_splits, k_extra = seqlen_new


def test_empty_append_without_rotary_launches_attention_only(cache_recorder):
    from cute_flash.kernels.fwd import flash_fwd_kvcache

    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    cache = torch.randn(2, 64, 2, 64, dtype=torch.float16)
    k = torch.randn(2, 0, 2, 64, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=3, softmax_scale=0.1, num_splits=1)
    assert [kind for kind, _, _ in cache_recorder.calls] == ["attn"]
