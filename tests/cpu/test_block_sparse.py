"""Block sparsity on the CPU: a FlexAttention BlockMask as the kernels' lists at our tile sizes
(`launch/block_sparse.py`), checked against the dense mask it came from; the launchers'
plumbing; the API's refusals; the block-sparse Hopper kernels compile."""
import operator

import cute_flash.launch.block_sparse as bs
from cute_flash import mods
import cutlass.cute as cute
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from tests.helpers.interface import call

TILES = [(64, 64), (128, 128), (128, 64), (192, 128), (64, 176)]


def random_mask(gen, b, h, sq, sk, density):
    """A mask with whole empty and whole kept regions beside random ones, so every status occurs."""
    m = torch.rand(b, h, sq, sk, generator=gen) < density
    m[..., : sq // 3, : sk // 2] = True
    m[..., sq // 2:, sk // 3: 2 * sk // 3] = False
    return m


def dense_status(m, tile):
    """Each tile's EMPTY / PARTIAL / FULL straight from the (b, h, sq, sk) mask, over the keys
    and queries inside the sequence."""
    bm, bn = tile
    sq, sk = m.shape[-2:]
    out = torch.empty(*m.shape[:2], -(-sq // bm), -(-sk // bn), dtype=torch.int8)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            block = m[..., i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].flatten(2)
            out[..., i, j] = torch.where(block.all(-1), bs.FULL, torch.where(block.any(-1), bs.PARTIAL, bs.EMPTY))
    return out


def listed_status(lists, shape):
    """The status each tile has in the kernel's lists (asserting each list is well formed)."""
    pc, pi, fc, fi = lists
    status = torch.zeros(shape, dtype=torch.int8)
    for cnt, idx, value in ((pc, pi, bs.PARTIAL), (fc, fi, bs.FULL)):
        assert cnt.dtype == idx.dtype == torch.int32 and cnt.is_contiguous() and idx.is_contiguous()
        for b, h, i in torch.cartesian_prod(*(torch.arange(n) for n in cnt.shape)).tolist():
            blocks = idx[b, h, i, :cnt[b, h, i]].tolist()
            assert len(set(blocks)) == len(blocks) and all(status[b, h, i, blocks] == 0)
            status[b, h, i, blocks] = value
    return status


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 16), b=st.sampled_from([1, 2]), h=st.sampled_from([1, 3]),
       sq=st.integers(1, 400), sk=st.integers(1, 400), density=st.sampled_from([0.0, 0.5, 0.999]),
       theirs=st.sampled_from([(64, 64), (128, 128), (32, 64)]), ours=st.sampled_from(TILES))
def test_lists_are_sound_at_any_tile_and_exact_where_ours_are_whole_multiples(seed, b, h, sq, sk, density,
                                                                              theirs, ours):
    """A tile the lists call FULL keeps every score of the mask inside the sequence, one they
    leave out keeps none; where our tiles are whole multiples of the BlockMask's (and so see
    through its blocks), the lists are the mask's own status exactly, up to the BlockMask's
    boundary blocks (FlexAttention marks a block the sequence ends in as partial)."""
    m = random_mask(torch.Generator().manual_seed(seed), b, h, sq, sk, density)
    block_mask = create_block_mask(lambda bb, hh, q, kv: m[bb, hh, q.clamp(max=sq - 1), kv.clamp(max=sk - 1)],
                                   b, h, sq, sk, device="cpu", BLOCK_SIZE=theirs)
    got = listed_status(bs.block_lists(block_mask, b, h, sq, sk, *ours), (b, h, -(-sq // ours[0]), -(-sk // ours[1])))
    want = dense_status(m, ours)
    assert not ((got == bs.FULL) & (want != bs.FULL)).any()
    assert not ((got == bs.EMPTY) & (want != bs.EMPTY)).any()
    if ours[0] % theirs[0] == 0 and ours[1] % theirs[1] == 0:
        inside = torch.zeros_like(want, dtype=torch.bool)
        inside[..., : sq // ours[0], : sk // ours[1]] = True
        assert torch.equal(got[inside], want[inside])


def test_lists_are_kept_on_the_block_mask_per_tile_size():
    """A model's layers pass one BlockMask: its lists are built once per tile size."""
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 300, 300, device="cpu")
    first = bs.block_lists(block_mask, 2, 4, 300, 300, 128, 128)
    assert bs.block_lists(block_mask, 2, 4, 300, 300, 128, 128) is first
    assert bs.block_lists(block_mask, 2, 4, 300, 300, 128, 64) is not first


def test_causal_lists_at_the_blockmask_size():
    """Causal, 384 x 384 at 128 x 128: each row's diagonal block partial, the blocks left of it
    full, from the last down (the dense forward's order); the backward's lists by key block,
    query blocks up."""
    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 384, 384, device="cpu")
    pc, pi, fc, fi = bs.block_lists(block_mask, 1, 1, 384, 384, 128, 128)
    assert pc[0, 0].tolist() == [1, 1, 1] and [pi[0, 0, i, 0].item() for i in range(3)] == [0, 1, 2]
    assert fc[0, 0].tolist() == [0, 1, 2] and fi[0, 0, 2, :2].tolist() == [1, 0]
    pc, pi, fc, fi = bs.block_lists(block_mask, 1, 1, 384, 384, 128, 128, by_key=True)
    assert pc[0, 0].tolist() == [1, 1, 1] and fc[0, 0].tolist() == [2, 1, 0]
    assert fi[0, 0, 0, :2].tolist() == [1, 2]


def test_the_forwards_never_call_the_block_the_end_cuts_full():
    """Keys 0..319 kept whole, at 64-key BlockMask blocks (every one full) and 128-key tiles: the
    forward's last key block, cut at 320, is partial (its kernels then mask no full block when
    the call has no built-in mask), the backward's lists keep it full."""
    block_mask = create_block_mask(lambda b, h, q, kv: q >= 0, 1, 1, 256, 320, device="cpu", BLOCK_SIZE=64)
    assert (block_mask.kv_num_blocks == 0).all()  # every BlockMask block full
    pc, pi, fc, fi = bs.block_lists(block_mask, 1, 1, 256, 320, 128, 128)
    assert pc[0, 0].tolist() == [1, 1] and pi[0, 0, :, 0].tolist() == [2, 2]
    assert fc[0, 0].tolist() == [2, 2] and fi[0, 0, 0, :2].tolist() == [1, 0]
    pc, _, fc, _ = bs.block_lists(block_mask, 1, 1, 256, 320, 128, 128, by_key=True)
    assert pc[0, 0].tolist() == [0, 0, 0] and fc[0, 0].tolist() == [2, 2, 2]


@cute.jit
def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return operator.ge(q_idx, kv_idx)


def causal_block_mask(b=1, h=1, sq=300, sk=300):
    return create_block_mask(lambda bb, hh, q, kv: q >= kv, b, h, sq, sk, device="cpu")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(block_mask=causal_block_mask()), ValueError, "pass the mask_mod too"),
    (dict(block_mask="dense", mask_mod=causal), TypeError, "must be a FlexAttention BlockMask"),
    (dict(block_mask=causal_block_mask(sk=200), mask_mod=causal), ValueError, r"\(Q_LEN, KV_LEN\) \(300, 200\)"),
    (dict(block_mask=causal_block_mask(b=3), mask_mod=causal), ValueError, r"\(B, H\) \(3, 1\)"),
])
def test_bad_block_masks_are_refused(gpu_free, kwargs, error, message):
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match=message):
        call("func", q=q, k=q, v=q, **kwargs)
    assert not gpu_free.calls


def test_the_block_mask_reaches_the_launcher(gpu_free):
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    block_mask = causal_block_mask(b=2, h=4)
    call("func", q=q, k=q, v=q, mask_mod=causal, block_mask=block_mask)
    assert gpu_free.calls[0][2]["block_mask"] is block_mask


@pytest.mark.parametrize("path", ["sm80", "default"])
def test_either_forward_gets_the_lists_at_its_tiles(recorder, monkeypatch, path):
    """The SM80 and the Hopper forward each run a block-sparse variant with the lists at its own
    tiles (K / V multicast off on the Hopper one: its paired tiles load the same blocks)."""
    from cute_flash.launch.dense import flash_fwd

    if path == "default":
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(None, causal, None), block_mask=causal_block_mask())
    (launch,) = recorder.launches
    assert launch.config.block_sparse and launch.config.mods.mask_mod is not None
    assert path == "sm80" or not launch.config.kv_multicast
    t = launch.config.traits
    pc, pi, fc, fi = launch["block_sparse"]
    assert pc.shape == (1, 1, -(-300 // t.block_m)) and pi.shape == (1, 1, -(-300 // t.block_m), -(-300 // t.block_n))


@pytest.mark.parametrize("d, seqlen", [(128, 2048), (128, 16384), (64, 4096)])
def test_the_hopper_block_sparse_forward_takes_the_masks_schedule(recorder, monkeypatch, d, seqlen):
    """Block-sparse tiles differ in length, as a causal mask's: the launch takes the causal
    flag's tiles, schedule and longest-first sections, not the unmasked call's."""
    from cute_flash.launch.dense import flash_fwd

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(16384 // seqlen, seqlen, 2048 // d, d, dtype=torch.bfloat16)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, seqlen, seqlen, device="cpu")
    flash_fwd(q, q, q, softmax_scale=0.5, causal=True)
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(None, causal, None), block_mask=block_mask)
    flash_fwd(q, q, q, softmax_scale=0.5)
    flag, sparse, unmasked = recorder.launches
    assert sparse.config.traits == flag.config.traits
    assert sparse.config.persistent == flag.config.persistent
    assert sparse["section_heads"] == flag["section_heads"]
    assert (sparse.config.persistent, sparse["section_heads"]) != (unmasked.config.persistent,
                                                                   unmasked["section_heads"])


def test_the_block_sparse_config_refuses_what_it_cannot_list():
    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_traits

    t = choose_hopper_traits(128, "bf16")
    with pytest.raises(ValueError, match="block sparsity lists the blocks a mask_mod cuts"):
        Sm90FwdConfig(t, block_sparse=True)
    with pytest.raises(ValueError, match="block sparsity"):
        Sm90FwdConfig(t, varlen=True, block_sparse=True, mods=UserMods(None, UserMod.of(causal)))


@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_sm80_forwards_compile(d):
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from layouts.traits import choose_fwd_traits

    config = FwdConfig(choose_fwd_traits(d, "bf16", 80), has_right=d == 128, block_sparse=True,
                       mods=UserMods(None, UserMod.of(causal)))
    assert "Mb" in config.letters  # the mods and block-sparsity letters
    with pytest.raises(ValueError, match="block sparsity"):
        FwdConfig(config.traits, varlen=True, block_sparse=True, mods=config.mods)
    build(config, 80)


@pytest.mark.parametrize("d, persistent, speculative, tall", [(128, False, False, False), (64, True, False, False),
                                                             (128, True, True, False), (64, True, True, True)])
def test_block_sparse_hopper_forwards_compile(d, persistent, speculative, tall):
    """A mask_mod's Hopper forwards, with block lists: both schedules, and speculative maxima (a
    mask_mod hides scores as a mask does), P beside S and, on 192-row tiles, over it."""
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_traits

    config = Sm90FwdConfig(choose_hopper_traits(d, "bf16", long_keys=tall), persistent=persistent, block_sparse=True,
                           mods=UserMods(None, UserMod.of(causal)), speculative_max=speculative,
                           speculative_in_place=tall)
    assert "b-" in config.name
    build(config, 90)


@pytest.mark.parametrize("path, deterministic", [("default", False), ("default", True), ("sm80", False),
                                                   ("sm80", True)])
def test_the_backward_gets_the_lists_by_key_block(recorder, monkeypatch, path, deterministic):
    """Either backward's lists are per key block at its tiles; the Hopper one's deterministic
    mode, whose dQ turns count every key block of a query block, takes the mask_mod alone (the
    SM80 one's adds each split's dQ into its own slice: its order holds whatever is skipped)."""
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.launch.backward import flash_bwd

    if path == "default":
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 384, 4, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 384)
    flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, mods=(None, causal, None, None), deterministic=deterministic,
              block_mask=causal_block_mask(sq=384, sk=384))
    (main,) = [x for x in recorder.launches if isinstance(x.config, (Sm90BwdConfig, BwdConfig))]
    hopper_deterministic = path == "default" and deterministic
    assert main.config.block_sparse is not hopper_deterministic
    if hopper_deterministic:
        assert main["block_sparse"] is None
        return
    t = main.config.traits
    pc, pi, fc, fi = main["block_sparse"]
    assert pc.shape == (1, 1, 384 // t.block_n) and pi.shape == (1, 1, 384 // t.block_n, 384 // t.block_m)
    # causal: key block n is partial in its diagonal query blocks and full in every one below
    assert pc[0, 0, 0].item() == t.block_n // t.block_m and fc[0, 0, 0].item() == 384 // t.block_m - pc[0, 0, 0]


@pytest.mark.parametrize("d, deterministic", [(64, False), (128, True)])
def test_block_sparse_sm80_backwards_compile(d, deterministic):
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from layouts.traits import choose_bwd_traits

    config = BwdConfig(choose_bwd_traits(d, "bf16", 80), has_right=True, deterministic=deterministic,
                       block_sparse=True, mods=UserMods(None, UserMod.of(causal)))
    assert "Mb" in config.name
    build(config, 80)


@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_hopper_backwards_compile(d):
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from layouts.hopper import choose_hopper_bwd_traits

    config = Sm90BwdConfig(choose_hopper_bwd_traits(d, "bf16"), block_sparse=True,
                           mods=UserMods(None, UserMod.of(causal)))
    assert config.name.endswith("-B-M" + UserMod.of(causal).digest)
    with pytest.raises(ValueError, match="deterministic"):
        Sm90BwdConfig(config.traits, block_sparse=True, deterministic=True, mods=config.mods)
    build(config, 90)


def test_d64_takes_128_row_tiles_beside_a_mask_reading_positions(recorder, monkeypatch):
    """d 64 at 4096 keys under a mask takes 192-row tiles, but not with a mask_mod beside an aux
    tensor of a value per position (the document mask's ids, rank 2: the 192-row kernel spilled
    and ran at 0.43 of 128-row tiles); a per-batch aux (prefix LM's, rank 1) keeps them."""
    from cute_flash.launch.dense import flash_fwd

    monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(4, 4096, 4, 64, dtype=torch.bfloat16)
    for spec in (mods.document_mask(torch.zeros(4, 4096, dtype=torch.int32)),
                 mods.prefix_lm(torch.full((4,), 100, dtype=torch.int32))):
        flash_fwd(q, q, q, softmax_scale=0.5, mods=(spec.score_mod, spec.mask_mod, spec.aux_tensors),
                  block_mask=causal_block_mask(sq=4096, sk=4096))
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(None, causal, None), block_mask=causal_block_mask(sq=4096, sk=4096))
    assert [x.config.traits.block_m for x in recorder.launches] == [128, 192, 192]
