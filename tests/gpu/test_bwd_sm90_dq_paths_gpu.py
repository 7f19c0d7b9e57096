"""The Hopper backward's dQ paths (`Sm90BwdConfig.dq_path`, kernels/sm90/bwd.py: "bulk", each
consumer warpgroup's bulk add of its staged run; "writer", the staged run's bulk add issued by a
producer warp while the consumers go on, as deterministic mode's is but in no fixed order;
"atomic", vector atomics from registers with no staging tile) on each bucket's tiles, asked
for through the launchers' `hopper_variant`, and the policy's choice per head dim
(`policy.hopper_bwd_dq`; at d 256 two Q / dO stages in the staging tile's room), against
`cute_flash.reference` by the backward's rule (tests/helpers/backward.py); each test checks
that every Hopper backward it launched took the variant asked for."""
import pytest

from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen
from cute_flash.launch.dense import flash_fwd, flash_fwd_varlen
from cute_flash.reference import attention_varlen_ref
from layouts.hopper import choose_hopper_bwd_traits
from tests.helpers.backward import assert_grads_match, inputs, packed_inputs
from tests.helpers.gpu_utils import config_lookups, cu_seqlens, only_the_hopper_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper_path(monkeypatch, kernels):
    with only_the_hopper_kernel(monkeypatch, kernels, "bwd", "backwards"):
        yield


def _took(configs, variant):
    assert configs and all(all(getattr(c, f) == x for f, x in variant.items()) for c in configs), \
        [c.name for c in configs]


def _check(monkeypatch, d, causal, shape, variant):
    configs = config_lookups(monkeypatch, Sm90BwdConfig)
    q, k, v, dout = inputs(*shape, d)
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
    grads = flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal, hopper_variant=variant)[:3]
    _took(configs, variant)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)


SHAPES = {"odd": (2, 333, 517, 6, 2), "many-blocks": (3, 1000, 700, 12, 4)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("path", ["bulk", "writer", "atomic"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_dq_paths(monkeypatch, d, path, causal, shape):
    """Every tile family (d 64 / 128: 128 keys a CTA; 192 / 256: 64 keys, the head dim split),
    GQA, odd lengths (sq < sk: causal rows see a shifted diagonal) and more CTAs than SMs with
    many query blocks each (sq > sk leaves causal key blocks with no row)."""
    _check(monkeypatch, d, causal, SHAPES[shape], dict(dq_path=path, traits=choose_hopper_bwd_traits(d)))


@pytest.mark.parametrize("variant", [dict(dq_path="bulk"), dict(dq_path="writer"), dict(dq_path="atomic")],
                         ids=["bulk", "writer", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_batches(monkeypatch, causal, variant):
    """A packed batch (the launch order longest first; an empty sequence, GQA, keys past the
    queries) at d 128 against the reference per sequence."""
    lq, lk, d = [300, 0, 1000, 77, 129], [500, 40, 1000, 60, 129], 128
    configs = config_lookups(monkeypatch, Sm90BwdConfig)
    q, k, v, dout = packed_inputs(lq, lk, 6, 2, d)
    lens = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    out, lse = flash_fwd_varlen(q, k, v, softmax_scale=d ** -0.5, causal=causal, **lens)
    grads = flash_bwd_varlen(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal, hopper_variant=variant,
                             **lens)[:3]
    _took(configs, variant)
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal, ref_fn=lambda q, k, v, **o: attention_varlen_ref(
        q, k, v, lens["cu_seqlens_q"], lens["cu_seqlens_k"], **o))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_the_default_path(monkeypatch, d, causal, shape):
    """With no `hopper_variant` the dispatcher's tiles and path per head dim: the writer warps'
    adds at d 64 (on 128 x 128 tiles) / 128 and at d 192 (on 96-key tiles, one dO stage),
    atomics with Q and dO double-buffered at d 256 (the pipelines wrap over two stages where the
    staged tiles have one)."""
    expected = {64: ("writer", 128, 2, 2, 128), 128: ("writer", 64, 2, 2, 128), 192: ("writer", 64, 2, 1, 96),
                256: ("atomic", 64, 2, 2, 64)}[d]  # path, query rows, Q stages, dO stages, keys
    configs = config_lookups(monkeypatch, Sm90BwdConfig)
    q, k, v, dout = inputs(*SHAPES[shape], d)
    out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
    grads = flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal)[:3]
    assert configs and all((c.dq_path, c.traits.block_m, c.traits.q_stages, c.traits.stages_do, c.traits.block_n)
                           == expected for c in configs), [c.name for c in configs]
    assert_grads_match(grads, q, k, v, dout, out=out, causal=causal)
