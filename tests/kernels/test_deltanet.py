"""Stage 05b: the gated delta rule's kernel against mk.linear_attention.delta_rule (the
reference's), race-free, B sequences x T rows, with the state after every row; a planted
early write-back proves the race check can fail; compiled for TPU7x at Qwen3.5-27B's linear
layer shape (48 value heads, head dims 128).

Interpret mode checks numerics, DMA/semaphore pairing and races; it says nothing about
time or the scoped VMEM limit. The compile test covers Mosaic lowering and capacity.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import mk
from mk import backend, tpu
from mk import linear_attention as la
from mk.kernels import deltanet
from mk.kernels.deltanet import delta_rule_step

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
        load = pltpu.make_async_copy(state_hbm.at[b], state_vmem.at[0], load_sems.at[0])
        load.start()
        load.wait()
        store = pltpu.make_async_copy(rows_vmem.at[0], rows_hbm.at[b], store_sems.at[0])
        store.start()  # too early

        def head(h, carry):
            first = (b * Nv + h) * rows
            out_vmem[b, h] = deltanet.delta_rule_head(
                q_vmem[b, h], k_vmem[b, h], v_vmem[b, h], state_vmem[0, h],
                lambda t: decay_smem[first + t], lambda t: beta_smem[first + t],
                deltanet.RowStore(rows_vmem, 0, h, rows))
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
