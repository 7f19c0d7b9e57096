"""flash-attn compatibility beyond argument checks, on CPU: autograd wiring (every
differentiable function's backward reaches the launcher with the forward's options, packed
inputs get packed gradients; functions without a backward refuse),
`cute_flash.flash_attn_interface` mirrors flash-attn 2.8.3's module (private forwards and
backwards included) and `cute_flash.__version__`. Dispatch goes through the seam of
tests/helpers/interface.py (a recorder in place of the kernels)."""
import importlib.metadata
import inspect

import pytest
import torch

import cute_flash
from cute_flash import flash_attn_interface as fai
from cute_flash import interface as fi
from tests.helpers.interface import ALL, FUNCS, HALF_ARGS, call, i32, valid

# --- gradients ------------------------------------------------------------------------------

DIFFERENTIABLE = [n for n in ALL if not n.startswith("kvcache") and n != "varlen_paged"]
PACK_FILLS = {"qkv": (1, 2, 3), "kv": (2, 3)}  # the fake backward's dq, dk, dv fills


def _requiring_grad(name, *names):
    args = valid(name)
    for arg in names:
        args[arg] = args[arg].clone().requires_grad_(True)
    return args


@pytest.mark.parametrize("name, arg", [(n, a) for n in ALL for a in HALF_ARGS[n]
                                       if n.startswith("kvcache") or n == "varlen_paged"])
def test_a_call_without_a_backward_runs_and_refuses_at_backward(gpu_free, name, arg):
    """flash_attn_with_kvcache and paged varlen calls have no backward (as in flash-attn): the
    forward runs with an input that requires grad (flash-attn's suite does that), and asking for
    the gradient raises at backward(), naming the call, why and the input, so no gradient is
    dropped in silence."""
    args = _requiring_grad(name, arg)
    fn_name = FUNCS[name].__name__
    why = (r"it is inference-only and has no backward pass \(as in flash-attn\)" if name.startswith("kvcache")
           else r"there is no gradient through a paged KV cache \(block_table\), as in flash-attn")
    out = call(name, **args)
    assert [c[0] for c in gpu_free.calls] == ["flash_fwd_kvcache" if name.startswith("kvcache") else "flash_fwd_varlen"]
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match=rf"^{fn_name} has no gradient: {why}, and {arg} requires? grad"):
        out.sum().backward()
    assert len(gpu_free.calls) == 1  # no backward launched
    with torch.no_grad():
        assert not call(name, **args).requires_grad


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_backward_reaches_every_input_in_its_packed_form(gpu_free, name):
    """out.backward() runs the launcher's backward once, with the forward's canonical options,
    and each input gets its gradient in its own shape: a packed qkv / kv one packed tensor whose
    slices are the dq / dk / dv the launcher wrote."""
    wanted = HALF_ARGS[name]
    args = _requiring_grad(name, *wanted)
    out = call(name, **args, causal=True, window_size=(5, 9), deterministic=True)
    out.backward(torch.ones_like(out))
    fwd, bwd = (c[0] for c in gpu_free.calls)
    assert fwd.startswith("flash_fwd") and bwd == fwd.replace("fwd", "bwd")
    fwd_kw, kw = gpu_free.calls[0][2], gpu_free.calls[1][2]
    shared = ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes")
    assert [kw[o] for o in shared] == [fwd_kw[o] for o in shared]
    assert kw["causal"] and kw["window_size"][1] == 0 and kw["deterministic"] is True
    for arg in wanted:
        grad = args[arg].grad
        assert grad.shape == args[arg].shape and grad.dtype == args[arg].dtype
        fills = PACK_FILLS[arg] if arg in PACK_FILLS else {"q": (1,), "k": (2,), "v": (3,)}[arg]
        slices = grad.unbind(-3) if arg in PACK_FILLS else (grad,)
        assert [s.unique().tolist() for s in slices] == [[f] for f in fills]


@pytest.mark.parametrize("name", ["func", "varlen"])
def test_backward_honours_needs_input_grad(gpu_free, name):
    args = _requiring_grad(name, "k")
    out = call(name, **args)
    out.sum().backward()
    assert args["k"].grad is not None and args["q"].grad is None and args["v"].grad is None


def test_lse_is_not_differentiable(gpu_free):
    args = _requiring_grad("func", "q")
    out, lse, _ = call("func", **args, return_attn_probs=True)
    assert out.grad_fn is not None and lse.grad_fn is None and not lse.requires_grad


@pytest.mark.parametrize("name", ALL)
def test_no_grad_mode_or_detached_inputs_run_without_autograd(gpu_free, name):
    arg = HALF_ARGS[name][0]
    with torch.no_grad():
        assert call(name, **_requiring_grad(name, arg)).grad_fn is None
    with torch.inference_mode():
        call(name, **_requiring_grad(name, arg))
    call(name, **valid(name))  # grad mode on, nothing requires grad
    assert len(gpu_free.calls) == 3


def test_private_forward_takes_inputs_requiring_grad(gpu_free):
    """flash-attn's private forwards have no autograd: callers wrap them in their own Function."""
    args = _requiring_grad("func", "q")
    out = fai._flash_attn_forward(args["q"], args["k"], args["v"], 0.0, 0.125, False, -1, -1, 0.0, None, False)
    assert len(gpu_free.calls) == 1 and out[0].grad_fn is None


def test_private_backward_writes_the_given_tensors(gpu_free):
    args = valid("func")
    q, k, v = args["q"], args["k"], args["v"]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    softmax_d = fai._flash_attn_backward(torch.ones_like(q), q, k, v, out, lse, dq, dk, dv, 0.0, 0.5, True,
                                         -1, 7, 0.0, None, True)
    [(fn, _, kw)] = gpu_free.calls
    assert fn == "flash_bwd" and kw["window_size"] == (-1, 0) and kw["deterministic"]
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all() and softmax_d.shape == lse.shape


# --- the flash_attn_interface module ---------------------------------------------------------

FLASH_ATTN_2_8_3_PRIVATE = {  # flash_attn/flash_attn_interface.py at v2.8.3
    "_flash_attn_forward": (
        "(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, "
        "causal: bool, window_size_left: int, window_size_right: int, softcap: float, "
        "alibi_slopes: Optional[torch.Tensor], return_softmax: bool) -> "
        "Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]"),
    "_flash_attn_backward": (
        "(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
        "softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], "
        "dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, "
        "window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool, "
        "rng_state: Optional[torch.Tensor] = None) -> torch.Tensor"),
    "_flash_attn_varlen_backward": (
        "(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
        "softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], "
        "dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, "
        "max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, "
        "window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool, "
        "rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor"),
    "_flash_attn_varlen_forward": (
        "(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, "
        "cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, "
        "softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1, "
        "softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False, "
        "block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None, "
        "seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False, num_splits: int = 0) -> "
        "Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]"),
}  # (num_splits: the newest flash-attn's addition, after 2.8.3's arguments)


@pytest.mark.parametrize("fn", sorted(FLASH_ATTN_2_8_3_PRIVATE))
def test_private_forward_signatures_are_flash_attn_2_8_3(fn):
    assert str(inspect.signature(getattr(fai, fn))) == FLASH_ATTN_2_8_3_PRIVATE[fn]


def test_module_holds_the_public_functions():
    for fn in fi.__all__:
        assert getattr(fai, fn) is getattr(fi, fn) is getattr(cute_flash, fn)
    assert set(fi.__all__) | set(FLASH_ATTN_2_8_3_PRIVATE) | {"_get_block_size_n"} == set(fai.__all__)
    assert str(inspect.signature(fai._get_block_size_n)) == (
        "(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int")  # flash-attn's names and order


def test_private_forward_returns_flash_attn_tuple(gpu_free):
    args = valid("func")
    q, k, v = args["q"], args["k"], args["v"]
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, 0.5, True, 3, -1, 2.0, None, True)
    [(fn, (q_, k_, v_), kw)] = gpu_free.calls
    assert fn == "flash_fwd" and q_ is q and k_ is k and v_ is v
    assert kw["softmax_scale"] == 0.5 and kw["causal"] and kw["window_size"] == (3, 0) and kw["softcap"] == 2.0
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    assert rng_state.dtype == torch.int64 and rng_state.tolist() == [0, 0]


def test_private_varlen_forward_returns_flash_attn_tuple(gpu_free):
    args = valid("varlen_paged")
    out, lse, s_dmask, rng_state = fai._flash_attn_varlen_forward(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], args["max_seqlen_q"],
        args["max_seqlen_k"], 0.0, 0.25, False, block_table=args["block_table"], seqused_k=args["seqused_k"],
        zero_tensors=True)
    [(fn, _, kw)] = gpu_free.calls
    assert fn == "flash_fwd_varlen" and kw["block_table"] is args["block_table"]
    assert kw["seqused_k"] is args["seqused_k"] and kw["window_size"] == (-1, -1)
    assert out.shape == args["q"].shape and lse.shape == (args["q"].shape[1], args["q"].shape[0])
    assert s_dmask.shape == (0,) and rng_state.tolist() == [0, 0]


VARLEN_POS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


@pytest.mark.parametrize("seqused", [False, True])
def test_private_varlen_forward_skips_the_left_pad(gpu_free, seqused):
    """leftpad_k as flash-attn's varlen forward reads it: sequence b's keys start leftpad_k[b]
    rows after cu_seqlens_k[b], and that many fewer are used (of seqused_k[b] when given)."""
    args = valid("varlen")  # cu_seqlens_k (0, 4, 7)
    used = i32(3, 2) if seqused else None
    fai._flash_attn_varlen_forward(*(args[a] for a in VARLEN_POS), 0.0, 0.25, False, leftpad_k=i32(1, 2),
                                   seqused_k=used)
    [(fn, _, kw)] = gpu_free.calls
    assert kw["cu_seqlens_k"].tolist() == [1, 6, 7] and args["cu_seqlens_k"].tolist() == [0, 4, 7]
    assert kw["seqused_k"].dtype == torch.int32 and kw["seqused_k"].tolist() == ([2, 0] if seqused else [3, 1])


def test_private_varlen_forward_checks_leftpad(gpu_free):
    args = valid("varlen")
    pos = [args[a] for a in VARLEN_POS]
    with pytest.raises(ValueError, match=r"^leftpad_k must have shape \(2,\)"):
        fai._flash_attn_varlen_forward(*pos, 0.0, 0.25, False, leftpad_k=i32(1, 2, 3))
    with pytest.raises(TypeError, match="^leftpad_k must have dtype torch.int32, got torch.int64"):
        fai._flash_attn_varlen_forward(*pos, 0.0, 0.25, False, leftpad_k=torch.zeros(2, dtype=torch.int64))
    paged = valid("varlen_paged")
    with pytest.raises(ValueError, match=r"^leftpad_k with a paged KV cache \(block_table\) is not supported"):
        fai._flash_attn_varlen_forward(*(paged[a] for a in VARLEN_POS), 0.0, 0.25, False,
                                       block_table=paged["block_table"], leftpad_k=i32(0, 0))
    assert gpu_free.calls == []


def test_private_varlen_forward_takes_num_splits(gpu_free):
    """The newest flash-attn's num_splits: 0 and 1 run (the same call), above 1 over a paged cache
    is refused with flash-attn's message and exception type."""
    paged = valid("varlen_paged")
    pos = [paged[a] for a in VARLEN_POS]
    for n in (0, 1):
        fai._flash_attn_varlen_forward(*pos, 0.0, 0.25, False, block_table=paged["block_table"], num_splits=n)
    assert [c[0] for c in gpu_free.calls] == ["flash_fwd_varlen"] * 2
    with pytest.raises(RuntimeError, match="^num_splits > 1 is not supported for varlen paged KV"):
        fai._flash_attn_varlen_forward(*pos, 0.0, 0.25, False, block_table=paged["block_table"], num_splits=2)
    with pytest.raises(ValueError, match="^num_splits must be an int >= 0"):
        fai._flash_attn_varlen_forward(*pos, 0.0, 0.25, False, num_splits=-1)
    assert len(gpu_free.calls) == 2


def test_private_forward_validates_like_the_public_one():
    args = valid("func")
    with pytest.raises(ValueError, match=r"^window_size must be a pair"):
        fai._flash_attn_forward(args["q"], args["k"], args["v"], 0.0, 0.5, False, -3, -1, 0.0, None, False)
    with pytest.raises(TypeError, match="must be CUDA tensors"):
        fai._flash_attn_forward(args["q"], args["k"], args["v"], 0.0, 0.5, False, -1, -1, 0.0, None, False)


def test_version_is_the_installed_distribution_version():
    assert cute_flash.__version__ == importlib.metadata.version("cute-flash")


# --- meta tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_meta_tensors_give_meta_outputs_of_the_right_shapes(name):
    """Shape inference (FLOP counters, models built on the meta device): every public function
    answers meta inputs with meta outputs shaped as a CUDA call's, and launches nothing."""
    args = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in valid(name).items()}
    q = args[FIRST_Q[name]]
    if name.startswith("kvcache"):
        out, lse = call(name, **args, return_softmax_lse=True)
        b, sq, h = q.shape[:3]
        lse_shape = (b, h, sq)
    else:
        out, lse, probs = call(name, **args, return_attn_probs=True, dropout_p=0.1)
        varlen = name.startswith("varlen")
        lse_shape = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[-2], q.shape[1])
        assert probs.is_meta and probs.dtype == q.dtype and probs.dim() == 4
    q_shape = q.shape[:-3] + q.shape[-2:] if "qkvpacked" in name else q.shape  # qkv without its "3"
    assert out.is_meta and out.dtype == q.dtype and out.shape == q_shape
    assert lse.is_meta and lse.dtype == torch.float32 and lse.shape == lse_shape


FIRST_Q = {name: "qkv" if "qkvpacked" in name else "q" for name in ALL}


def test_meta_backward_gives_meta_gradients():
    args = {n: t.to("meta").requires_grad_() for n, t in valid("func").items()}
    out = fi.flash_attn_func(**args, causal=True)
    out.backward(torch.ones_like(out))
    for n, t in args.items():
        assert t.grad.is_meta and t.grad.shape == t.shape


def test_meta_private_forward_and_backward():
    args = {n: t.to("meta") for n, t in valid("func").items()}
    q, k, v = args["q"], args["k"], args["v"]
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, 0.5, True, -1, -1, 0.0, None, False)
    assert out.is_meta and out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    d = fai._flash_attn_backward(out, q, k, v, out, lse, dq, dk, dv, 0.0, 0.5, True, -1, -1, 0.0, None, False)
    assert d.is_meta and d.shape == lse.shape


def test_meta_and_cuda_tensors_do_not_mix():
    args = valid("func")
    with pytest.raises(TypeError, match="must be on the same device as q"):
        fi.flash_attn_func(args["q"].to("meta"), args["k"], args["v"])
