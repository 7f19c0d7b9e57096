"""Python-written score / mask mods (kernels/common/user_mods.py) on the CPU: the digest a compile
key holds, the launchers' plumbing (config, aux tensors, scales) and the API's refusals."""
import operator

import cutlass
import cutlass.cute as cute
import pytest
import torch

from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.common.user_mods import UserMod, UserMods, code_digest
from tests.helpers.interface import call, with_


@cute.jit
def rel_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return score + (q_idx - kv_idx).to(cutlass.Float32) * 0.01


@cute.jit
def rel_bias_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return grad


@cute.jit
def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return operator.ge(q_idx, kv_idx)


def windowed(width):
    @cute.jit
    def window(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return operator.le(q_idx - kv_idx, width)
    return window


def test_digest_follows_the_code_and_what_it_captures():
    """The same mod gives the same digest (a UserMod equal and hashed alike whatever function object
    holds it); a captured value or other code gives another."""
    assert code_digest(windowed(64)) == code_digest(windowed(64)) != code_digest(windowed(128))
    assert code_digest(rel_bias) != code_digest(causal)
    a, b = UserMod.of(windowed(64)), UserMod.of(windowed(64))
    assert a == b and hash(a) == hash(b) and a.fn is not b.fn and "fn" not in repr(a)


def test_digest_survives_the_dsl_tracing_the_mod(tmp_path):
    """The DSL swaps a jit function's code for its rewrite when it first traces it: the digest,
    kept from before, does not move (else the compile cache would miss in the same process)."""
    from cute_flash.compile.registry import build
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from layouts.traits import choose_fwd_traits

    @cute.jit
    def shifted(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score * 0.5

    before = code_digest(shifted)
    build(FwdConfig(choose_fwd_traits(64, "bf16", 80), mods=UserMods(UserMod.of(shifted))), 80)
    assert code_digest(shifted) == before


@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_launchers_pass_the_mods_aux_tensors_and_scales(recorder, monkeypatch, path):
    """A score_mod's kernel gets the softmax scale as the score premultiplier and log2(e) as the
    exponent's; a mask_mod alone keeps the usual scales; the aux tensors go as a list; the config
    carries the mods (digests and aux kinds), on either path, dense and packed."""
    from cute_flash.launch.dense import flash_fwd, flash_fwd_varlen

    if path == "sm90":
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 70, 4, 64, dtype=torch.bfloat16)
    table = torch.randn(4, 300)
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(rel_bias, causal, [table]))
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(None, causal, None))
    cu = torch.tensor([0, 70, 140], dtype=torch.int32)
    flash_fwd_varlen(q.flatten(0, 1), q.flatten(0, 1), q.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu,
                     max_seqlen_q=70, max_seqlen_k=70, softmax_scale=0.5, mods=(rel_bias, None, None))
    both, mask_only, packed = recorder.launches
    assert both.config.mods.score_mod == UserMod.of(rel_bias) and both.config.mods.mask_mod == UserMod.of(causal)
    assert both.config.mods.aux == (("float32", 2),) and both["aux_tensors"] == [table]
    assert both["scale_log2"] == LOG2E and both["score_premul"] == 0.5
    assert mask_only.config.mods.score_mod is None and mask_only["aux_tensors"] is None
    assert mask_only["scale_log2"] == pytest.approx(0.5 * LOG2E)
    assert packed.config.mods.score_mod is not None and packed["score_premul"] == 0.5
    if path == "sm90":  # speculative maxima assume scores move by the built-in modifiers: a mask_mod only hides them
        assert not both.config.speculative_max and mask_only.config.speculative_max


@pytest.mark.parametrize("over, error", [
    (dict(score_mod=3), "score_mod must be a callable"),
    (dict(aux_tensors=[torch.zeros(2)]), "read by a score_mod or mask_mod"),
    (dict(mask_mod=causal, aux_tensors=torch.zeros(2)), "list of tensors"),
    (dict(score_mod=rel_bias, softcap=5.0), "do not compose with a score_mod"),
    (dict(mask_mod=causal, return_attn_probs=True, dropout_p=0.1), "return_attn_probs with dropout"),
    (dict(mask_mod=causal, score_mod_bwd=rel_bias_bwd), "score_mod_bwd is the backward of a score_mod"),
])
@pytest.mark.parametrize("name", ["func", "varlen"])
def test_bad_mods_are_refused(gpu_free, name, over, error):
    with pytest.raises((TypeError, ValueError), match=error):
        call(name, **with_(name, **over))
    assert not gpu_free.calls


@pytest.mark.parametrize("name", ["func", "varlen"])
def test_mods_reach_both_launchers_and_a_score_mod_gradient_needs_its_backward(gpu_free, name):
    """The forward and the backward launchers get (score_mod, mask_mod, aux_tensors,
    score_mod_bwd); a gradient through a score_mod without score_mod_bwd is refused before any
    launch (a mask_mod alone needs none)."""
    table = torch.zeros(3)
    args = with_(name, score_mod=rel_bias, mask_mod=causal, aux_tensors=[table], score_mod_bwd=rel_bias_bwd)
    args["q"] = args["q"].clone().requires_grad_()
    out = call(name, **args)
    out.sum().backward()
    (fwd, _, fwd_kw), (bwd, _, bwd_kw) = gpu_free.calls
    assert fwd.startswith("flash_fwd") and bwd.startswith("flash_bwd")
    assert fwd_kw["mods"] == bwd_kw["mods"] == (rel_bias, causal, [table], rel_bias_bwd)
    for mods, ok in ((dict(mask_mod=causal), True), (dict(score_mod=rel_bias), False)):
        args = with_(name, **mods)
        args["q"] = args["q"].clone().requires_grad_()
        if ok:
            call(name, **args)
        else:
            with pytest.raises(ValueError, match="needs its score_mod_bwd"):
                call(name, **args)


@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_backward_launchers_pass_the_mods_with_their_backward(recorder, monkeypatch, path):
    """The backward kernels' configs carry the forward's mods and score_mod_bwd, their launches
    the aux tensors and the score_mod's scales, dense and packed, on either path."""
    from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen

    if path == "sm90":
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 70, 4, 64, dtype=torch.bfloat16)
    lse = torch.randn(2, 4, 70)
    table = torch.randn(4, 300)
    flash_bwd(q, q, q, q, q, lse, softmax_scale=0.5, mods=(rel_bias, causal, [table], rel_bias_bwd))
    cu = torch.tensor([0, 70, 140], dtype=torch.int32)
    p = q.flatten(0, 1)
    flash_bwd_varlen(p, p, p, p, p, lse.transpose(0, 1).flatten(1), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70,
                     max_seqlen_k=70, softmax_scale=0.5, mods=(None, causal, None, None))
    mains = [x for x in recorder.launches if hasattr(x.config, "mods")]
    dense, packed = mains
    assert dense.config.mods.score_mod_bwd == UserMod.of(rel_bias_bwd) and dense["aux_tensors"] == [table]
    assert dense["scale_log2"] == LOG2E and dense["score_premul"] == 0.5
    assert packed.config.mods.mask_mod == UserMod.of(causal) and packed.config.mods.score_mod_bwd is None
    assert packed["aux_tensors"] is None and packed["scale_log2"] == pytest.approx(0.5 * LOG2E)
    assert type(dense.config).__name__ == ("Sm90BwdConfig" if path == "sm90" else "BwdConfig")


@pytest.mark.parametrize("name", ["func", "varlen"])
def test_return_attn_probs_without_dropout_takes_mods(gpu_free, name):
    """Without dropout S_dmask is empty (flash-attn's value), so return_attn_probs, the way to get
    the LSE, composes with mods; with dropout it is refused (`test_bad_mods_are_refused`)."""
    out, lse, probs = call(name, **with_(name, mask_mod=causal, return_attn_probs=True))
    assert probs.numel() == 0 and gpu_free.calls[0][2]["mods"][1] is causal


@cute.jit
def two_arguments(score, b_idx):
    return score


@cute.jit
def positions(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return q_idx - kv_idx


@cute.jit
def fa4_style(tSrS_ssa, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """As tests/gpu/test_mods_gpu.py writes one: `cute.where` on a comparison."""
    return cute.where(operator.ge(q_idx, kv_idx), tSrS_ssa, tSrS_ssa - 1.0)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("mods, message", [
    (dict(score_mod=two_arguments), r"score_mod 'two_arguments' failed to trace \(TypeError: .*\); a score_mod must "
                                    r"be score_mod\(score, b_idx"),
    (dict(mask_mod=positions), r"mask_mod 'positions' returned a TensorSSA of Int32 \(shape 1\); a mask_mod must "
                               r"be mask_mod\(b_idx"),
])
def test_a_bad_mod_is_named_when_its_kernel_compiles(arch, mods, message):
    """A mod that does not trace, or returns what the kernel cannot take, fails the compile
    (before any launch) with its name, the signature it must have and what went wrong."""
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMods
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_traits
    from layouts.traits import choose_fwd_traits

    user = UserMods(**{key: UserMod.of(fn) for key, fn in mods.items()})
    config = (FwdConfig(choose_fwd_traits(64, "bf16", 80), mods=user) if arch == 80
              else Sm90FwdConfig(choose_hopper_traits(64, "bf16"), mods=user))
    with pytest.raises(Exception, match=message):
        build(config, arch)


def test_a_flash_attn_4_style_mod_compiles():
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMods
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from layouts.traits import choose_fwd_traits

    build(FwdConfig(choose_fwd_traits(128, "bf16", 80), mods=UserMods(UserMod.of(fa4_style))), 80)


def test_speculative_maxima_take_a_mask_mod_not_a_score_mod():
    """A mask_mod only hides scores, as the built-in masks do, so the Hopper forward may take P
    from the kept row maxima with one; a score_mod moves scores where the speculation's bound
    does not follow them."""
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from layouts.hopper import choose_hopper_traits

    traits = choose_hopper_traits(128, "bf16")
    assert Sm90FwdConfig(traits, mods=UserMods(None, UserMod.of(causal)), speculative_max=True).speculative_max
    with pytest.raises(ValueError, match="speculative maxima"):
        Sm90FwdConfig(traits, mods=UserMods(UserMod.of(rel_bias), None), speculative_max=True)
