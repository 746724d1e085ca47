"""Stage 05, one fused layer: every op of a decoder layer in one pallas_call, one ring.

prologue -> decode attention -> output projection + residual -> norm -> SwiGLU or MoE ->
residual, with all the layer's weights ONE `TileStream`, so the ring never drains between
sub-blocks (expert tiles wait for the router). A layer is its kinds (`mk.kinds`: a token
mixer and an MLP): `layer_body` runs `LAYER_PHASES` in order and, in each, every kind's
part, knowing no kind itself.

Here: `model_block` (the tiling a model's matrices share), `layer_buffers` /
`layer_scratch` (the VMEM and scratch of a kernel holding some kinds, by group and
name), `residual`, `layer_body` (the in-kernel layer the megakernel loops over), and the
stage wrapper `one_layer` with its `one_layer_buffers` (Qwen3's layer; its weights may be
`mk.model.quant.QuantWeight`s; not a model with attention residuals). Not here: the kinds' code
(`mk.kinds`), the layer loop, the lm_head and the cross-layer ring (`mk.step.megakernel`).
More: docs/design/mk.step.one_layer.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model import quant
from mk.model.config import ModelConfig
from mk.kinds.attention.attention_prologue import check_layer_inputs
from mk.kernels.common import (OTHERS_OVER_REPEAT_BYTES, REPEAT_TILE_BYTES, SLOTS, TILE_BYTES,
                               BlockSizes, Buffer, aliases, default_block, memory_specs,
                               vmem_limit_bytes)
from mk.kernels.ring import Ring, plain_ring, ring_buffers
from mk.kernels.stream import Repeat, TileStream
from mk.kernels.weight_streaming import ring_weights, weight_stream
from mk.kinds.base import LAYER_PHASES, Kind, Step
from mk.kinds.layers import kinds_at, layer_kinds, layer_matrices, stream_kind
from mk.model.ops import rms_norm
from mk.model.decode_checks import check_positions


def model_block(config: ModelConfig, *, context: int | None = None, slots: int = SLOTS,
                formats=None, feeds=None) -> BlockSizes:
    """The default tiling of a whole-model kernel of `config` (or of one of its layers):
    `default_block` over every ring matrix of its layers (`layer_matrices`) and the
    lm_head's D rows (its columns are padded to whole tiles), the weights of quantised
    `formats` ({family: mk.model.quant scheme}) never transposed, and those fed bf16 (`feeds`,
    {family: feed} from `mk.model.unpack.choose_feeds`; default bf16) dequantised whole in VMEM
    (at most QUANT_TILE_ELEMENTS a tile, `default_block`).

    The expert slots' matrices (a `Repeat`) may take tiles of their own (`BlockSizes.tiles`:
    ring buffers of their own shape on the one slot index): an expert's matrices are small
    and narrow (qwen3-30b-a3b's [2048, 768]), and one tile cutting them and every other
    matrix is small and narrow too (2048 x 256 there: its loop issues in 1.2x its DMA at
    1.03 G bundles/s on TPU7x). So each Repeat's matrix takes the largest tile of at most
    REPEAT_TILE_BYTES cutting it alone (2048 x 768 there: 0.81x; a packed expert, never
    transposed, its own shape: Kimi K3's FP4 experts on a TP32 shard fed fp8, [7168, 128]
    gate and up and [128, 7168] down, one tile each), and the other matrices
    `default_block`'s tile among themselves, shrunk where needed to move no more than
    OTHERS_OVER_REPEAT_BYTES (2) x the bytes of the smallest of those: the ring's one
    slot index keeps the bytes in flight over a run of expert tiles near those over the
    others (a run of small packed tiles beside much bigger ones would need a ring deeper
    than VMEM holds), and twice, not once, spreads a trip's fixed cost over twice the
    weights (TPU7x's dumps, Kimi K3's TP32 plain tiles 1792 x 128 -> 3584 x 128: 117-190
    -> 195-306 bundles a trip, 0.92-1.48x -> 0.76-1.19x their DMA at 1.03 G bundles/s; its
    ring 19 -> 18 slots, VMEM 48 -> 54 of 64 MiB). One tile for all where the others
    have no tile that small, or where no part's tiles would grow."""
    matrices = layer_matrices(layer_kinds(config), 1)
    itemsize, schemes = jnp.dtype(config.dtype).itemsize, quant.schemes_of(formats)
    fed = quant.schemes_of(feeds)
    common = dict(context=context, slots=slots, itemsize=itemsize, quantised=tuple(schemes),
                  dequantised=tuple(n for n in schemes if fed.get(n, "bf16") == "bf16"))
    one = default_block(matrices, padded_rows=(config.hidden,), **common)
    repeats = [m for m in matrices if isinstance(m, Repeat)]
    rest = [m for m in matrices if not isinstance(m, Repeat)]
    if not repeats or not rest:
        return one

    def tile_bytes(b: BlockSizes, name) -> int:  # what a tile of `name` moves
        return (quant.tile_bytes(schemes[name], b.tile_rows, b.tile_cols) if name in schemes
                else b.tile_rows * b.tile_cols * itemsize)

    def elements(b: BlockSizes) -> int:
        return b.tile_rows * b.tile_cols

    try:
        own = {name: default_block([(name, k, n)], most_bytes=REPEAT_TILE_BYTES, **common)
               for r in repeats for name, k, n in r.matrices}
        smallest = min(tile_bytes(b, name) for name, b in own.items())
        block = default_block(rest, padded_rows=(config.hidden,),
                              most_bytes=min(OTHERS_OVER_REPEAT_BYTES * smallest, TILE_BYTES),
                              **common)
    except ValueError:  # no tile cuts a part alone, or the others none that small
        return one
    if max(map(elements, [block, *own.values()])) <= elements(one):
        return one  # no part's tiles grow: one ring buffer, not several
    return dataclasses.replace(block, tiles=tuple(
        (name, (b.tile_rows, b.tile_cols)) for name, b in own.items()
        if (b.tile_rows, b.tile_cols) != (block.tile_rows, block.tile_cols)))


def layer_buffers(config: ModelConfig, kinds, batch: int, rows: int, block: BlockSizes,
                  ring: list[Buffer] | None = None) -> list[Buffer]:
    """Every VMEM buffer of `layer_body` holding `kinds`: the ring's slots (`ring`, the
    `mk.kernels.ring.ring_buffers` of the kernel's stream; default one plain ring of
    config.dtype), the normed rows h, the blocks' outputs (group "layer": attributes of
    the layer scratch `Step.s`) and each kind's own (`Kind.buffers`, in their groups)."""
    M, D = batch * rows, config.hidden
    if ring is None:
        ring = [plain_ring(block, config.dtype)]
    buffers = [*ring, Buffer("h", (M, D), config.dtype), Buffer("attn_out", (M, D), "float32"),
               Buffer("mlp_out", (M, D), "float32")]
    return buffers + [b for kind in kinds for b in kind.buffers(batch, rows, block)]


def layer_scratch(kinds, buffers, batch: int, rows: int, block: BlockSizes) -> dict:
    """The Pallas scratch of a kernel holding `kinds` by group and name: its non-operand
    `buffers` in VMEM (a name loses its "<group>." prefix), the ring's semaphores (layer
    group "sems") and each kind's semaphores and SMEM (`Kind.scratch`); a name allocated
    twice raises ValueError naming it."""
    groups: dict = {}
    for b in buffers:
        if b.group != "operand":
            groups.setdefault(b.group, {})[b.name.removeprefix(b.group + ".")] = \
                pltpu.VMEM(b.shape, b.dtype)
    groups["layer"]["sems"] = pltpu.SemaphoreType.DMA((block.slots,))
    for kind in kinds:
        for group, extra in kind.scratch(batch, rows, block).items():
            taken = sorted(set(extra) & set(groups.setdefault(group, {})))
            if taken:  # one name, two allocations: the kernel would index only one
                raise ValueError(f"layer kind {kind.name}: scratch {group}.{taken} is "
                                 "already allocated (a buffer or another kind's)")
            groups[group] |= extra
    return groups


def one_layer_buffers(config: ModelConfig, kinds, batch: int, rows: int, block: BlockSizes,
                      formats=None) -> list[Buffer]:
    """Every VMEM buffer of the stage-05 kernel holding `kinds`: its operands x and x_out
    and `layer_buffers` (the ring's slots for the weights' `formats`, {family: mk.model.quant
    scheme})."""
    M, D = batch * rows, config.hidden
    ring = ring_buffers(weight_stream(block, layer_matrices(kinds, M), formats),
                        config.dtype)
    return ([Buffer("x", (M, D), "float32", "operand"),
             Buffer("x_out", (M, D), "float32", "operand")]
            + layer_buffers(config, kinds, batch, rows, block, ring=ring))


def residual(x, block_out):
    """The residual stream after a block: its input x plus the block's output (both [M, D]
    f32). A function of its own so the course can plant a wrong one (`mk.course.course`)."""
    return x + block_out


def _when(flag, body) -> None:
    """body() where the traced `flag` holds (always when flag is None)."""
    if flag is None:
        body()
    else:
        pl.when(flag)(body)


def layer_body(k: Step, kinds, *, all_reduce=None):
    """One decoder layer inside a kernel: returns the new residual x [M, D] f32.

    k: the step (`mk.kinds.base.Step`), with this layer's stream index k.step, residual
    stream k.x and norms k.norms set; kinds: the kinds the kernel holds (`mk.kinds`), each
    run where the layer is of it (`Kind.begin` at the start, `Kind.run` in each of its
    `phases`) and its region of the stream skipped where it is not (in its
    `stream_phase`). The phases run in `LAYER_PHASES`' order, each under a named scope (the
    profiler's markers); the simulator replays the same list. all_reduce(value, j): the
    tensor-parallel sum over devices of the attention (j=0) and MLP (j=1) outputs.

    x is the residual stream: plain (x + each block's output, `residual`), or where the
    kinds hold a stream kind (`stream_kind`: attention residuals) the current block's
    partial sum, the mixer and the MLP reading its mixes (`ResLayer.mix`: the mixer's as
    k.x, set here) and the mixer's output added by it (`ResLayer.add`). k.x_attn: the
    stream after the mixer (the taps').
    """
    s, x = k.s, k.x
    mlp_norm = k.norms[1]
    stream = stream_kind(kinds)
    if stream is not None:
        k.x = stream.mix(k, x, "attn")  # what the mixers' prologues RMS-norm
    for kind in kinds:
        if type(kind).begin is not Kind.begin:
            _when(k.here(kind), lambda kind=kind: kind.begin(k))
    for name in LAYER_PHASES:
        with jax.named_scope(name):
            for kind in kinds:
                on = k.here(kind)
                if name == kind.stream_phase and on is not None:  # not this layer's kind
                    _when(~on, lambda kind=kind: k.ring.skip(*k.ring.region(k.step,
                                                                             *kind.region())))
                if name in kind.phases:
                    _when(on, lambda kind=kind, name=name: kind.run(k, name))
            if name == "attn_all_reduce" and all_reduce is not None:  # tensor parallel:
                s.attn_out[...] = all_reduce(s.attn_out[...], 0)  # wo's sums are partial
            elif name == "mlp_norm":
                if stream is None:
                    x = residual(x, s.attn_out[...])
                    h = x
                else:
                    x = stream.add(k, x, s.attn_out[...])
                    h = stream.mix(k, x, "mlp")
                k.x_attn = x
                s.h[...] = rms_norm(h, mlp_norm, k.config.rms_eps,
                                    width=k.config.norm_width).astype(s.h.dtype)
            elif name == "mlp_all_reduce" and all_reduce is not None:
                s.mlp_out[...] = all_reduce(s.mlp_out[...], 1)
            elif name == "residual":
                x = residual(x, s.mlp_out[...])
    return x


def one_layer_kernel(inputs, outputs, *, config: ModelConfig, kinds, stream: TileStream,
                     block: BlockSizes, batch: int, rows: int, **scratch):
    """inputs: index [2] int32 (layer, its row in its MLP kind's stacked weights),
    positions [B], x [M, D] f32, norms [2, D] f32 (attn, mlp), qk_norms [2, H] f32 (ones
    without QK-norm), the kinds' weights, the caches; outputs: x_out [M, D] f32 and the
    caches (aliased); scratch: `layer_scratch` by group."""
    index = inputs["index"]
    k = Step(config, block, batch, rows, 1, SimpleNamespace(**scratch["layer"]), inputs,
             outputs, row=lambda kind: lambda step: index[1 if kind.role == "mlp" else 0],
             on=lambda kind: None, groups=scratch,
             first_row=index[0])
    fetch = {name: f for kind in kinds for name, f in kind.fetch(k).items()}
    for kind in kinds:
        kind.setup(k)
    k.ring = Ring.in_scratch(stream, fetch, k.s, k.s.sems, config.dtype)
    k.ring.prime()
    for kind in kinds:
        kind.start(k)  # the KV tiles load during the prologue
    norms, qk = inputs["norms"], inputs["qk_norms"]
    k.x = inputs["x"][...]
    k.norms = (norms[0:1, :], norms[1:2, :], qk[0:1, :], qk[1:2, :])
    outputs["x_out"][...] = layer_body(k, kinds)
    for kind in reversed(kinds):
        kind.finish(k)


def one_layer(config: ModelConfig, params, x, k_cache, v_cache, positions, *, layer: int,
              block: BlockSizes | None = None):
    """Decoder layer `layer` in one kernel: x [B, T, D] -> (x [B, T, D] float32, k_cache,
    v_cache [L, B, K, S, H] with this layer's new rows written in place). params' weights
    may be `mk.model.quant.QuantWeight`s (`mk.model.quant.quantize`: one scheme per family),
    streamed packed and dequantised in VMEM to config.dtype."""
    positions = jnp.asarray(positions, jnp.int32)
    B, T, D = check_layer_inputs(config, x, positions, layer)
    M, S = B * T, k_cache.shape[3]
    expected = (config.layers, B, config.kv_heads, S, config.head_dim)
    if k_cache.shape != expected or v_cache.shape != expected:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} must be [L, B, K, S, H]="
                         f"{expected}")
    check_positions(positions, T, S)
    if stream_kind(layer_kinds(config)) is not None:
        raise NotImplementedError(f"{config.name}: one_layer runs one layer of a plain "
                                  "residual stream; attention residuals (residual_block="
                                  f"{config.residual_block}) run in mk.step.megakernel")
    formats = quant.formats_of(params)
    block = block or model_block(config, context=S, formats=formats)
    block.check_context(S)
    kinds = mixer, mlp = kinds_at(config, layer)
    row = mlp.layers.index(layer)
    stream = weight_stream(block, layer_matrices(kinds, M), formats)
    ones = jnp.ones((config.head_dim,), jnp.float32)
    qk = [params[n][layer] if n in mixer.weights("vector") else ones
          for n in ("q_norm", "k_norm")]
    weights, weight_specs = ring_weights(
        {n: w for kind in kinds for n, w in kind.prepare(params).items()}, stream)
    inputs = dict(index=jnp.array([layer, row], jnp.int32), positions=positions,
                  x=x.reshape(M, D).astype(jnp.float32),
                  norms=jnp.stack([params["attn_norm"][layer],
                                   params["mlp_norm"][layer]]).astype(jnp.float32),
                  qk_norms=jnp.stack(qk).astype(jnp.float32),
                  k_cache=k_cache, v_cache=v_cache) | weights
    spaces = dict(index=pltpu.SMEM, positions=pltpu.SMEM, x=pltpu.VMEM, norms=pltpu.VMEM,
                  qk_norms=pltpu.VMEM, k_cache=pl.ANY, v_cache=pl.ANY)
    outputs = dict(x_out=jax.ShapeDtypeStruct((M, D), jnp.float32), k_cache=k_cache,
                   v_cache=v_cache)
    attention = [weights[n] for n in mixer.weights("ring", "dma")]  # one layer's: 1 / L
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(attention)) // config.layers
    elements = sum(math.prod(w.shape[1:]) for w in attention)
    buffers = one_layer_buffers(config, kinds, B, T, block, formats)
    out = pl.pallas_call(
        functools.partial(one_layer_kernel, config=config, kinds=kinds, stream=stream,
                          block=block, batch=B, rows=T),
        out_shape=outputs,
        in_specs=(memory_specs(spaces) | weight_specs,),
        out_specs=memory_specs(dict(x_out=pltpu.VMEM, k_cache=pl.ANY, v_cache=pl.ANY)),
        scratch_shapes=layer_scratch(kinds, buffers, B, T, block),
        input_output_aliases=aliases(inputs, outputs, ("k_cache", "v_cache")),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(buffers)),
        name="mk_one_layer",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * elements, transcendentals=0, bytes_accessed=weight_bytes),
    )(inputs)
    return out["x_out"].reshape(B, T, D), out["k_cache"], out["v_cache"]
