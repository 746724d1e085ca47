"""mk.measure.bounds: every semaphore, scratch, SMEM and HBM index of the megakernel on every model
family (tp 1, and tp 2 where the preset splits) and of the MoE, one-layer and linear-layer
stage kernels lies inside what it allocated, checked on the traced jaxpr (nothing runs).

Interpret mode clamps a semaphore index past the end (it signals the last semaphore
instead), so these checks are the only ones that see such a bug: the planted too-small
`small_sems` below (the plan's allocation before issue 40) must fail them. Small kernels
test the analysis itself: a static index, a loop counter, a guard, an unbounded read."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mk
from mk.measure import bounds, intervals
from mk.step import megakernel
from mk.model import reference
from mk.step import one_layer
from mk.step import plan as plan_module
from mk.kinds.linear.deltanet import gated_deltanet
from mk.kinds.mlp.mlp import MOE_SMALL_LOADS
from mk.model.weights import abstract_params


def _kernel(body, n=4, sems=2):
    """A pallas_call over x [n, 128] f32 in HBM with a VMEM copy and `sems` DMA
    semaphores; body(x_hbm, buf, sems, smem) traced, never run."""
    def kernel(i_smem, x_hbm, o_ref, buf, sem):
        body(x_hbm, buf, sem, i_smem)
        o_ref[...] = buf[...]

    def call(i, x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((n, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.VMEM((n, 128), jnp.float32),
                            pltpu.SemaphoreType.DMA((sems,))])(i, x)
    return call, (jax.ShapeDtypeStruct((1,), jnp.int32),
                  jax.ShapeDtypeStruct((n, 128), jnp.float32))


def _copy(x_hbm, buf, sems, row, sem):
    copy = pltpu.make_async_copy(x_hbm.at[row], buf.at[row], sems.at[sem])
    copy.start()
    copy.wait()


def _out_of_range(body, **kw):
    call, args = _kernel(body, **kw)
    [(_, jaxpr, names)] = bounds.kernel_jaxprs(call, *args)
    found = bounds.accesses(jaxpr, names)
    return found, [a for a in found if not a.in_range]


def test_a_static_semaphore_index_past_the_allocation_is_flagged():
    _, bad = _out_of_range(lambda x, b, s, i: _copy(x, b, s, 0, 2), sems=2)
    assert [(a.primitive, a.interval, a.size) for a in bad] == [
        ("dma_start", (2, 2), 2), ("dma_wait", (2, 2), 2)]
    _, bad = _out_of_range(lambda x, b, s, i: _copy(x, b, s, 0, 2), sems=3)
    assert not bad


def test_a_loop_counter_one_past_the_end_is_flagged_and_a_guard_clears_it():
    def loop(trips, guarded):
        def body(x, b, s, i):
            def one(r, carry):
                def copy():
                    _copy(x, b, s, r + 1, r % 2)
                if guarded:
                    pl.when(r + 1 < 4)(copy)
                else:
                    copy()
                return carry
            jax.lax.fori_loop(0, trips, one, 0)
        return body

    _, bad = _out_of_range(loop(3, False))
    assert not bad  # rows 1..3 of 4, semaphores r % 2 of 2
    _, bad = _out_of_range(loop(4, False))
    assert {(a.primitive, a.ref, a.interval) for a in bad} == {
        (p, ref, (1, 4)) for p in ("dma_start", "dma_wait") for ref in ("x_hbm", "buf")}
    _, bad = _out_of_range(loop(4, True))
    assert not bad


@pytest.mark.parametrize("beside_a_growing_carry", [False, True])
def test_a_carried_wrap_around_counter_is_bounded_and_one_wrapping_late_is_flagged(
        beside_a_growing_carry):
    """`Ring.matmul` carries each tile's slot as where(slot == n - 1, 0, slot + 1): in [0,
    n - 1] on every trip; wrapping at n instead reaches n, past the semaphores. It carries
    the slot beside the output panel, which counts up without a bound the walk reaches in
    its first rounds: only that carry is widened to unbounded, the slot still settles."""
    def loop(wrap_at):
        def body(x, b, s, i):
            def one(r, carry):
                slot, panel = carry
                _copy(x, b, s, r, slot)
                return (jnp.where(slot == wrap_at - 1, 0, slot + 1),
                        panel + (slot == 0).astype(jnp.int32))
            _, panel = jax.lax.fori_loop(0, 4, one, (jnp.int32(0), jnp.int32(0)))
            if beside_a_growing_carry:
                @pl.when(panel > 4)  # the panel stays live
                def _():
                    b[0:1, :] = jnp.zeros((1, 128), jnp.float32)
        return body

    found, bad = _out_of_range(loop(2), sems=2)
    assert not bad
    assert {a.interval for a in found if a.primitive == "dma_start" and a.dim == 0
            and a.size == 2} == {(0, 1)}
    _, bad = _out_of_range(loop(3), sems=2)
    assert {(a.primitive, a.interval) for a in bad} == {("dma_start", (0, 2)),
                                                          ("dma_wait", (0, 2))}


def test_a_bitwise_and_is_bounded_by_its_non_negative_operands():
    """x & m lies in [0, m] for m >= 0, whatever x is; a non-negative operand with no
    upper bound still makes it non-negative (a copy's tile t = offset & (stride - 1))."""
    eqn = jax.make_jaxpr(lambda a, b: a & b)(1, 1).eqns[0]
    assert intervals.scalar("and", eqn, [(0, None), (1, 1)]) == (0, 1)
    assert intervals.scalar("and", eqn, [(None, None), (0, None)]) == (0, None)
    assert intervals.scalar("and", eqn, [(None, None), (-4, 3)]) == intervals.TOP


def test_an_index_read_from_smem_is_counted_unbounded_not_flagged():
    found, bad = _out_of_range(lambda x, b, s, i: _copy(x, b, s, i[0], 0))
    assert not bad
    assert any(not a.bounded and a.primitive == "dma_start" for a in found)


# -- The megakernel on every model family --------------------------------------------------
def _megakernel_accesses(config, *, tp=1, batch=2, rows=2, context=256):
    """Every index of the megakernel's step for `config` at tp (one device's shard,
    traced with the tp mesh axis bound), and the plan."""
    plan = plan_module.DecodePlan.make(config, tp=tp, batch=batch, rows=rows, context=context)
    local = plan.local
    weights = jax.eval_shape(lambda: megakernel.prepare(plan, mk.init_params(config, seed=0)))
    if tp > 1:  # one device's: [tp, ...] less its leading axis
        weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), weights)
    cache = jax.eval_shape(lambda: reference.init_cache(local, batch, context))
    tokens = jax.ShapeDtypeStruct((batch, rows), jnp.int32)
    positions = jax.ShapeDtypeStruct((batch,), jnp.int32)
    step = functools.partial(megakernel.traced_step.__wrapped__, plan)
    [(name, jaxpr, names)] = bounds.kernel_jaxprs(
        step, weights, cache, tokens, positions, axis_env=[("tp", tp)] if tp > 1 else [])
    assert name == "mk_megakernel"
    return plan, bounds.accesses(jaxpr, names)


@pytest.mark.parametrize("name,tp", [("tiny", 1), ("tiny-moe", 1), ("tiny-hybrid", 1),
                                     ("tiny-kimi", 1), ("tiny", 2), ("tiny-moe", 2)])
def test_every_megakernel_index_is_inside_its_allocation(name, tp):
    plan, found = _megakernel_accesses(mk.preset(name), tp=tp)
    bad = [str(a) for a in found if not a.in_range]
    assert not bad, "\n".join(bad)
    summary = bounds.describe(found)
    # the check saw the kernel: most indices bounded, every scratch group's semaphores
    assert summary["bounded"] > 2 * summary["unbounded"] > 0
    refs = {a.ref for a in found}
    assert "scratch['layer']['sems']" in refs
    if any(kind.name == "moe" for kind in plan.kinds):
        small = {a.interval for a in found if a.ref == "scratch['layer']['small_sems']"}
        want = len(MOE_SMALL_LOADS) if plan.local.router_score == "sigmoid" else 2
        assert {lo for lo, _ in small} == set(range(want))
    if tp > 1:
        assert "scratch['all_reduce']['sems']" in refs


def test_planted_two_small_semaphores_fail_the_check(monkeypatch):
    """The plan's allocation before issue 40 (`DMA((2,))`) under the sigmoid router's
    bias, whose DMA signals small_sems[2]: interpret mode runs it (clamping the index);
    the bounds check names it."""
    scratch = plan_module.DecodePlan.scratch

    def two_small_sems(self):
        out = scratch(self)
        out["layer"]["small_sems"] = pltpu.SemaphoreType.DMA((2,))
        return out

    monkeypatch.setattr(plan_module.DecodePlan, "scratch", two_small_sems)
    _, found = _megakernel_accesses(mk.preset("tiny-kimi"))
    bad = [a for a in found if not a.in_range]
    assert bad and {a.ref for a in bad} == {"scratch['layer']['small_sems']"}
    assert {(a.interval, a.size) for a in bad} == {((2, 2), 2)}
    assert any("kinds/mlp/kinds.py" in a.where for a in bad)  # the MoE kind's router DMA


def test_the_moe_stage_kernel_with_a_sigmoid_router_and_shared_expert_is_in_range():
    M, D, E, Fe, Fs = 4, 256, 8, 128, 128
    bf16 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    call = functools.partial(mk.kinds.mlp.mlp.moe, top_k=2, renormalise=True,
                             router_score="sigmoid", expert_groups=2, topk_groups=1)
    found = bounds.check(lambda h, r, g, u, d, b, sg, su, sd: call(
        h, r, g, u, d, router_bias=b, shared=(sg, su, sd)),
        bf16((M, D)), bf16((D, E)), bf16((E, D, Fe)), bf16((E, D, Fe)), bf16((E, Fe, D)),
        bf16((E,)), bf16((D, Fs)), bf16((D, Fs)), bf16((Fs, D)))
    assert {a.interval for a in found if a.ref.endswith("['small_sems']")} == {
        (i, i) for i in range(len(MOE_SMALL_LOADS))}


@pytest.mark.parametrize("layer", [0, 1])  # tiny-moe's dense layer, an MoE layer
def test_the_one_layer_stage_kernel_is_in_range(layer):
    config, B, T, S = mk.preset("tiny-moe"), 2, 2, 256
    cache = jax.ShapeDtypeStruct((config.layers, B, config.kv_heads, S, config.head_dim),
                                 jnp.dtype(config.dtype))
    found = bounds.check(
        lambda p, x, k, v, pos: one_layer.one_layer(config, p, x, k, v, pos, layer=layer),
        abstract_params(config), jax.ShapeDtypeStruct((B, T, config.hidden), jnp.float32),
        cache, cache, jax.ShapeDtypeStruct((B,), jnp.int32))
    assert bounds.describe(found)["bounded"] > 0


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-kimi"])
def test_the_linear_layer_stage_kernel_is_in_range(name):
    config, B, T = mk.preset(name), 2, 2
    conv = jax.ShapeDtypeStruct((B, config.conv_kernel - 1, config.conv_channels),
                                jnp.dtype(config.dtype))
    state = jax.ShapeDtypeStruct((B, config.linear_value_heads, config.linear_key_dim,
                                  config.linear_value_dim), jnp.float32)
    found = bounds.check(
        lambda p, x, c, s: gated_deltanet(config, p, x, c, s, layer=config.linear_layers[-1]),
        abstract_params(config), jax.ShapeDtypeStruct((B, T, config.hidden), jnp.float32),
        conv, state)
    assert any(a.ref.endswith("['small_sems']") for a in found)
