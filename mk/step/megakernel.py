"""The decode megakernel: every layer, the final norm, the lm_head and greedy argmax in one
pallas_call, with one weight ring that runs across layer boundaries.

One device's step is a `DecodePlan` (`mk.step.plan`); the kernel knows no layer kind
itself, it asks the plan's kinds (`mk.kinds`). Here: `prepare` (weights in the
megakernel's layout, once; `check_weights`; `prepare_shards`), `decode_step` (with
`taps=True`, the residual after every block), `traced_step` (what
`mk.measure.tpu.compile_megakernel` compiles; `step_in_place`, its cache donated; `device_loop`),
`first_divergence`, `generate` and the one greedy loop (`greedy_loop`, `greedy_steps`),
`check_generate`, `progress_bar`. Not here: the compile-time benchmark
(benchmarks/compile_time.py), the reference's loop (`mk.model.reference.generate`), the sharding
(`mk.step.tensor_parallel`). The ring across layers, the buffers by name (`INPUT_SPACES`,
`OUTPUT_SPACES`), hybrids, Kimi's latent attention, Kimi K3's attention residuals, what is
prefetched a layer ahead, quantised weights and tensor parallelism:
docs/design/mk.step.megakernel.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tqdm.auto import tqdm

from mk.kernels import backend as backends
from mk.model import decode_checks, quant, reference
from mk.step import preparation
from mk.model.cache import has_states
from mk.model.chips import chip_of
from mk.model.config import ModelConfig, positive_int
from mk.kernels.collectives import (AXIS, COLLECTIVE_IDS, CollectiveScratch, all_reduce_body,
                                    argmax_body, barrier)
from mk.kernels.common import (BlockSizes, aliases, default_kv_tile, memory_specs,
                               sequenced, start_dma)
from mk.kinds.linear.deltanet import STATE_INPUTS, STATE_OUTPUTS
from mk.step.one_layer import layer_body
from mk.step.plan import DecodePlan, model_stream, packed_formats, padded_vocab
from mk.kernels.ring import Ring, ring_layout
from mk.kinds.base import Step
from mk.kinds.layers import TABLES, kind_at, layer_kinds, layer_tables, of_role, stream_kind
from mk.model.ops import rms_norm
from mk.step.shards import shard_params

TAPS = ("attn", "mlp")  # where the residual stream is tapped in each layer (debug path)
# Where each operand of the kernel lives: SMEM scalars, VMEM, or HBM (pl.ANY, DMA'd by
# hand). The kinds' weights (`operands`) are HBM operands too (`traced_step` adds them); a
# hybrid's linear states too (STATE_INPUTS and its outputs STATE_OUTPUTS).
INPUT_SPACES = dict(positions=pltpu.SMEM, **{n: pltpu.SMEM for n in TABLES},
                    x=pltpu.VMEM, final_norm=pl.ANY, norms=pl.ANY, qk_norms=pl.ANY,
                    lm_head=pl.ANY, k_cache=pl.ANY, v_cache=pl.ANY, latent_cache=pl.ANY,
                    **{n: pl.ANY for n in STATE_INPUTS})
OUTPUT_SPACES = dict(next_tokens=pltpu.VMEM, logits=pltpu.VMEM, k_cache=pl.ANY,
                     v_cache=pl.ANY, latent_cache=pl.ANY, taps=pltpu.VMEM,
                     **{n: pl.ANY for n in STATE_OUTPUTS})


def operands(config: ModelConfig) -> tuple[str, ...]:
    """The HBM weights of `config`'s layer kinds that the kernel streams or DMAs, in
    stream order (`mk.kinds.base.Kind.operands`; the norms come as the layer's vectors)."""
    return tuple(n for kind in layer_kinds(config) for n in kind.operands())


def prepare(plan: DecodePlan, params, *, donate: bool = False) -> dict:
    """The megakernel's weights for `plan`, made once from the model's params (checked
    first: `check_weights`): one device's (`_device_weights`), or at tp > 1 each
    device's stacked [tp, ...] (split by `mk.step.shards.shard_params`, then laid out per
    device). Made one tensor at a time (`mk.step.preparation.lay_out`); donate=True gives the
    params up (each deleted once laid out), so the device never holds two copies."""
    check_weights(plan, params)
    if plan.tp == 1:
        return preparation.lay_out(Layout(plan), params, donate=donate)
    return prepare_shards(plan, shard_params(plan.config, params, plan.tp), donate=donate)


def prepare_shards(plan: DecodePlan, shards, *, donate: bool = False) -> dict:
    """The megakernel's weights for `plan` (tp > 1) from its devices' params shards
    stacked [tp, ...] (`mk.step.shards.shard_params`' layout; also the global arrays of
    `mk.step.distributed.load_process_shards`), each device's laid out as `prepare` lays it
    out. Checks nothing: the shards' loader did."""
    return preparation.lay_out(Layout(plan), shards, donate=donate)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The plan's weight layout as one hashable function of the params (at tp > 1 of
    their [tp, ...] shards, each device's laid out alike): what `mk.step.preparation` runs a
    tensor at a time and replays for its peak."""

    plan: DecodePlan

    def __call__(self, params) -> dict:
        plan = self.plan
        if plan.tp == 1:
            return _device_weights(plan.local, params, plan.block)
        return jax.vmap(lambda p: _device_weights(plan.local, p, plan.block))(params)


def check_weights(plan: DecodePlan, params) -> None:
    """Raise ValueError naming the field, before anything is traced, unless `params` are
    the plan's model's (every tensor's name, shape and dtype, a quantised one's logical
    shape: `mk.model.decode_checks.check_params`) and every quantised weight's concrete values
    decode to finite numbers (`mk.model.quant.check_values`: NaN or inf scales, NaN codes).
    Their formats are theirs (`mk.model.quant.formats_of`: what `prepare` lays out packed)."""
    decode_checks.check_params(plan.config, params, "mk.step.megakernel.prepare", quantised=True)
    for name, p in params.items():
        if isinstance(p, quant.QuantWeight):
            quant.check_values(name, p)


def _device_weights(config: ModelConfig, params, block: BlockSizes) -> dict:
    """One device's megakernel weights for the model (or shard) `config` (`prepare`): each
    layer kind's (`Kind.prepare`) with the ring's in stream order for `block`
    (`mk.kernels.ring.ring_layout`: each stacked matrix [..., tiles, tile_rows,
    tile_cols], transposed where `BlockSizes.cut` says; quantised ones
    `mk.model.quant.tile_major`), the norms stacked per layer in float32 (norm_offset added; a
    layer whose mixer has no q/k norms gets ones), the lm_head [D, V] (embed.T when tied)
    padded with zero columns to whole tiles, and the per-layer tables of each role's kind
    and row (`mk.kinds.layers.layer_tables`)."""
    V, Vp = config.vocab, padded_vocab(config, block)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    if isinstance(head, quant.QuantWeight):
        head = quant.pad_columns(head, Vp - V)
    else:
        head = jnp.pad(head, ((0, 0), (0, Vp - V)))

    def norm(name):  # RMSNorm scales by norm_offset + weight (Qwen3.5: 1 + w): added here
        return params[name].astype(jnp.float32) + config.norm_offset

    kinds = layer_kinds(config)
    mixers = [kind_at(kinds, "mixer", layer) for layer in range(config.layers)]
    ones = jnp.ones((config.head_dim,), jnp.float32)
    qk = [jnp.stack([norm(n)[row] if n in kind.weights("vector") else ones
                     for kind, row in mixers]) for n in ("q_norm", "k_norm")]
    weights = {"embed": params["embed"], "lm_head": head}
    for kind in kinds:
        weights |= kind.prepare(params)
    weights = ring_layout(weights, model_stream(config, block, 1, quant.formats_of(params)))
    return weights | dict(
        norms=jnp.stack([norm("attn_norm"), norm("mlp_norm")], 1),
        qk_norms=jnp.stack(qk, 1),
        final_norm=norm("final_norm")[None],
        **{n: jnp.asarray(t) for n, t in layer_tables(config).items()})


def _step(plan: DecodePlan, inputs, outputs, scratch) -> Step:
    """The `Step` the kinds' code acts on: a layer's row in a kind's stacked weights and
    whether it is of that kind come from the per-layer tables, unless every layer of the
    kind's role is of that kind (its row is then the layer)."""
    kinds = plan.kinds

    def row(kind):  # a role held by one kind (the stream kind's: always) has no table
        if len(of_role(kinds, kind.role)) == 1:
            return lambda step: step
        table = inputs[f"{kind.role}_row"]
        return lambda step: table[step]

    def on(kind):
        ours = of_role(kinds, kind.role)
        if len(ours) == 1:
            return None
        table = inputs[f"{kind.role}_kind"]
        return lambda step: table[step] == ours.index(kind)

    return Step(plan.local, plan.block, plan.batch, plan.rows, plan.tp,
                SimpleNamespace(**scratch["layer"]), inputs, outputs, row=row, on=on,
                groups=scratch, prime_next=True, collective=plan.collective)


def megakernel_kernel(inputs, outputs, *, plan: DecodePlan, taps: bool, **scratch):
    """One decode step. inputs (`INPUT_SPACES`): positions [B], the per-layer tables
    (`mk.kinds.layers.layer_tables`), x [M, D] f32 (the embedded tokens), final_norm
    [1, D], norms [L, 2, D] (attn, mlp), qk_norms [L, 2, H] f32 (and the kinds'
    `Kind.vectors`, [L, 2, width] each: `plan.vectors`), the kinds' weights
    (`prepare`: the ring's in stream order, e.g. wq [L, tiles, tile_rows, tile_cols], the
    experts' [Lm, E, tiles, ...], lm_head [tiles, tile_rows, tile_cols] of [D, Vp]; the
    DMA'd ones whole), the caches [L, B, K, S, H] (MLA: latent_cache [La, B, 1, S, W]);
    outputs: next_tokens [M, 1] int32, logits [M, Vp] f32, the caches (aliased), with taps
    taps [L, 2, M, D] f32; scratch: `plan.scratch()`."""
    config, tp, kinds = plan.local, plan.tp, plan.kinds
    k = _step(plan, inputs, outputs, scratch)
    s, vectors = k.s, scratch["vectors"]
    if tp > 1:
        reduce_scratch = CollectiveScratch(**scratch["all_reduce"])
        argmax_scratch = CollectiveScratch(**scratch["argmax"])
    vector_copies = functools.partial(_vector_copies, plan, inputs, vectors)
    start_vectors = functools.partial(_start_vectors, plan, inputs, vectors)
    fetch = {name: f for kind in kinds for name, f in kind.fetch(k).items()}
    fetch["lm_head"] = lambda step: (inputs["lm_head"], None)
    for kind in kinds:
        kind.setup(k)
    k.ring = ring = Ring.in_scratch(plan.stream, fetch, s, s.sems, config.dtype)
    # Named scopes mark the kernel's phases: trace markers on a TPU compiled with
    # --xla_enable_custom_call_region_trace=true (mk.measure.profiling), nothing otherwise.
    with jax.named_scope("prime"):
        ring.prime()
    barrier(tp, algorithm=plan.collective)  # every peer is in the kernel before the first
    #                                          all-reduce writes to it
    final_norm = pltpu.make_async_copy(inputs["final_norm"], vectors["final_norm"],
                                       vectors["final_sem"].at[0])
    start_dma(final_norm, "final_norm", config.hidden * 4)  # waited before the lm_head
    start_vectors(0)
    for kind in kinds:  # e.g. the first linear layer's loads, the first full layer's KV
        kind.start(k)  # tiles: each such layer issues the next one's

    def one_layer(layer, x):
        for copy, _ in vector_copies(layer):
            copy.wait()

        @pl.when(layer + 1 < config.layers)
        def prefetch_next_layer_vectors():
            start_vectors(layer + 1)

        norms, qk = vectors["norms"][layer % 2], vectors["qk_norms"][layer % 2]
        k.step, k.x, k.norms = layer, x, (norms[0:1], norms[1:2], qk[0:1], qk[1:2])
        k.vectors = {n: vectors[n][layer % 2] for n in plan.vectors[2:]}
        x_out = layer_body(k, kinds, all_reduce=None if tp == 1 else (  # slot j: the
            lambda value, j: all_reduce_body(value, reduce_scratch, n=tp, slot=j,  # MLP's 1
                                             algorithm=plan.collective)))
        if taps:
            outputs["taps"][layer, 0] = k.x_attn
            outputs["taps"][layer, 1] = x_out
        return x_out

    with jax.named_scope("layers"):
        x = lax.fori_loop(0, config.layers, one_layer, inputs["x"][...])
    stream = stream_kind(kinds)
    if stream is not None:  # attention residuals: the lm_head reads the blocks' mix
        x = stream.mix(k, x, "output")
    with jax.named_scope("lm_head"):
        final_norm.wait()
        s.h[...] = rms_norm(x, vectors["final_norm"][...], config.rms_eps,
                            width=config.norm_width).astype(s.h.dtype)
        ring.matmul("lm_head", s.h, outputs["logits"], layer=config.layers)
    for kind in reversed(kinds):  # e.g. the last write-backs and row states
        kind.finish(k)
    _greedy_tokens(plan, outputs, None if tp == 1 else argmax_scratch)


# Layer l's norm vectors live in slot l % 2. Layer l + 1's are issued at layer l's start
# into the other slot, which layer l - 1 read and no longer needs, and waited for at layer
# l + 1's start: two slots suffice.
def _vector_copies(plan: DecodePlan, inputs, vectors, layer) -> list:
    """The DMAs of layer `layer`'s norm vectors (`plan.vectors`) into VMEM slot layer % 2,
    each with its name: [(copy, name)]."""
    slot = layer % 2
    return [(pltpu.make_async_copy(inputs[n].at[layer], vectors[n].at[slot],
                                   vectors["sems"].at[slot, i]), n)
            for i, n in enumerate(plan.vectors)]


def _start_vectors(plan: DecodePlan, inputs, vectors, layer) -> None:
    """Issue layer `layer`'s norm-vector DMAs (`_vector_copies`), each logged with its
    float32 bytes."""
    for copy, name in _vector_copies(plan, inputs, vectors, layer):
        start_dma(copy, name, vectors[name].shape[1] * vectors[name].shape[2] * 4)


def _greedy_tokens(plan: DecodePlan, outputs, argmax_scratch) -> None:
    """next_tokens [M, 1] = the argmax of the logits over the real vocab columns (not the
    padding), ties to the lowest id; at tp > 1 across the vocab shards, on every device
    (`argmax_scratch`; None at tp = 1)."""
    config, tp = plan.local, plan.tp
    logits = outputs["logits"][...]
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    first_id = 0 if tp == 1 else lax.axis_index(AXIS) * config.vocab  # this vocab shard's
    outputs["next_tokens"][...] = argmax_body(  # ties to the lowest id, on every device
        logits, first_id, argmax_scratch, n=tp,
        valid=vocab < config.vocab, algorithm=plan.collective)  # not the padding columns


def decode_step(plan: DecodePlan, weights, cache, tokens, positions, *, taps: bool = False,
                row_states: bool = False, donate: bool = False):
    """One decode step of `plan` in one kernel: tokens [B, T] at positions [B] -> (next
    tokens [B, T] int32 (greedy, ties to the lowest id), logits [B, T, V] float32, cache).
    `weights` from `prepare(plan, params)`, the same plan (its block, formats and feeds);
    the cache's capacity is the plan's context, the tokens its [B, T] (ValueError
    otherwise). donate=True updates `cache` in place (`step_in_place`: the caller's cache
    is spent); by default XLA first copies it, a whole cache's bytes read and written each
    step. A hybrid's cache is a `mk.model.cache.HybridCache`; with `row_states=True` the step
    also returns its linear layers' states after each row (`mk.model.cache.LinearRows`, for
    `mk.model.cache.rollback`), as `mk.model.reference.decode_step` does.

    With `taps=True` also returns {"attn", "mlp"}: the residual stream [L, B, T, D] after
    each layer's attention and MLP blocks, as `mk.model.reference.decode_step(..., taps=True)`.
    """
    if not isinstance(plan, DecodePlan):
        raise ValueError(f"plan is a {type(plan).__name__}; it must be a DecodePlan "
                         "(`DecodePlan.make(config, batch=, rows=, context=)`)")
    if plan.tp != 1:
        raise NotImplementedError(f"plan.tp={plan.tp}: a tensor-parallel step is "
                                  "`mk.step.tensor_parallel.decode_step`'s")
    config = plan.config
    if row_states and not has_states(cache):
        raise ValueError(f"row_states=True needs a hybrid model; {config.name} has no "
                         "linear layers")
    tokens, positions = decode_checks.validate_step(config, cache, tokens, positions)
    check_step(plan, weights, cache.capacity, tokens.shape)
    backends.check_active()
    out = (step_in_place if donate else traced_step)(plan, weights, cache, tokens, positions,
                                                     taps=taps)
    if has_states(cache) and not row_states:
        out = out[:3] + out[4:]
    return out


def check_step(plan: DecodePlan, weights, capacity: int, shape) -> None:
    """Raise ValueError unless a step of `plan` fits its inputs: a cache of `capacity`
    positions (the plan's context), tokens of `shape` (its [B, T]) and `weights` packed in
    the formats the plan streams packed (`mk.step.plan.packed_formats`, what `prepare`
    laid out)."""
    if capacity != plan.context:
        raise ValueError(f"the cache's capacity {capacity} is not the plan's "
                         f"context={plan.context}")
    if tuple(shape) != (plan.batch, plan.rows):
        raise ValueError(f"tokens shape {tuple(shape)} is not the plan's [B={plan.batch}, "
                         f"T={plan.rows}]")
    packed, theirs = (packed_formats(plan.config, formats) for formats in (
        dict(plan.formats), quant.formats_of(weights)))
    if theirs != packed:
        raise ValueError(f"weights streamed packed in {theirs}, the plan's in {packed}: "
                         "prepare them for this plan (`prepare(plan, params)`)")


def first_divergence(plan: DecodePlan, params, cache: reference.KVCache, tokens,
                     positions, *, stop_after=None, rtol: float = 1e-2,
                     backend: str = "auto", weights=None):
    """Run the reference and the megakernel on one step of `plan` and compare the residual
    stream op by op, in execution order, up to `stop_after=(layer, op)` (op in TAPS;
    default: the last layer's MLP). `weights`: the megakernel's own (default
    `prepare(plan, params)`), to test a preparation or a planted bug. Returns (the first
    (layer, op) whose max |mk - ref| exceeds rtol times the reference's max |x| there, or
    None; a list of dicts, one per compared op, with layer, op, max_abs_err, scale).

    Both sides round to bf16 in different places, so the tolerance is relative to the
    activations' scale; a wrong weight, mask or position moves the error by orders of
    magnitude more (tests/test_megakernel.py plants one)."""
    config = plan.config
    layer, op = (config.layers - 1, TAPS[-1]) if stop_after is None else stop_after
    if not (isinstance(layer, int) and 0 <= layer < config.layers and op in TAPS):
        raise ValueError(f"stop_after={stop_after!r} must be (layer, op) with 0 <= layer < "
                         f"layers={config.layers} and op in {TAPS}")
    _, _, want = reference.decode_step(config, quant.dequantize(params, feeds=dict(
        plan.feeds)), cache, tokens, positions, taps=True)
    with backends.use(backend):
        weights = prepare(plan, params) if weights is None else weights
        *_, got = decode_step(plan, weights, cache, tokens, positions, taps=True)
    report = []
    for layer_i in range(layer + 1):
        for op_i in TAPS[:TAPS.index(op) + 1] if layer_i == layer else TAPS:
            ref = want[op_i][layer_i]
            err = float(jnp.abs(got[op_i][layer_i] - ref).max())
            report.append(dict(layer=layer_i, op=op_i, max_abs_err=err,
                               scale=float(jnp.abs(ref).max())))
    first = next(((r["layer"], r["op"]) for r in report
                  if not r["max_abs_err"] <= rtol * r["scale"]), None)
    return first, report


@functools.partial(jax.jit, static_argnames=("plan", "taps"))
def traced_step(plan: DecodePlan, weights, cache, tokens, positions, taps: bool = False):
    """`decode_step` as traced, with no host-side checks (callers validate first): what
    `generate`'s device loop, `mk.step.tensor_parallel` (plan.tp > 1, per device inside
    shard_map) and `mk.measure.tpu` run. Returns (next tokens, logits, cache), then for a
    hybrid the `LinearRows`, then with taps the taps."""
    config, B, T, M = plan.local, plan.batch, plan.rows, plan.M
    if tokens.shape != (B, T):
        raise ValueError(f"tokens {tokens.shape} are not the plan's [B={B}, T={T}]")
    D, L = config.hidden, config.layers
    weight_names = operands(config)
    inputs = {n: weights[n] for n in ("final_norm", "norms", "qk_norms", "lm_head",
                                      *TABLES, *weight_names)}  # kinds' vectors: operands
    kinds = plan.kinds
    caches = {n: a for kind in kinds for n, a in kind.cache_operands(cache).items()}
    inputs |= dict(positions=positions, **caches,
                   x=weights["embed"][tokens].reshape(M, D).astype(jnp.float32))
    outputs = dict(next_tokens=jax.ShapeDtypeStruct((M, 1), jnp.int32),
                   logits=jax.ShapeDtypeStruct((M, plan.vocab), jnp.float32), **caches)
    for kind in kinds:  # e.g. a linear layer's states in, its states after every row out
        states_in, states_out = kind.state_operands(cache, B, T)
        inputs |= states_in
        outputs |= states_out
    if taps:
        outputs["taps"] = jax.ShapeDtypeStruct((L, 2, M, D), jnp.float32)
    streamed = [inputs[n] for n in (*weight_names, "lm_head")]
    state_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(
        [inputs.get(n) for n in STATE_INPUTS] + [outputs.get(n) for n in STATE_OUTPUTS]))
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(streamed))
    elements = sum(math.prod(w.shape) for w in streamed)  # a QuantWeight's logical shape
    specs = memory_specs(INPUT_SPACES | {n: pl.ANY for n in weight_names})
    out = pl.pallas_call(
        sequenced(functools.partial(megakernel_kernel, plan=plan, taps=taps)),
        out_shape=outputs,
        in_specs=({n: jax.tree.map(lambda _, n=n: specs[n], inputs[n]) for n in inputs},),
        out_specs=memory_specs({n: OUTPUT_SPACES[n] for n in outputs}),
        scratch_shapes=plan.scratch(),
        input_output_aliases=aliases(inputs, outputs, tuple(caches)),
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=plan.vmem_limit(),
            **({} if plan.tp == 1 else dict(collective_id=COLLECTIVE_IDS["megakernel"],
                                            has_side_effects=True))),
        name="mk_megakernel",
        cost_estimate=pl.CostEstimate(  # every expert counted: an upper bound for MoE
            flops=2 * M * elements, transcendentals=0,
            bytes_accessed=weight_bytes + state_bytes),
    )(inputs)
    fields = {f: a for kind in kinds for f, a in kind.cache_fields(out).items()}
    result = (out["next_tokens"].reshape(B, T),
              out["logits"][:, :config.vocab].reshape(B, T, -1), cache._replace(**fields))
    if STATE_OUTPUTS[0] in out:  # the linear layers' states after each row
        result += (reference.LinearRows(*(out[n] for n in STATE_OUTPUTS)),)
    if taps:
        residual = out["taps"].reshape(L, 2, B, T, D)
        result += ({op: residual[:, i] for i, op in enumerate(TAPS)},)
    return result


def greedy_steps(step, cache, token, position, steps: int):
    """`steps` greedy decode steps as one device-side loop (a `lax.scan`), from token [B]
    (or tokens [B, T]) at position [B]: step(cache, tokens [B, T], positions [B]) ->
    (next tokens [B, T], cache) is one kernel call, and its T next tokens are the next
    step's rows at T positions on. Returns (tokens [B, steps * T], cache). With T = 1 this is
    greedy decoding; with T > 1 each step verifies the last step's predictions as if all
    were accepted (a timing loop of T-row steps: `mk.measure.measure`'s device loop of
    verification steps, not speculative decoding). Traced in the caller's jit (one device)
    or inside its shard_map (each device its own shard)."""
    tokens = token[:, None] if token.ndim == 1 else token
    T = tokens.shape[1]

    def body(carry, _):
        cache, tokens, position = carry
        nxt, cache = step(cache, tokens, position)
        return (cache, nxt, position + T), nxt

    (cache, _, _), out = lax.scan(body, (cache, tokens, position), None, length=steps)
    return out.transpose(1, 0, 2).reshape(tokens.shape[0], steps * T), cache


@functools.partial(jax.jit, static_argnames=("plan", "taps"), donate_argnames="cache")
def step_in_place(plan: DecodePlan, weights, cache, tokens, positions, taps: bool = False):
    """`traced_step` with the cache donated: the kernel's in-place cache update stays in
    place (no copy of the cache before the call), as a serving loop steps."""
    return traced_step(plan, weights, cache, tokens, positions, taps=taps)


@functools.partial(jax.jit, static_argnames=("plan", "steps"), donate_argnames="cache")
def device_loop(plan: DecodePlan, weights, cache, token, position, steps: int):
    """`greedy_steps` of the megakernel on one device, token [B] (T = 1) or tokens
    [B, plan.rows]. The cache is donated (updated in place: HBM holds it once, what
    `mk.measure.tpu` compiles and `DecodePlan.fits` counts)."""
    def step(cache, tokens, positions):
        nxt, _, cache, *_ = traced_step(plan, weights, cache, tokens, positions)
        return nxt, cache

    return greedy_steps(step, cache, token, position, steps)


def greedy_loop(dispatch, config: ModelConfig, values, prompt, S: int, steps: int,
                steps_per_call: int, *, progress: bool, desc: str,
                shard=lambda cache: cache, copies: tuple[int, ...] = (),
                kernels=None) -> jax.Array:
    """The host side of greedy decoding with the kernel, on one device or many: the
    reference prefills `prompt` [B, P] on `values` (plain or quantised params) into a
    cache of capacity S (`shard` lays it out for the devices) and picks the first token;
    then
    `dispatch(cache, token [B], position [B], n) -> (tokens [*copies, B, n], cache)` runs
    n = steps_per_call steps per host dispatch (fewer at the end) under a `progress_bar`.
    Returns the `steps` tokens [*copies, B, steps]: `copies` are leading axes (the tp
    devices' copies; the prefill's token is on each, and the next dispatch starts from
    the first copy's last token). kernels: a context (`mk.kernels.backend.use(...)`) entered
    after the prefill, around the dispatches: the prefill then runs outside it, the same
    compiled program as `mk.model.reference`'s own calls (jit keys a trace on the interpret-mode
    context, so a prefill inside it compiled the reference again)."""
    logits, cache = reference.prefill(config, values, prompt, max_context=S, quantised=True)
    token = reference.greedy(logits[:, -1])
    cache = shard(cache)
    B = prompt.shape[0]
    out, done = [jnp.broadcast_to(token[:, None], (*copies, B, 1))], 1
    position = jnp.full((B,), prompt.shape[1], jnp.int32)
    with kernels or contextlib.nullcontext(), progress_bar(steps, progress, desc) as bar:
        while done < steps:
            n = min(steps_per_call, steps - done)
            tokens, cache = dispatch(cache, token, position, n)
            out.append(tokens)
            token, position, done = tokens[(0,) * len(copies)][:, -1], position + n, done + n
            bar.update(n)
    return jnp.concatenate(out, axis=-1)


# `generate`'s steps per host dispatch on a TPU when none is asked for: on the v5e one
# dispatched step cost 0.45 ms more than a device loop's (issue 60), paid once per loop.
DEVICE_LOOP_STEPS = 8


def check_generate(config: ModelConfig, prompt, steps: int, steps_per_call: int | None,
                   max_context: int | None, hardware: bool | None = None):
    """`mk.model.decode_checks.check_generate` and steps_per_call -> (prompt as int32, the cache
    capacity S, steps, steps_per_call as ints). steps_per_call None: DEVICE_LOOP_STEPS on
    `hardware` (None: whether kernels built now run on a TPU, not in interpret mode), else
    1 (in interpret mode each loop length compiles a program of its own)."""
    prompt, S, steps = decode_checks.check_generate(config, prompt, steps, max_context)
    default_kv_tile(S, "max_context")  # the kernel's KV tiles must divide the cache
    if steps_per_call is None:
        if hardware is None:
            hardware = backends.on_tpu() and not backends.interpreting()
        return prompt, S, steps, DEVICE_LOOP_STEPS if hardware else 1
    return prompt, S, steps, positive_int("steps_per_call", steps_per_call)


def progress_bar(steps: int, progress: bool, desc: str = "megakernel") -> tqdm:
    """The bar of a `generate` loop: `steps` tokens per sequence, the first (from the
    prefill) already done; the loop updates it by n after each dispatch of n steps.
    tqdm.auto draws a widget in Jupyter, text on stderr elsewhere; progress=False draws
    nothing."""
    if not isinstance(progress, bool):
        raise ValueError(f"progress={progress!r} must be True or False")
    return tqdm(total=steps, initial=1, desc=desc, unit="step", disable=not progress)


def generate(config: ModelConfig, params, prompt, steps: int, *, backend: str = "auto",
             block: BlockSizes | None = None, max_context: int | None = None,
             steps_per_call: int | None = None, progress: bool = False, feeds=None,
             donate: bool = False) -> jax.Array:
    """Greedy decoding with the megakernel: prompt [B, P] -> the next `steps` tokens
    [B, steps] int32, the same contract as `mk.model.reference.generate`; feeds: the packed
    groups' MXU feeds (`DecodePlan.make(feeds=)`). The prompt is prefilled by the XLA
    reference on the params as they are (quantised ones a layer at a time); then `prepare`
    lays them out (donate=True gives them up, so the device never holds both: what lets a
    model near the chip's size run), and every later token comes from one megakernel
    call, `steps_per_call` of them per host dispatch (a device-side loop; default
    `DEVICE_LOOP_STEPS` on a TPU, 1 in interpret mode). On a TPU the whole run's peak is
    checked first (`check_fits`). progress=True shows a `progress_bar` (interpret-mode
    calls take seconds each)."""
    prompt, S, steps, steps_per_call = check_generate(
        config, prompt, steps, steps_per_call, max_context,
        hardware=backends.resolve(backend) == "hardware")
    plan = DecodePlan.make(config, batch=prompt.shape[0], context=S, block=block,
                     formats=quant.formats_of(params), feeds=feeds)
    check_weights(plan, params)
    check_fits(plan, prompt.shape[1], donate=donate)
    weights = []  # prepared after the prefill, which reads the params as they are

    def dispatch(cache, token, position, n):
        if not weights:
            weights.append(prepare(plan, params, donate=donate))
        return device_loop(plan, weights[0], cache, token, position, n)

    kernels = backends.use(backends.resolve(backend))  # a bad name raises before the prefill
    return greedy_loop(dispatch, config, params, prompt, S, steps, steps_per_call,
                       progress=progress, desc="megakernel", kernels=kernels)


def check_fits(plan: DecodePlan, prompt: int, *, donate: bool, device=None) -> None:
    """On a TPU (`device`, default JAX's first), raise ValueError before anything is
    allocated unless a `generate` of `plan` with a `prompt`-token prompt fits its HBM
    (`DecodePlan.fits(chip, prompt=, donate=)`: "needs X GiB on <chip>, has Y" and the
    biggest parts). Elsewhere (the CPU) nothing is checked."""
    device = device or jax.devices()[0]
    if device.platform != "tpu":
        return
    fit = plan.fits(chip_of(device.device_kind), prompt=prompt, donate=donate)
    if fit.hbm_bytes > fit.hbm_limit_bytes:
        kept = plan.fits(fit.chip, prompt=prompt, donate=True)
        hint = ("; donate=True (the params given up as they are laid out) would fit"
                if not donate and kept.hbm_bytes <= kept.hbm_limit_bytes else "")
        raise ValueError(fit.error + hint)
