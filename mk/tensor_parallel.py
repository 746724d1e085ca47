"""Tensor parallelism: the decode megakernel split over the `tp` devices of one mesh axis.

Every device runs the SAME megakernel (`mk.megakernel`, static `tp`) on its shard of the
weights, described by a smaller `ModelConfig` (`shard_config`):

    attention  query heads N/tp per device; kv heads K/tp, or, when tp > K, the one kv head
               its query heads share (replicated on tp/K devices); wq, wk, wv split by
               columns, wo by rows; the KV cache holds the local kv heads.
    dense MLP  F/tp columns of w_gate, w_up; the same rows of w_down.
    MoE        every expert split the same way (Fe/tp); the router is replicated, so every
               device routes identically (its input is bit-identical, see below).
    padding    a split FFN or expert width that is not whole 128-lane tiles (qwen3-30b-a3b
               at TP4: 768/4 = 192) is padded with zero columns of gate/up and zero rows of
               down: silu(0) * 0 = 0, so the padding adds exact zeros (and bytes).
    lm_head    V/tp vocab columns per device; the embedding table stays whole (the gather
               of the step's tokens runs in XLA before the kernel).
    residual   replicated: norms, router and the residual add run on every device.

Inside the kernel, `wo` and `w_down` (and each expert's down) produce partial sums; one
in-kernel all-reduce after the attention output and one after the MLP make them whole
(`mk.collectives`, fixed tree order, so every device holds bit-identical residuals, and
its routing and argmax agree without an exchange). The lm_head's shards end in the
cross-shard greedy argmax.

Here: `check_tp`, `shard_config`, `shard_params` (params -> per-device stacks
[tp, ...]), `shard_cache`, `prepare`, `decode_step`, `generate` (each a `jax.shard_map`
over the mesh), `collective_terms` (their cost by the `mk.perf` ICI model), `compile_tp`
(ahead-of-time for a multi-chip topology). Not here:
sequence or expert parallelism, a vocab-sharded embedding, meshes with more than one axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mk import megakernel, perf, reference, tpu
from mk.chips import chip as chip_spec
from mk.collectives import (AXIS, MAX_INDEX, all_reduce_bytes, check_devices,
                            check_interpret_devices, tp_mesh)
from mk.config import ModelConfig, check_rows
from mk.kernels.common import LANES, BlockSizes, vmem_budget
from mk.kernels.one_layer import layer_block
from mk.schedule import decode_stream


def check_tp(config: ModelConfig, tp: int) -> None:
    """Every width split over tp devices must split evenly; raises ValueError naming it."""
    check_devices(tp)
    need = [("heads", config.heads), ("vocab", config.vocab), ("hidden", config.hidden)]
    if config.dense_layers:
        need.append(("ffn", config.ffn))
    if config.moe_layers:
        need.append(("expert_ffn", config.expert_ffn))
    for field, value in need:
        if value % tp:
            raise ValueError(f"{config.name}: {field}={value} is not a multiple of tp={tp}")
    K = config.kv_heads
    if K % tp and tp % K:
        raise ValueError(f"{config.name}: kv_heads={K} and tp={tp}: one must divide the "
                         "other (kv heads are split, or replicated on tp/K devices)")
    if config.vocab > MAX_INDEX:
        raise ValueError(f"{config.name}: vocab={config.vocab} over {MAX_INDEX} (token ids "
                         "travel as float32 in the cross-shard argmax)")


def _padded(width: int) -> int:
    """A split MLP width rounded up to whole 128-lane tiles."""
    return -(-width // LANES) * LANES


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The model one device holds: N/tp heads, max(K/tp, 1) kv heads, F/tp and Fe/tp
    (padded to whole 128-lane tiles), V/tp."""
    check_tp(config, tp)
    if tp == 1:
        return config
    return dataclasses.replace(
        config, name=f"{config.name}/tp{tp}", heads=config.heads // tp,
        kv_heads=max(config.kv_heads // tp, 1), ffn=_padded(config.ffn // tp),
        expert_ffn=_padded(config.expert_ffn // tp) if config.moe_layers else 0,
        vocab=config.vocab // tp, tie_embeddings=False)


def _columns(w, tp: int, pad: bool = False):
    """[..., C] -> [tp, ..., C/tp]: device i holds columns [i C/tp, (i+1) C/tp); with pad,
    zero columns up to whole 128-lane tiles."""
    out = jnp.moveaxis(w.reshape(*w.shape[:-1], tp, w.shape[-1] // tp), -2, 0)
    extra = _padded(out.shape[-1]) - out.shape[-1] if pad else 0
    return jnp.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, extra)]) if extra else out


def _rows(w, tp: int, pad: bool = False):
    """[..., R, C] -> [tp, ..., R/tp, C]; with pad, zero rows up to whole 128-row tiles."""
    out = jnp.moveaxis(w.reshape(*w.shape[:-2], tp, w.shape[-2] // tp, w.shape[-1]), -3, 0)
    extra = _padded(out.shape[-2]) - out.shape[-2] if pad else 0
    return jnp.pad(out, [(0, 0)] * (out.ndim - 2) + [(0, extra), (0, 0)]) if extra else out


def kv_heads_of(config: ModelConfig, tp: int) -> np.ndarray:
    """[tp, K_local] the global kv heads each device holds (replicated when tp > K)."""
    K = config.kv_heads
    local, copies = max(K // tp, 1), max(tp // K, 1)
    return np.array([[(i // copies) * local + j for j in range(local)] for i in range(tp)])


def _kv_columns(config: ModelConfig, w, tp: int):
    """wk / wv [L, D, K*H] -> [tp, L, D, K_local*H]."""
    heads = w.reshape(*w.shape[:-1], config.kv_heads, config.head_dim)
    picked = heads[..., kv_heads_of(config, tp), :]  # [L, D, tp, K_local, H]
    return jnp.moveaxis(picked.reshape(*w.shape[:-1], tp, -1), -2, 0)


def shard_params(config: ModelConfig, params, tp: int) -> dict:
    """Full params -> per-device params stacked on a leading [tp] axis, in the layout of
    `shard_config(config, tp)` (plus the whole `embed` [V, D], replicated)."""
    check_tp(config, tp)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    split = dict(wq=_columns(params["wq"], tp), wo=_rows(params["wo"], tp),
                 wk=_kv_columns(config, params["wk"], tp),
                 wv=_kv_columns(config, params["wv"], tp), lm_head=_columns(head, tp))
    for name in ("w_gate", "w_up", "we_gate", "we_up"):
        if name in params:
            split[name] = _columns(params[name], tp, pad=tp > 1)
    for name in ("w_down", "we_down"):
        if name in params:
            split[name] = _rows(params[name], tp, pad=tp > 1)
    whole = {k: v for k, v in params.items() if k not in split}
    return split | {k: jnp.broadcast_to(v, (tp, *v.shape)) for k, v in whole.items()}


def check_sharded_cache(cache: reference.KVCache, tp: int) -> None:
    """Refuse a cache that is not `shard_cache`'s [tp, L, B, K_local, S, H] layout."""
    if cache.k.ndim != 6 or cache.k.shape[0] != tp:
        raise ValueError(f"cache k shape {cache.k.shape} must be [tp={tp}, L, B, K_local, S, "
                         "H]; shard an [L, B, K, S, H] cache with "
                         "mk.tensor_parallel.shard_cache(config, cache, tp)")


def shard_cache(config: ModelConfig, cache: reference.KVCache, tp: int) -> reference.KVCache:
    """[L, B, K, S, H] caches -> [tp, L, B, K_local, S, H] (each device's kv heads)."""
    heads = kv_heads_of(config, tp)
    return reference.KVCache(*(jnp.moveaxis(c[:, :, heads], 2, 0)
                               for c in (cache.k, cache.v)))


def prepare(config: ModelConfig, params, block: BlockSizes, tp: int) -> dict:
    """Each device's megakernel weights, stacked [tp, ...] (shard, then `prepare`)."""
    local = shard_config(config, tp)
    stacked = shard_params(config, params, tp)
    return jax.vmap(lambda p: megakernel.prepare(local, p, block))(stacked)


def default_block(config: ModelConfig, tp: int, slots: int = 3) -> BlockSizes:
    """The megakernel's default tiles for the shards of `config`."""
    return layer_block(shard_config(config, tp), slots)


def _specs(tree):
    return jax.tree.map(lambda _: P(AXIS), tree)


def _step(config, block, tp, weights, cache, tokens, positions):
    """Per device (inside shard_map): one megakernel step on its shard; returns the next
    tokens [B, T] (the same on every device), its logits columns [1, B, T, V/tp], cache."""
    local = shard_config(config, tp)
    unstack = functools.partial(jax.tree.map, lambda a: a[0])
    nxt, logits, cache = megakernel.traced_step(local, block, unstack(weights),
                                                unstack(cache), tokens, positions, tp=tp)
    return nxt[None], logits[None], jax.tree.map(lambda a: a[None], cache)


def decode_step(config: ModelConfig, weights, cache: reference.KVCache, tokens, positions,
                *, block: BlockSizes, mesh: jax.sharding.Mesh):
    """One tensor-parallel decode step: weights from `prepare`, cache from `shard_cache`
    -> (next tokens [B, T] int32, logits [B, T, V] float32, cache), like
    `mk.megakernel.decode_step`."""
    tp = mesh.shape[AXIS]
    local = shard_config(config, tp)
    check_sharded_cache(cache, tp)
    check_interpret_devices(mesh)
    unstacked = reference.KVCache(cache.k[0], cache.v[0])
    tokens, positions = reference.validate_step(local, unstacked, tokens, positions)
    megakernel.check_block(block, cache.k.shape[4], tokens.size)
    decode_stream(local, tokens.size, block)  # raises if a shard does not tile
    nxt, logits, cache = _sharded_step(config, block, mesh, weights, cache, tokens,
                                       positions)
    B, T = tokens.shape
    logits = jnp.moveaxis(logits, 0, -2).reshape(B, T, config.vocab)
    return nxt[0], logits, cache


@functools.partial(jax.jit, static_argnames=("config", "block", "mesh"))
def _sharded_step(config, block, mesh, weights, cache, tokens, positions):
    tp = mesh.shape[AXIS]
    return jax.shard_map(
        functools.partial(_step, config, block, tp), mesh=mesh,
        in_specs=(_specs(weights), _specs(cache), P(), P()),
        out_specs=(P(AXIS), P(AXIS), _specs(cache)), check_vma=False,
    )(weights, cache, tokens, positions)


@functools.partial(jax.jit, static_argnames=("config", "block", "mesh", "steps"))
def _greedy_steps(config, block, mesh, weights, cache, token, position, steps: int):
    tp = mesh.shape[AXIS]

    def per_device(weights, cache, token, position):
        def step(carry, _):
            cache, token, position = carry
            nxt, _, cache = _step(config, block, tp, weights, cache, token[:, None],
                                  position)
            return (cache, nxt[0, :, 0], position + 1), nxt[0, :, 0]

        (cache, _, _), tokens = jax.lax.scan(step, (cache, token, position), None,
                                             length=steps)
        return tokens.T[None], cache

    return jax.shard_map(per_device, mesh=mesh,
                         in_specs=(_specs(weights), _specs(cache), P(), P()),
                         out_specs=(P(AXIS), _specs(cache)), check_vma=False,
                         )(weights, cache, token, position)


def generate(config: ModelConfig, params, prompt, steps: int, *, tp: int,
             mesh: jax.sharding.Mesh | None = None, block: BlockSizes | None = None,
             max_context: int | None = None, steps_per_call: int = 1) -> jax.Array:
    """Greedy decoding with the megakernel on tp devices: the contract of
    `mk.megakernel.generate`. Returns [tp, B, steps]: every device's copy of the tokens
    (they must agree; a test checks it)."""
    check_tp(config, tp)
    tp = int(tp)
    mesh = mesh or tp_mesh(tp)
    if mesh.shape.get(AXIS) != tp:
        raise ValueError(f"mesh {dict(mesh.shape)} must have axis {AXIS!r} of size tp={tp}")
    check_interpret_devices(mesh)
    prompt, S, steps, steps_per_call = megakernel.check_generate(
        config, prompt, steps, steps_per_call, max_context)
    block = block or default_block(config, tp)
    megakernel.check_block(block, S, prompt.shape[0])
    reference.check_params(config, params)
    decode_stream(shard_config(config, tp), prompt.shape[0], block)
    weights = prepare(config, params, block, tp)
    logits, cache = reference.prefill(config, params, prompt, max_context=S)
    cache = shard_cache(config, cache, tp)
    token = reference.greedy(logits[:, -1])
    out, done = [jnp.broadcast_to(token[None, :, None], (tp, token.shape[0], 1))], 1
    position = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    while done < steps:
        n = min(steps_per_call, steps - done)
        tokens, cache = _greedy_steps(config, block, mesh, weights, cache, token, position,
                                      n)
        out.append(tokens)
        token, position, done = tokens[0, :, -1], position + n, done + n
    return jnp.concatenate(out, axis=2)


# -- What the collectives cost ------------------------------------------------------------
def collective_terms(config: ModelConfig, tp: int, chip: str, *, batch: int = 8,
                     rows: int = 1) -> dict:
    """The in-kernel collectives of one TP step on `chip`, by the `mk.perf` ICI model
    (ICI_LATENCY_S per message round, one device's one-way ICI bandwidth): bytes, rounds
    and the latency and bandwidth terms, next to `mk.perf.predict`'s own collective term
    and HBM floor for the same step. The kernel all-reduces float32 partial sums."""
    check_tp(config, tp)
    spec = chip_spec(chip)
    M, rounds = batch * rows, check_devices(tp)
    message = M * config.hidden * 4
    reduces = 2 * config.layers if tp > 1 else 0
    sent = reduces * all_reduce_bytes(message, tp) + (tp - 1) * M * 128 * 4
    messages = reduces * 2 * rounds + rounds  # the argmax gather: log2(tp) rounds
    estimate = perf.predict(config, spec, batch=batch, rows=rows, tp=tp)
    return dict(
        tp=tp, all_reduces=reduces, all_reduce_KiB=message / 1024,
        sent_MiB_per_device=sent / 2**20, message_rounds=messages,
        latency_ms=messages * perf.ICI_LATENCY_S * 1e3,
        bandwidth_ms=sent / perf.ici_bandwidth(spec) * 1e3,
        perf_model_collective_ms=estimate.collective_ms,
        hbm_floor_ms=estimate.hbm_floor_ms)


# -- Ahead-of-time compiles for multi-chip topologies -------------------------------------
@dataclasses.dataclass(frozen=True)
class TPCompileReport:
    """One tensor-parallel compile: the whole step on every core of a topology."""

    name: str
    topology: str
    tp: int
    ok: bool
    error: str
    compile_seconds: float
    hbm_bytes_per_core: int = 0  # one core's weights and KV cache (project count)
    vmem_bytes_per_core: int = 0  # the megakernel's VMEM buffers (project budget)
    vmem_limit_bytes: int = 0
    argument_bytes: int = 0  # HBM per core for the inputs, as the compiler reports it
    temp_bytes: int = 0  # HBM scratch per core XLA allocates around the kernel

    def summary(self) -> str:
        head = f"{self.name} TP{self.tp} on {self.topology}"
        if not self.ok:
            return f"{head}: FAILED: {self.error.splitlines()[0] if self.error else ''}"
        return (f"{head}: compiled in {self.compile_seconds:.1f} s; per core HBM "
                f"{self.hbm_bytes_per_core / 2**30:.2f} GiB (compiler: arguments "
                f"{self.argument_bytes / 2**30:.2f} GiB, temp "
                f"{self.temp_bytes / 2**20:.1f} MiB), VMEM "
                f"{self.vmem_bytes_per_core / 2**20:.1f} of "
                f"{self.vmem_limit_bytes / 2**20:.0f} MiB")


def compile_tp(config: ModelConfig, topology: str, chip: str, *, tp: int | None = None,
               batch: int = 8, rows: int = 1, context: int = 4096,
               block: BlockSizes | None = None) -> TPCompileReport:
    """Compile one TP decode step of `config` for every core of a libtpu `topology`
    (e.g. "tpu7x:2x2x1", 8 cores) with tp = its core count unless given."""
    devices = tpu.devices(topology)
    tp = tp or len(devices)
    name = f"{config.name} B={batch} T={rows} S={context}"
    check_tp(config, tp)
    local = shard_config(config, tp)
    try:
        block = block or dataclasses.replace(layer_block(local), kv_tile=min(256, context))
        decode_stream(local, batch * rows, block)
    except ValueError as err:  # a shard that is not whole 128-lane tiles
        return TPCompileReport(name, topology, tp, False, f"{local.name}: {err}", 0.0)
    megakernel.check_block(block, context, check_rows(batch, rows))  # as the runtime does
    mesh = jax.sharding.Mesh(np.array(devices[:tp]), (AXIS,))
    spec = chip_spec(chip)
    params = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in config.param_shapes().items()}
    weights = jax.eval_shape(lambda p: prepare(config, p, block, tp), params)
    cache = jax.ShapeDtypeStruct((tp, config.layers, batch, local.kv_heads, context,
                                  config.head_dim), config.dtype)
    per_core = sum(math.prod(a.shape[1:]) * a.dtype.itemsize
                   for a in jax.tree.leaves(weights)) + 2 * (
        math.prod(cache.shape[1:]) * cache.dtype.itemsize)
    hbm = spec.hbm_bytes // spec.cores_per_chip
    if per_core > hbm:
        return TPCompileReport(name, topology, tp, False, f"{local.name}: weights and KV "
                               f"cache need {per_core / 2**30:.1f} GiB of HBM per core, over "
                               f"{spec.name}'s {hbm / 2**30:.1f} GiB", 0.0, per_core)
    try:
        budget = vmem_budget("tp megakernel", megakernel.megakernel_buffers(
            local, batch, rows, block, tp), spec)
    except ValueError as err:
        return TPCompileReport(name, topology, tp, False, str(err), 0.0, per_core)
    tokens = jax.ShapeDtypeStruct((batch, rows), jnp.int32)
    positions = jax.ShapeDtypeStruct((batch,), jnp.int32)
    sharded = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())
    cache_tree = reference.KVCache(cache, cache)
    in_shardings = (jax.tree.map(lambda _: sharded, weights),
                    jax.tree.map(lambda _: sharded, cache_tree), replicated, replicated)
    start = time.perf_counter()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(
                lambda w, c, t, p: _sharded_step(config, block, mesh, w, c, t, p),
                in_shardings=in_shardings).lower(weights, cache_tree, tokens,
                                                 positions).compile()
    except tpu.COMPILER_ERRORS as err:
        return TPCompileReport(name, topology, tp, False, f"{type(err).__name__}: {err}",
                               time.perf_counter() - start, per_core,
                               budget.total_bytes, budget.limit_bytes)
    seconds, mem = time.perf_counter() - start, compiled.memory_analysis()
    return TPCompileReport(name, topology, tp, True, "", seconds, per_core,
                           budget.total_bytes, budget.limit_bytes,
                           mem.argument_size_in_bytes, mem.temp_size_in_bytes)
