"""Stage 05b: the gated delta rule's kernel against mk.model.linear_attention.delta_rule (the
reference's), race-free, B sequences x T rows, with the state after every row; a planted
early write-back proves the race check can fail; compiled for TPU7x at Qwen3.5-27B's linear
layer shape (48 value heads, head dims 128).

Then the whole layer (`gated_deltanet`) against mk.model.reference.linear_decoder_layer on
tiny-hybrid (x after the mixer, conv and recurrent states after every row), race-free, and
on tiny-kimi (Kimi Delta Attention: per-channel decay; Kimi K3's bounded variant, slow);
a planted unshifted conv state and a planted decay per head prove the comparison can
fail; the layer compiled for TPU7x at the 27B's shape and at kimi-k2-shaped's TP32 KDA
shard, within VMEM.

Interpret mode checks numerics, DMA/semaphore pairing and races; it says nothing about
time or the scoped VMEM limit. The compile test covers Mosaic lowering and capacity.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import mk
from mk.kernels import backend
from mk.course import course
from mk.measure import tpu
from mk.model import linear_attention as la
from mk.kinds.linear import delta_rule, deltanet
from mk.model import reference as R
from mk.model.chips import chip
from mk.kernels.common import BlockSizes, vmem_budget
from mk.kernels.weight_streaming import stage_block
from mk.kinds.linear.delta_rule import delta_rule_step
from mk.kinds.linear.deltanet import gated_deltanet
from mk.kinds.layers import layer_kinds
from mk.kinds.linear.kinds import DeltaNet
from mk.model import weights
from mk.model.weights import param_shapes
from builders import tiny_bounded_kda

TOLERANCE = dict(rtol=2e-5, atol=2e-5)


def _inputs(B, T, Nv, Hk=128, Hv=128, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = la.l2norm(jax.random.normal(keys[0], (B, T, Nv, Hk))) / np.sqrt(Hk)
    k = la.l2norm(jax.random.normal(keys[1], (B, T, Nv, Hk)))
    v = jax.random.normal(keys[2], (B, T, Nv, Hv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, Nv)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, Nv)))
    state = jax.random.normal(keys[5], (B, Nv, Hk, Hv))
    return q, k, v, g, beta, state


def _run(q, k, v, g, beta, state):
    with backend.use("interpret", detect_races=True):
        out, rows = jax.block_until_ready(delta_rule_step(q, k, v, jnp.exp(g), beta, state))
    return out, rows, backend.races_found()


@pytest.mark.parametrize("B, T", [(1, 1), (3, 1), (2, 4)])
def test_matches_the_reference_with_every_row_state_and_no_races(B, T):
    args = _inputs(B, T, Nv=2, seed=B * 10 + T)
    out, rows, races = _run(*args)
    want_out, want_rows = la.delta_rule(*args)
    np.testing.assert_allclose(out, want_out, **TOLERANCE)
    np.testing.assert_allclose(rows, want_rows, **TOLERANCE)
    assert not races


def _write_back_before_compute(q_vmem, k_vmem, v_vmem, decay_smem, beta_smem, state_hbm,
                               out_vmem, rows_hbm, state_vmem, rows_vmem, load_sems,
                               store_sems, *, rows):
    """The planted bug: sequence b's row states are copied out BEFORE they are computed
    (the DMA reads rows_vmem while the vector unit writes it); unpipelined otherwise."""
    B, Nv, _, _ = q_vmem.shape

    def sequence(b, carry):
        load = pltpu.make_async_copy(state_hbm.at[0, b], state_vmem.at[0], load_sems.at[0])
        load.start()
        load.wait()
        store = pltpu.make_async_copy(rows_vmem.at[0], rows_hbm.at[0, b], store_sems.at[0])
        store.start()  # too early

        def head(h, carry):
            first = (b * Nv + h) * rows
            out_vmem[b, h] = delta_rule.delta_rule_head(
                q_vmem[b, h], k_vmem[b, h], v_vmem[b, h], state_vmem[0, h],
                lambda t: decay_smem[first + t], lambda t: beta_smem[first + t],
                delta_rule.RowStore(rows_vmem, 0, h, rows))
            return carry

        lax.fori_loop(0, Nv, head, 0)
        store.wait()
        return carry

    lax.fori_loop(0, B, sequence, 0)


def test_the_race_check_catches_a_planted_early_write_back():
    q, k, v, g, beta, state = _inputs(2, 2, Nv=1, seed=5)
    with backend.use("interpret", detect_races=True):
        jax.block_until_ready(delta_rule_step(q, k, v, jnp.exp(g), beta, state,
                                              kernel=_write_back_before_compute))
        assert backend.races_found()


def test_bad_head_dim_is_rejected():
    q, k, v, g, beta, state = _inputs(1, 1, Nv=1, Hk=64, Hv=128)
    with pytest.raises(ValueError, match="Hk=64"):
        delta_rule_step(q, k, v, jnp.exp(g), beta, state)


@pytest.mark.parametrize("T", [1, 4])
def test_compiles_for_tpu7x_at_the_27b_linear_layer_shape(T):
    config = mk.preset("qwen3.5-27b")
    B, Nv = 8, config.linear_value_heads
    Hk, Hv = config.linear_key_dim, config.linear_value_dim
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(s, f32) for s in
            [(B, T, Nv, Hk), (B, T, Nv, Hk), (B, T, Nv, Hv), (B, T, Nv), (B, T, Nv),
             (B, Nv, Hk, Hv)]]
    report = tpu.compile_for_chip(delta_rule_step, args, "tpu7x", name="delta_rule_step")
    assert report.ok, report.error


# -- The whole layer ---------------------------------------------------------------------
LAYER_TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # float32 math on bf16 weights, same cast points
# The conv rows are stored in bf16: a projection summed in another float32 order (the
# kernel's tiles, the reference's one dot) can round one value to the next bf16 (2^-7).
CONV_ROWS_TOLERANCE = dict(rtol=2 ** -7, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_hybrid():
    config = mk.preset("tiny-hybrid")
    return config, mk.init_params(config, seed=0)


def _layer_inputs(config, B, T, seed):
    """Non-zero states (a zero conv state would hide a wrong shift)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    Nv, Hk, Hv = config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    x = jax.random.normal(keys[0], (B, T, config.hidden))
    conv = jax.random.normal(keys[1], (B, config.conv_kernel - 1, config.conv_channels))
    state = 0.1 * jax.random.normal(keys[2], (B, Nv, Hk, Hv))
    return x, conv.astype(config.dtype), state


def _layer_vs_reference(config, params, B, T, layer, block=None, seed=0):
    """(kernel's, reference's) (x, conv rows, state rows), and whether races were found."""
    x, conv, state = _layer_inputs(config, B, T, seed)
    with backend.use("interpret", detect_races=True):
        got = jax.block_until_ready(gated_deltanet(config, params, x, conv, state,
                                                   layer=layer, block=block))
        races = backend.races_found()
    _, conv_rows, state_rows, x_mixed = R.linear_decoder_layer(config, params, layer, x,
                                                               conv, state)
    return got, (x_mixed, conv_rows, state_rows), races


def _assert_close(got, want):
    for name, a, b in zip(("x", "conv rows", "state rows"), got, want):
        tolerance = CONV_ROWS_TOLERANCE if name == "conv rows" else LAYER_TOLERANCE
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   err_msg=name, **tolerance)


@pytest.mark.parametrize("B, T, layer, block", [
    pytest.param(1, 1, 0, None, marks=pytest.mark.slow),
    pytest.param(4, 1, 3, None, marks=pytest.mark.slow),
    pytest.param(1, 4, 1, None, marks=pytest.mark.slow),
    (4, 4, 3, BlockSizes(slots=2, tile_rows=128, tile_cols=128))])  # tiles straddle segs
def test_layer_matches_the_reference_with_every_row_state_and_no_races(tiny_hybrid, B, T,
                                                                        layer, block):
    got, want, races = _layer_vs_reference(*tiny_hybrid, B, T, layer, block, seed=B + T)
    _assert_close(got, want)
    assert not races


def test_the_comparison_catches_a_planted_unshifted_conv_state(tiny_hybrid):
    """The planted bug (notebook 05b's exercise, `mk.course.course`): each row's conv state is the
    window before that row instead of after it; the output x is still right, only the state
    a verifier restarts from is wrong."""
    with course.planted("conv_unshifted"):
        got, want, _ = _layer_vs_reference(*tiny_hybrid, 2, 2, 3)
    course.check_close("x", got[0], want[0], **LAYER_TOLERANCE)
    with pytest.raises(course.ExerciseFailed, match="conv rows: kernel and reference differ"):
        course.check_close("conv rows", got[1], want[1], **CONV_ROWS_TOLERANCE)


@pytest.mark.parametrize("change, message", [
    (dict(layer=2), "layer=2 must be one of the linear layers"),
    (dict(conv_state=jnp.zeros((1, 2, 512))), r"conv_state shape \(1, 2, 512\)"),
    (dict(x=jnp.zeros((1, 1, 128))), "D=128"),
])
def test_bad_layer_inputs_are_rejected(tiny_hybrid, change, message):
    config, params = tiny_hybrid
    x, conv, state = _layer_inputs(config, 1, 1, seed=0)
    args = dict(x=x, conv_state=conv, state=state, layer=0) | change
    with pytest.raises(ValueError, match=message):
        gated_deltanet(config, params, **args)


# CI runs notebook 05c's check of the same (B = 1, T = 2, layer 3) and the planted decay
# per head below; these run in make test-slow.
@pytest.mark.slow
@pytest.mark.parametrize("name, B, T, layer", [("tiny-kimi", 1, 1, 0), ("tiny-kimi", 2, 4, 3),
                                               ("tiny-bounded-kda", 2, 4, 1)])
def test_kda_layer_matches_the_reference_with_every_row_state_and_no_races(name, B, T,
                                                                          layer):
    """Kimi Delta Attention (tiny-kimi's linear layers): per-channel decay, low-rank forget
    and output gates, the sigmoid-gated norm; Kimi K3's (`tiny_bounded_kda`): the bounded
    decay, the full-rank output gate through the ring."""
    config = tiny_bounded_kda() if name == "tiny-bounded-kda" else mk.preset(name)
    got, want, races = _layer_vs_reference(config, mk.init_params(config, seed=0), B, T,
                                            layer, seed=B + T)
    _assert_close(got, want)
    assert not races


def test_the_comparison_catches_a_planted_decay_per_head():
    """The planted bug (notebook 05c's exercise, `mk.course.course`): every channel of a KDA head
    decays by the head's first channel's decay, as a gated DeltaNet's head does."""
    config = mk.preset("tiny-kimi")
    with course.planted("head_decay"):
        got, want, _ = _layer_vs_reference(config, mk.init_params(config, seed=0), 1, 1, 0)
    with pytest.raises(course.ExerciseFailed, match="state rows: kernel and reference differ"):
        course.check_close("state rows", got[2], want[2], **LAYER_TOLERANCE)


def test_channel_column_is_an_exact_transpose():
    row = jax.random.normal(jax.random.key(0), (1, 128))
    np.testing.assert_array_equal(deltanet.channel_column(row), row.T)


def _kimi_k3_tp32_linear_shard():
    """kimi-k2-shaped's KDA layer as one of 32 tensor-parallel devices holds it: 2 of its 64 heads
    (the low-rank inner projections kda_f_a and kda_g_a whole)."""
    return dataclasses.replace(mk.preset("kimi-k2-shaped"), linear_key_heads=2,
                               linear_value_heads=2)


@pytest.mark.parametrize("shard", ["qwen3.5-27b", "kimi-k2-shaped/tp32"])
def test_layer_compiles_for_tpu7x_within_vmem(shard):
    """B = 8, T = 4 (a verification step): the largest buffers are the 2 x T row states.
    The 27B's gated-DeltaNet layer whole; kimi-k2-shaped's KDA layer as its TP32 shard (all 64 of
    its heads would need more than TPU7x's 64 MiB of VMEM at this B and T)."""
    config = (mk.preset(shard) if shard == "qwen3.5-27b" else _kimi_k3_tp32_linear_shard())
    B, T = 8, 4
    shapes = param_shapes(config)
    names = (*sum(deltanet.linear_weights(config), ()), "attn_norm")
    params = {n: jax.ShapeDtypeStruct((1, *shapes[n][0][1:]), shapes[n][1])
              for n in names}  # one layer's rows: the kernel reads no other
    Nv, Hk, Hv = config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    args = [params, jax.ShapeDtypeStruct((B, T, config.hidden), jnp.float32),
            jax.ShapeDtypeStruct((B, config.conv_kernel - 1, config.conv_channels),
                                 config.dtype),
            jax.ShapeDtypeStruct((B, Nv, Hk, Hv), jnp.float32)]
    # two ring slots of the default 2 MiB tile: the 27B's whole-layer row states leave no
    # room for a third
    block = dataclasses.replace(
        stage_block(deltanet.gated_deltanet_matrices(config), config.dtype), slots=2)
    budget = vmem_budget("gated_deltanet",
                         deltanet.gated_deltanet_buffers(config, B, T, block), chip("tpu7x"))
    report = tpu.compile_for_chip(
        lambda p, x, c, s: gated_deltanet(config, p, x, c, s, layer=config.linear_layers[0],
                                          block=block),
        args, "tpu7x", name="gated_deltanet", vmem=budget)
    assert report.ok, report.error
    assert 0 < report.vmem.total_bytes <= report.vmem.limit_bytes


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-kimi", "tiny-bounded-kda"])
def test_the_stage_kernel_asks_the_weight_table_what_the_linear_kind_says(name):
    """The stage kernel reads the linear kind's gates, layers and DMA'd weights from the
    weight table (`deltanet.GATES`, `linear_layers`, `mk.model.weights.dma_laid_out`); the kind
    object (`mk.kinds.linear.kinds`) says the same (Kimi K3's KDA too: `tiny_bounded_kda`)."""
    config = tiny_bounded_kda() if name == "tiny-bounded-kda" else mk.preset(name)
    kind = next(k for k in layer_kinds(config) if isinstance(k, DeltaNet))
    assert deltanet.linear_gates(config) is kind.gates is deltanet.GATES[kind.name]
    assert deltanet.linear_layers(config) == kind.layers
    params = mk.init_params(config)
    prepared = kind.prepare({n: params[n] for n in kind.weights("ring", "dma")})
    for n in kind.weights("dma"):
        got = weights.dma_laid_out(n, params[n])
        assert got.shape == prepared[n].shape and got.dtype == prepared[n].dtype
        np.testing.assert_array_equal(got, prepared[n])
    assert deltanet.linear_gates(mk.preset("tiny")) is None
    assert deltanet.linear_layers(mk.preset("tiny")) == ()
