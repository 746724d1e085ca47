"""Tensor parallelism: the decode megakernel split over the `tp` devices of one mesh axis.

Every device runs the SAME megakernel (`mk.step.megakernel`, a `DecodePlan` with tp > 1) on its
shard of the weights (`mk.step.shards`, by the split rules of `mk.model.weights` and
`mk.model.cache`); in-kernel all-reduces after the token mixer and after the MLP make the partial
sums whole (`mk.kernels.collectives`), and the lm_head's shards end in a cross-shard greedy argmax.

Here: `decode_step`, `generate` (each a `jax.shard_map` over the mesh), `compile_target`
(what `mk.measure.tpu.compile_megakernel` compiles for tp > 1); their collectives' cost by the
ICI model is `mk.cost.perf.collective_terms`. Not here: sequence or expert parallelism, a
vocab-sharded embedding, meshes with more than one axis. The sharding model at length:
docs/design/mk.step.tensor_parallel.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mk.kernels import backend as backends
from mk.model import decode_checks, quant, reference
from mk.step import megakernel
from mk.model.config import ModelConfig
from mk.kernels.collectives import AXIS, check_interpret_devices, tp_mesh
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan
from mk.step.shards import check_sharded_cache, check_tp, shard_cache


def _specs(tree):
    return jax.tree.map(lambda _: P(AXIS), tree)


def _step(plan: DecodePlan, weights, cache, tokens, positions):
    """Per device (inside shard_map): one megakernel step on its shard; returns the next
    tokens [B, T] (the same on every device), its logits columns [1, B, T, V/tp], cache."""
    unstack = functools.partial(jax.tree.map, lambda a: a[0])
    nxt, logits, cache, *_ = megakernel.traced_step(plan, unstack(weights), unstack(cache),
                                                    tokens, positions)
    return nxt[None], logits[None], jax.tree.map(lambda a: a[None], cache)


def decode_step(plan: DecodePlan, weights, cache: reference.KVCache, tokens, positions,
                *, mesh: jax.sharding.Mesh):
    """One tensor-parallel decode step of `plan` (plan.tp devices, the size of the mesh's
    axis): weights from `mk.step.megakernel.prepare(plan, params)`, cache from
    `mk.step.shards.shard_cache` -> (next tokens [B, T] int32, logits [B, T, V] float32, cache),
    like `mk.step.megakernel.decode_step` (its `check_step`: the plan's [B, T], context and
    packed formats)."""
    config, tp = plan.config, mesh.shape[AXIS]
    if plan.tp != tp:
        raise ValueError(f"plan.tp={plan.tp} is not the mesh's {AXIS!r} axis of {tp} "
                         "devices")
    check_sharded_cache(config, cache, tp)
    check_interpret_devices(mesh)
    unstacked = type(cache)(*(a[0] for a in cache))
    tokens, positions = decode_checks.validate_step(plan.local, unstacked, tokens, positions)
    B, T = tokens.shape
    megakernel.check_step(plan, weights, unstacked.capacity, (B, T))
    nxt, logits, cache = _sharded_step(plan, mesh, weights, cache, tokens, positions)
    logits = jnp.moveaxis(logits, 0, -2).reshape(B, T, config.vocab)
    return nxt[0], logits, cache


@functools.partial(jax.jit, static_argnames=("plan", "mesh"))
def _sharded_step(plan, mesh, weights, cache, tokens, positions):
    return jax.shard_map(
        functools.partial(_step, plan), mesh=mesh,
        in_specs=(_specs(weights), _specs(cache), P(), P()),
        out_specs=(P(AXIS), P(AXIS), _specs(cache)), check_vma=False,
    )(weights, cache, tokens, positions)


def compile_target(plan: DecodePlan, mesh, weights, cache, tokens, positions):
    """The traced TP step with no host-side checks: what `mk.measure.tpu` compiles for plan.tp
    cores (weights and cache stacked [tp, ...])."""
    return _sharded_step(plan, mesh, weights, cache, tokens, positions)


@functools.partial(jax.jit, static_argnames=("plan", "mesh", "steps"),
                   donate_argnames="cache")  # in place, as mk.step.megakernel's and
                                             # mk.measure.tpu's
def _greedy_steps(plan, mesh, weights, cache, token, position, steps: int):
    """`mk.step.megakernel.greedy_steps` on every device -> (tokens [tp, B, steps], cache)."""
    def per_device(weights, cache, token, position):
        def step(cache, tokens, positions):
            nxt, _, cache = _step(plan, weights, cache, tokens, positions)
            return nxt[0], cache

        tokens, cache = megakernel.greedy_steps(step, cache, token, position, steps)
        return tokens[None], cache

    return jax.shard_map(per_device, mesh=mesh,
                         in_specs=(_specs(weights), _specs(cache), P(), P()),
                         out_specs=(P(AXIS), _specs(cache)), check_vma=False,
                         )(weights, cache, token, position)


def generate(config: ModelConfig, params, prompt, steps: int, *, tp: int,
             mesh: jax.sharding.Mesh | None = None, block: BlockSizes | None = None,
             max_context: int | None = None, steps_per_call: int | None = None,
             progress: bool = False, feeds=None, collective: str | None = None) -> jax.Array:
    """Greedy decoding with the megakernel on tp devices: the contract of
    `mk.step.megakernel.generate`, `progress` and `feeds` included; `collective` as in
    `decode_step`. Returns [tp, B, steps]:
    every device's copy of the tokens (they must agree; a test checks it)."""
    tp = check_tp(config, tp)
    mesh = mesh or tp_mesh(tp)
    if mesh.shape.get(AXIS) != tp:
        raise ValueError(f"mesh {dict(mesh.shape)} must have axis {AXIS!r} of size tp={tp}")
    check_interpret_devices(mesh)
    prompt, S, steps, steps_per_call = megakernel.check_generate(
        config, prompt, steps, steps_per_call, max_context)
    plan = DecodePlan.make(config, tp=tp, batch=prompt.shape[0], context=S,
                                block=block, formats=quant.formats_of(params), feeds=feeds,
                                collective=collective)
    megakernel.check_weights(plan, params)  # the params' faults before the backend's
    backends.check_active()
    weights = megakernel.prepare(plan, params)  # the prefill dequantises a layer at a time
    return megakernel.greedy_loop(
        functools.partial(_greedy_steps, plan, mesh, weights), config, params, prompt, S,
        steps, steps_per_call, progress=progress, desc=f"megakernel tp={tp}",
        shard=functools.partial(shard_cache, config, tp=tp), copies=(tp,))

