"""Calls over more sequences than a launch grid's y / z dimension holds run in chunks
(cute_flash/launch/batch_chunks.py): the launches each entry makes, recorded on the CPU with
the limit lowered to 2 sequences, so 5 sequences take chunks of 2, 2 and 1."""
import pytest
import torch

from cute_flash.launch import batch_chunks

CHUNKS = [slice(0, 2), slice(2, 4), slice(4, 5)]


@pytest.fixture
def limit_2(monkeypatch):
    monkeypatch.setattr(batch_chunks, "GRID_MAX_BATCH", 2)


def test_chunks_cover_the_batch_in_order():
    assert batch_chunks.batch_chunks(65535) == [slice(0, 65535)]
    assert batch_chunks.batch_chunks(65536) == [slice(0, 65535), slice(65535, 65536)]
    assert batch_chunks.batch_chunks(140000) == [slice(0, 65535), slice(65535, 131070), slice(131070, 140000)]
    assert not batch_chunks.chunked(65535) and batch_chunks.chunked(65536)


@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_dense_forward_launches_once_a_chunk(recorder, monkeypatch, limit_2, path):
    from cute_flash.launch import flash_fwd

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q = torch.randn(5, 3, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(5, 7, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.rand(5, 4)
    out, lse = flash_fwd(q, k, v, softmax_scale=0.5, causal=True, alibi_slopes=slopes)
    assert len(recorder.launches) == 3 and out.shape == q.shape and lse.shape == (5, 4, 3)
    for launch, s in zip(recorder.launches, CHUNKS):
        assert launch["mQ"].data_ptr() == q[s].data_ptr() and launch["mQ"].shape[0] == s.stop - s.start
        assert launch["mV"].data_ptr() == v[s].data_ptr() and torch.equal(launch["mAlibi"], slopes[s])


def test_dense_forward_with_dropout_past_the_limit_is_refused(recorder, limit_2):
    from cute_flash.launch.rng import DropoutArgs
    from cute_flash.launch import flash_fwd

    q = torch.randn(5, 3, 4, 64, dtype=torch.bfloat16)
    dropout = DropoutArgs.seeded(0.1, 1, 2, "cpu")
    with pytest.raises(ValueError, match="dropout_p > 0 takes at most 2 sequences"):
        flash_fwd(q, q, q, softmax_scale=0.5, dropout=dropout)
    flash_fwd(q[:2], q[:2], q[:2], softmax_scale=0.5, dropout=dropout)  # within the limit: one launch
    assert len(recorder.launches) == 1


def test_packed_forward_passes_each_chunk_its_prefix_sums(recorder, limit_2):
    from cute_flash.launch import flash_fwd_varlen

    q = torch.randn(11, 4, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 2, 3, 6, 10, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 4, 6, 7, 11], dtype=torch.int32)
    used, table = torch.tensor([1, 2, 2, 1, 3], dtype=torch.int32), torch.arange(15, dtype=torch.int32).view(5, 3)
    pages = torch.randn(15, 16, 2, 64, dtype=torch.bfloat16)
    out, lse = flash_fwd_varlen(q, pages, pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                                max_seqlen_k=4, softmax_scale=0.5, block_table=table, seqused_k=used)
    assert len(recorder.launches) == 3
    for launch, s in zip(recorder.launches, CHUNKS):
        assert launch["mO"].data_ptr() == out.data_ptr() and launch["mLSE"] is lse  # rows from the whole tensors
        assert launch["mCuSeqlensQ"].tolist() == cu_q[s.start:s.stop + 1].tolist()
        assert launch["mCuSeqlensK"].data_ptr() == cu_k[s.start:].data_ptr()
        assert torch.equal(launch["mSeqUsedK"], used[s]) and torch.equal(launch["mBlockTable"], table[s])


@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_dense_backward_writes_each_chunks_gradients(recorder, monkeypatch, limit_2, path):
    from cute_flash.kernels.sm80.bwd_preprocess import PreprocessConfig
    from cute_flash.launch.backward import flash_bwd

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q, dout = (torch.randn(5, 70, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(5, 90, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    dk = torch.empty_like(k)
    dq, dk_out, dv, softmax_d = flash_bwd(dout, q, k, v, q, torch.randn(5, 4, 70), softmax_scale=0.5, dk=dk)
    assert dk_out is dk and dq.shape == q.shape and dv.shape == v.shape and softmax_d.shape == (5, 4, 70)
    pre = [x for x in recorder.launches if isinstance(x.config, PreprocessConfig)]
    assert len(recorder.launches) == 9 and len(pre) == 3
    for i, s in enumerate(CHUNKS):
        launch_pre, main = recorder.launches[3 * i:3 * i + 2]
        assert launch_pre["mdO"].data_ptr() == dout[s].data_ptr() and main["mK"].data_ptr() == k[s].data_ptr()
        assert main["mdK"].shape[0] == s.stop - s.start


def test_packed_backward_clears_dq_accum_between_chunks(recorder, monkeypatch, limit_2):
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.launch.backward import flash_bwd_varlen

    q = torch.randn(11, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 3, 6, 10, 11], dtype=torch.int32)
    zeroed = []
    monkeypatch.setattr(torch.Tensor, "zero_", lambda self: zeroed.append(self.shape) or self.fill_(0))
    flash_bwd_varlen(q, q, q, q, q, torch.randn(4, 11), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4,
                     max_seqlen_k=4, softmax_scale=0.5)
    mains = [x for x in recorder.launches if isinstance(x.config, BwdConfig)]
    assert len(recorder.launches) == 9 and len(mains) == 3
    assert len({x["mdQaccum"].data_ptr() for x in mains}) == 1 and zeroed.count(mains[0]["mdQaccum"].shape) == 2
    for main, s in zip(mains, CHUNKS):
        assert main["mCuSeqlensQ"].tolist() == cu[s.start:s.stop + 1].tolist() and main["mQ"] is mains[0]["mQ"]


@pytest.mark.parametrize("path", ["sm80", "sm90"])
@pytest.mark.parametrize("cache", ["contiguous", "batch_idx", "paged"])
def test_kvcache_chunks_take_their_rows_of_the_caches(recorder, monkeypatch, limit_2, cache, path):
    from cute_flash.launch import flash_fwd_kvcache

    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", path)
    q = torch.randn(5, 1, 4, 64, dtype=torch.bfloat16)
    caches = torch.randn(6 if cache != "paged" else 10, 256, 2, 64, dtype=torch.bfloat16)
    new = torch.randn(5, 1, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    opts = dict(batch_idx=dict(cache_batch_idx=torch.tensor([5, 4, 3, 2, 1], dtype=torch.int32)),
                paged=dict(block_table=torch.arange(10, dtype=torch.int32).view(5, 2))).get(cache, {})
    out, lse = flash_fwd_kvcache(q, caches, caches, k=new, v=new, cache_seqlens=lens, softmax_scale=0.5, **opts)
    assert out.shape == q.shape and lse.shape == (5, 4, 1)
    appends = [x for x in recorder.launches if "mKnew" in x.args]
    attends = [x for x in recorder.launches if "mKnew" not in x.args]
    assert len(appends) == len(attends) == 3
    for append, attend, s in zip(appends, attends, CHUNKS):
        seqlens = attend.args.get("mCacheSeqlens", attend.args.get("mSeqlensK"))  # the SM80 / Hopper entry's name
        assert attend["mQ"].shape[0] == s.stop - s.start and torch.equal(seqlens, lens[s])
        assert append["mKnew"].data_ptr() == new[s].data_ptr()
        if cache == "contiguous":
            assert attend["mK"].data_ptr() == caches[s].data_ptr() and attend["mK"].shape[0] == s.stop - s.start
        else:
            assert attend["mK"].data_ptr() == caches.data_ptr() and attend["mK"].shape[0] == caches.shape[0]
            key = "mBatchIdx" if cache == "batch_idx" else "mBlockTable"
            assert torch.equal(attend[key], opts[key == "mBatchIdx" and "cache_batch_idx" or "block_table"][s])


def test_kvcache_splits_stay_within_grid_z(recorder, monkeypatch):
    """The SM80 KV-cache kernel's grid z holds num_splits x heads: a requested split count is
    cut to what fits (here a limit of 16 over 8 heads: 2 splits)."""
    from cute_flash.launch import flash_fwd_kvcache

    monkeypatch.setattr(batch_chunks, "GRID_MAX_BATCH", 16)
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)  # two query rows: no GQA fold, 8 heads tiled
    cache = torch.randn(1, 2048, 8, 64, dtype=torch.float16)
    flash_fwd_kvcache(q, cache, cache, cache_seqlens=2000, softmax_scale=0.1, num_splits=8)
    (launch,) = recorder.launches
    assert launch["num_splits"] == 2 and launch.config.split
