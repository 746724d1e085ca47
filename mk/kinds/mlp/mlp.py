"""Stage 04, the MLP: dense SwiGLU and a Qwen3-MoE block, weights streamed through the ring.

Dense SwiGLU streams gate, up and down through one ring in that order. MoE runs its router
in the kernel and streams only the experts the batch selected: route (vectors), the
selected flags to SMEM by one local DMA, compact the ids into expert slots (scalars),
then stream one `Repeat` of (we_gate, we_up, we_down) per active slot; the ring issues
expert tiles only once the ids are known. Kimi's sigmoid router and shared expert, joined
gate|up tiles (`mk.kinds.mlp.joined_experts`), gpt-oss's biases and clamped SwiGLU, and
quantised expert weights fit the same stream.

Here: the bodies (`swiglu_body`, `moe_body` and its steps `route_experts`,
`select_experts` and `experts_body`; the first, `route_body`, is `mk.kinds.mlp.routing`'s),
their stream segments and Fetch callables, the buffer lists, the MoE layer's small DMAs by
name (`MOE_SMALL_LOADS`, `small_sem`), and the stage wrappers `swiglu` / `moe`. Not here:
the norm before the MLP and the residual add (the layer kernel), expert capacity limits,
Kimi K3's latent MoE (`mk.kinds.mlp.latent_moe`, built from these steps). The four routing
steps, the ring's invariant around routing and each variant:
docs/design/mk.kinds.mlp.mlp.md.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model import quant
from mk.model.config import COMPUTE_DTYPES, MAX_ROWS
from mk.kernels.common import BlockSizes, Buffer, start_dma, vmem_limit_bytes, vmem_scratch
from mk.kinds.mlp.joined_experts import split_gate_up
from mk.kernels.ring import Ring, ring_buffers
from mk.kernels.stream import Repeat, TileStream
from mk.kinds.mlp.routing import Routing, route_body
from mk.kernels.weight_streaming import ring_weights, stage_block, weight_stream
from mk.model.weights import names


# -- Dense SwiGLU --------------------------------------------------------------------------
# The segments of a dense MLP and of a MoE layer's shared expert (gate, up, down), their
# rows of `mk.model.weights` in order.
DENSE_WEIGHTS = names("dense", path="ring")
SHARED_WEIGHTS = names("moe", family="dense_mlp")


def swiglu_segments(D: int, F: int, names=DENSE_WEIGHTS) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of a SwiGLU's ring segments (the dense MLP's, or with
    SHARED_WEIGHTS a shared expert's), in consumption order."""
    return list(zip(names, (D, D, F), (F, F, D)))


def swiglu_fetch(w_gate_hbm, w_up_hbm, w_down_hbm, row, active=None,
                 names=DENSE_WEIGHTS) -> dict:
    """Fetch callables of the SwiGLU segments `names`: `row(layer)` picks the stacked
    weight row; `active(layer)` (optional) switches the segments off, e.g. in a fused
    kernel's MoE layers."""
    def fetch(w_hbm):
        return lambda layer: (w_hbm.at[row(layer)], None if active is None else active(layer))
    return {name: fetch(w) for name, w in zip(names, (w_gate_hbm, w_up_hbm, w_down_hbm))}


def silu_gate(gate, up):
    """SwiGLU's activation of the gate and up projections (f32): silu(gate) * up."""
    return jax.nn.silu(gate) * up


def swiglu_body(ring: Ring, layer, x, gate_vmem, up_vmem, out_ref, names=DENSE_WEIGHTS,
                activation=silu_gate):
    """out_ref [M, D] f32 = down(activation(x @ gate, x @ up)) of x [M, D] (a VMEM ref)
    through the ring's segments `names` (gate, up, down) of `layer`; the activation is
    SwiGLU's (`silu_gate`) or another of the same shape (Kimi K3's SiTU, `mk.model.ops.situ`).

    gate_vmem, up_vmem [M, F] f32 scratch; gate_vmem ends up holding the activation.
    """
    gate, up, down = names
    ring.matmul(gate, x, gate_vmem, layer=layer)
    ring.matmul(up, x, up_vmem, layer=layer)
    gate_vmem[...] = activation(gate_vmem[...], up_vmem[...])
    ring.matmul(down, gate_vmem, out_ref, layer=layer)


def swiglu_buffers(M: int, D: int, F: int, dtype, block: BlockSizes,
                   x_dtype="float32", formats=None) -> list[Buffer]:
    """Every VMEM buffer of `swiglu` (the budget and the scratch come from here); formats:
    {family: mk.model.quant scheme} of quantised weights (the ring's packed slots)."""
    stream = weight_stream(block, swiglu_segments(D, F), formats)
    return _stage_buffers(M, D, dtype, stream, x_dtype) + [
        Buffer("gate", (M, F), "float32"), Buffer("up", (M, F), "float32")]


def _stage_buffers(M: int, D: int, dtype, stream: TileStream, x_dtype) -> list[Buffer]:
    """The operands h and out and the ring's slots of a standalone MLP kernel; dtype: the
    plain weights' (a stream of quantised weights has no plain slots)."""
    return [Buffer("h", (M, D), str(jnp.dtype(x_dtype)), "operand"),
            Buffer("out", (M, D), "float32", "operand"),
            *ring_buffers(stream, str(jnp.dtype(dtype)))]


def _ring(stream: TileStream, fetch: dict, ring_vmem: dict, sems, dtype) -> Ring:
    """The ring of a stage kernel whose slots came by their `vmem_scratch` names
    (`ring_buffers`' names + "_vmem"), multiplying in `dtype`."""
    slots = {name.removesuffix("_vmem"): ref for name, ref in ring_vmem.items()}
    return Ring.in_scratch(stream, fetch, SimpleNamespace(**slots), sems, dtype)


def swiglu_kernel(
    # Inputs
    layer_smem,  # [1] int32: the stacked weight row
    h_vmem,  # [M, D]
    w_gate_hbm,  # [Ld, tiles, tile_rows, tile_cols] weight dtype (`ring_layout`) or
    #              mk.model.quant.QuantWeight (tile-major), in HBM
    w_up_hbm,  # [Ld, tiles, tile_rows, tile_cols]
    w_down_hbm,  # [Ld, tiles, tile_rows, tile_cols]
    # Outputs
    out_vmem,  # [M, D] f32
    *,
    stream: TileStream,
    dtype,  # the compute dtype
    activation=silu_gate,  # of the gate and up projections (`swiglu_body`)
    # Scratch (`vmem_scratch` of `swiglu_buffers`, by name)
    sems,  # DMA semaphores [slots]
    gate_vmem,  # [M, F] f32
    up_vmem,  # [M, F] f32
    **ring_vmem,  # the ring's slots: ring_vmem [slots, tile_rows, tile_cols] weight dtype,
    #               ring_<scheme>_vmem and ring_<scheme>_scales_vmem (`ring_buffers`)
):
    row = layer_smem[0]
    fetch = swiglu_fetch(w_gate_hbm, w_up_hbm, w_down_hbm, lambda layer: row)
    ring = _ring(stream, fetch, ring_vmem, sems, dtype)
    ring.prime()
    swiglu_body(ring, 0, h_vmem, gate_vmem, up_vmem, out_vmem, activation=activation)


def _stacked(w, ndim, name):
    """w (an array or a QuantWeight) with a leading layer axis."""
    if len(w.shape) == ndim:
        return jax.tree.map(lambda a: a[None], w)
    if len(w.shape) != ndim + 1:
        raise ValueError(f"{name} has shape {w.shape}: expected {ndim} dims, or {ndim + 1} "
                         "with a leading layer axis")
    return w


def _check_rows_and_dtype(h, weights, streamed) -> tuple[dict, jnp.dtype]:
    """(formats, compute dtype) of an MLP stage: the `streamed` weights (names) are plain
    (of one dtype with the other weights, one of COMPUTE_DTYPES: the compute dtype) or
    quantised in one format (`mk.model.quant.formats_of`; then the compute dtype is h's)."""
    M = h.shape[0]
    if h.ndim != 2 or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"h shape {h.shape} must be [M, D] with M in [1, {MAX_ROWS}]")
    for name, w in weights.items():
        if isinstance(w, quant.QuantWeight) and name not in streamed:
            raise ValueError(f"{name} is a {w.scheme} QuantWeight: only {streamed} may be "
                             "quantised (mk.model.quant keeps it in config.dtype)")
    formats = quant.formats_of({n: weights[n] for n in streamed})
    dtypes = {name: str(w.dtype) for name, w in weights.items()
              if not isinstance(w, quant.QuantWeight)}
    if formats and str(h.dtype) not in COMPUTE_DTYPES:
        raise ValueError(f"h dtype {h.dtype}: quantised weights are dequantised to h's "
                         f"dtype, which must be one of {COMPUTE_DTYPES}")
    if len(set(dtypes.values())) > 1 or not set(dtypes.values()) <= set(COMPUTE_DTYPES):
        raise ValueError(f"weight dtypes {dtypes} must be one and the same of "
                         f"{COMPUTE_DTYPES}")
    return formats, h.dtype if formats else jnp.dtype(next(iter(dtypes.values())))


def _check_layer(layer, rows):
    """The stacked row as an SMEM operand; a concrete row out of range is an error (a
    traced one cannot be checked)."""
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < rows:
        raise ValueError(f"layer={layer} must be in [0, {rows}) (the stacked weight rows)")
    return jnp.asarray(layer, jnp.int32).reshape(1)


def swiglu(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
           layer=0, block: BlockSizes | None = None, activation=silu_gate) -> jax.Array:
    """down(silu(h @ gate) * (h @ up)): h [M, D] -> [M, D] float32; with `activation`,
    down(activation(h @ gate, h @ up)) (Kimi K3's SiTU: `mk.kinds.mlp.kinds.SituDense`).

    w_gate, w_up [D, F] and w_down [F, D], or stacked [Ld, D, F] / [Ld, F, D] with `layer`
    (an int or a traced int32) picking the row; the weights stay in HBM. They are arrays
    (multiplied in their dtype) or `mk.model.quant.QuantWeight`s of one scheme (multiplied in
    h's dtype).
    """
    w_gate, w_up = _stacked(w_gate, 2, "w_gate"), _stacked(w_up, 2, "w_up")
    w_down = _stacked(w_down, 2, "w_down")
    Ld, D, F = w_gate.shape
    weights = dict(w_gate=w_gate, w_up=w_up, w_down=w_down)
    formats, dtype = _check_rows_and_dtype(h, weights, tuple(weights))
    M = h.shape[0]
    if h.shape[1] != D or w_up.shape != (Ld, D, F) or w_down.shape != (Ld, F, D):
        raise ValueError(f"h {h.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}, w_down "
                         f"{w_down.shape} must be [M, D], [Ld, D, F], [Ld, D, F], [Ld, F, D]")
    layer_row = _check_layer(layer, Ld)
    block = block or stage_block(swiglu_segments(D, F), dtype, formats)
    stream = weight_stream(block, swiglu_segments(D, F), formats)
    weights, specs = ring_weights(weights, stream)
    buffers = swiglu_buffers(M, D, F, dtype, block, h.dtype, formats)
    wbytes = sum(a.nbytes for a in jax.tree.leaves(weights)) // Ld
    return pl.pallas_call(
        functools.partial(swiglu_kernel, stream=stream, dtype=dtype, activation=activation),
        out_shape=jax.ShapeDtypeStruct((M, D), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec(memory_space=pltpu.VMEM), *specs.values()],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=vmem_scratch(buffers) | {"sems": pltpu.SemaphoreType.DMA((block.slots,))},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(buffers)),
        name="mk_swiglu",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * 3 * D * F, transcendentals=M * F,
            bytes_accessed=wbytes + h.size * h.dtype.itemsize + M * D * 4),
    )(layer_row, h, *weights.values())


# -- Mixture of experts --------------------------------------------------------------------
EXPERT_WEIGHTS = names("moe", family="experts")  # one slot's segments, in order
# An expert slot's segments with gate and up side by side in one matrix
# (`mk.kinds.mlp.joined_experts.gate_up_width`).
JOINED_EXPERT_WEIGHTS = ("we_gate_up", EXPERT_WEIGHTS[-1])
# A MoE layer's small DMAs, one semaphore each in `small_sems` [len(MOE_SMALL_LOADS)]: the
# router [D, E], the selected flags (VMEM -> SMEM, `select_experts`), the sigmoid router's
# bias [1, E]. The stage kernel allocates and indexes them from this list (`small_sem`);
# a layer kind from its own (`mk.kinds.mlp.kinds.MoE.small_loads`, which starts with it).
MOE_SMALL_LOADS = ("router", "selected", "router_bias")


def small_sem(name: str) -> int:
    """The index of the small DMA `name` (MOE_SMALL_LOADS) in a MoE layer's small_sems."""
    return MOE_SMALL_LOADS.index(name)


def expert_slots(experts: int, top_k: int, rows: int) -> int:
    """Expert slots of one MoE layer: at most every row picks top_k distinct experts."""
    return min(experts, rows * top_k)


def moe_segments(D: int, Fe: int, slots: int, shared_ffn: int = 0,
                 joined: int | None = None) -> list:
    """A MoE layer's ring segments: the shared expert's (SHARED_WEIGHTS, when shared_ffn >
    0; its addresses are known before routing), then the expert slots' gate, up, down
    (with `joined`, the `gate_up_width`: gate|up [D, joined], then down), repeated once
    per slot."""
    shared = swiglu_segments(D, shared_ffn, SHARED_WEIGHTS) if shared_ffn else []
    if joined:
        return shared + [Repeat(slots, (("we_gate_up", D, joined), ("we_down", Fe, D)))]
    return shared + [Repeat(slots, (("we_gate", D, Fe), ("we_up", D, Fe), ("we_down", Fe, D)))]


ROUTED_LAYER = 1  # count_smem [2] int32: the active slots' count, the layer routed for them


def moe_fetch(weights: dict, row, ids_smem, count_smem) -> dict:
    """Fetch callables of the expert slots' segments, from their weights in HBM by name
    (EXPERT_WEIGHTS or JOINED_EXPERT_WEIGHTS): slot s streams expert ids_smem[s] of weight
    row `row(layer)` and is switched off unless s < count_smem[0] and the ids are this
    layer's (count_smem[ROUTED_LAYER] == layer)."""
    def fetch(w_hbm):
        return lambda layer, s: (w_hbm.at[row(layer), ids_smem[s]],
                                 (s < count_smem[0]) & (count_smem[ROUTED_LAYER] == layer))
    return {name: fetch(w_hbm) for name, w_hbm in weights.items()}


def select_experts(selected, selected_vmem, selected_smem, sem, ids_smem, count_smem):
    """selected [1, E] int32 flags -> ids_smem[0:count] the selected ids in increasing
    order, count_smem[0] = count. One VMEM -> SMEM DMA, then a scalar loop over E."""
    selected_vmem[...] = selected
    copy = pltpu.make_async_copy(selected_vmem, selected_smem, sem)
    copy.start()
    copy.wait()

    def compact(e, count):
        @pl.when(selected_smem[0, e] > 0)
        def take():
            ids_smem[count] = e

        return count + selected_smem[0, e]

    count_smem[0] = lax.fori_loop(0, selected_smem.shape[1], compact, jnp.int32(0))


def expert_segments(stream: TileStream) -> tuple[str, ...]:
    """The names of an expert slot's segments in `stream`: EXPERT_WEIGHTS, or
    JOINED_EXPERT_WEIGHTS where gate and up are one matrix (`moe_segments`)."""
    names = {s.name for s in stream.segments}
    return JOINED_EXPERT_WEIGHTS if JOINED_EXPERT_WEIGHTS[0] in names else EXPERT_WEIGHTS


def _expert_region(stream: TileStream, layer):
    """(first tile, end, tiles per slot) of the expert slots of `layer` in the stream."""
    segments = [stream.segment(name) for name in expert_segments(stream)]
    first = segments[0]
    if not (all(s.copies == first.copies for s in segments)
            and all(b.start == a.start + a.tiles for a, b in zip(segments, segments[1:]))
            and first.stride == sum(s.tiles for s in segments)):
        raise ValueError(f"the expert segments must be one Repeat of "
                         f"{expert_segments(stream)}; got {segments}")
    base = stream.base(layer, first)
    return base, base + first.copies * first.stride, first.stride


def experts_body(ring: Ring, layer, x, combine_vmem, ids_smem, count_smem, gate_vmem,
                 up_vmem, down_vmem, out_ref, *, activation=silu_gate, bias=None,
                 used: int | None = None):
    """out_ref [M, D] f32 += sum over active slots of combine[:, id] * expert_id(x), an
    expert being down(activation(x @ gate, x @ up)) (`silu_gate`: SwiGLU); bias(j, e):
    the [1, width] f32 bias of expert e's gate (j = 0), up (1) and down (2) projections
    (gpt-oss's), or None. Where the stream joins gate and up (`expert_segments`), up_vmem
    [M, gate_up_width] takes their product and `used` is each one's columns of values
    (`mk.kinds.mlp.joined_experts.split_gate_up`); the activation's other lanes are set to
    zero (down's rows there are zeros: an inf would make them NaN).

    Assumes the active slots' first tiles were issued (see `moe_body`).
    """
    base, end, per_slot = _expert_region(ring.stream, layer)
    joined = expert_segments(ring.stream) == JOINED_EXPERT_WEIGHTS
    count = count_smem[0]
    M, E = combine_vmem.shape
    width = gate_vmem.shape[1]
    if joined and used is None:
        raise ValueError("gate and up are joined in the stream: pass `used`")

    def expert_slot(s, slot):  # slot: the ring slot of slot s's first tile
        if joined:
            slot = ring.matmul("we_gate_up", x, up_vmem, layer=layer, copy=s, slot=slot)
            gate, up = split_gate_up(up_vmem[...], used, width)
        else:
            slot = ring.matmul("we_gate", x, gate_vmem, layer=layer, copy=s, slot=slot)
            slot = ring.matmul("we_up", x, up_vmem, layer=layer, copy=s, slot=slot)
            gate, up = gate_vmem[...], up_vmem[...]
        if bias is not None:
            gate, up = gate + bias(0, ids_smem[s]), up + bias(1, ids_smem[s])
        act = activation(gate, up)
        if joined and used < width:
            act = jnp.where(lax.broadcasted_iota(jnp.int32, act.shape, 1) < used, act, 0.0)
        gate_vmem[...] = act
        slot = ring.matmul("we_down", gate_vmem, down_vmem, layer=layer, copy=s, slot=slot)
        if bias is not None:
            down_vmem[...] = down_vmem[...] + bias(2, ids_smem[s])
        expert = lax.broadcasted_iota(jnp.int32, (M, E), 1)
        weight = jnp.sum(jnp.where(expert == ids_smem[s], combine_vmem[...], 0.0),
                         axis=1, keepdims=True)  # [M, 1]
        out_ref[...] += weight * down_vmem[...]
        return slot

    lax.fori_loop(0, count, expert_slot, jnp.asarray(base % ring.n, jnp.int32))

    ring.skip(base + count * per_slot, end)  # the off slots


def moe_body(ring: Ring, layer, x, router_vmem, combine_vmem, selected_vmem, selected_smem,
             sem, ids_smem, count_smem, gate_vmem, up_vmem, down_vmem, out_ref, *,
             routing: Routing, bias_vmem=None, shared=None, gather=None, **experts):
    """out_ref [M, D] f32 += the MoE block of x [M, D] (a VMEM ref); router_vmem [E, D]
    holds this layer's router transposed (bias_vmem [1, E] its bias: the sigmoid
    router's, or gpt-oss's on the softmax router's logits; a split router's rows and
    `gather`: `route_body`'s); experts: `experts_body`'s activation and bias.
    shared: the shared expert's (gate, up) [M, Fs] f32 scratch when the stream holds its
    segments (`moe_segments`): it runs first, through the ring, while count is still 0.
    Needs count_smem[0] == 0 while the tiles before the expert region were consumed
    (module docstring); leaves it 0. Returns the number of distinct experts loaded (a
    scalar)."""
    if shared is not None:  # down_vmem holds its output until the experts reuse it
        swiglu_body(ring, layer, x, *shared, down_vmem, names=SHARED_WEIGHTS)
        out_ref[...] += down_vmem[...]
    route_experts(ring, layer, x, router_vmem, combine_vmem, selected_vmem, selected_smem,
                  sem, ids_smem, count_smem, routing=routing, bias_vmem=bias_vmem,
                  gather=gather)
    experts_body(ring, layer, x, combine_vmem, ids_smem, count_smem, gate_vmem, up_vmem,
                 down_vmem, out_ref, **experts)
    loaded = count_smem[0]
    count_smem[0] = 0
    return loaded


def route_experts(ring: Ring, layer, x, router_vmem, combine_vmem, selected_vmem,
                  selected_smem, sem, ids_smem, count_smem, *, routing: Routing,
                  bias_vmem=None, gather=None) -> None:
    """Route x's rows (`route_body`), compact the chosen experts into slots
    (`select_experts`), mark them `layer`'s and issue the expert region's first tiles
    (no-ops when the ring first issued them): the steps of `moe_body` (and of
    `mk.kinds.mlp.latent_moe`'s) between the tiles known before routing and the slots."""
    selected = route_body(x, router_vmem, combine_vmem, routing, bias_vmem, gather)
    select_experts(selected, selected_vmem, selected_smem, sem, ids_smem, count_smem)
    count_smem[ROUTED_LAYER] = layer
    gate = ring.stream.segment(expert_segments(ring.stream)[0])
    base = ring.stream.base(layer, gate)
    for t in range(min(ring.n, gate.copies * gate.stride)):  # were no-ops when issued
        ring.start(base + t)


def moe_buffers(M: int, D: int, E: int, Fe: int, dtype, block: BlockSizes,
                x_dtype="float32", formats=None, *, shared_ffn: int = 0,
                router_bias: bool = False) -> list[Buffer]:
    """Every VMEM buffer of `moe` (the budget and the scratch come from here); dtype: the
    router's (and plain experts'); formats: {family: mk.model.quant scheme} of quantised weights
    (the ring's packed slots); shared_ffn: the shared expert's width (0: none);
    router_bias: whether the router has a bias (the sigmoid router's: a [1, E] buffer)."""
    stream = weight_stream(block, moe_segments(D, Fe, 1, shared_ffn), formats)  # any slots
    dt = str(jnp.dtype(dtype))
    buffers = _stage_buffers(M, D, dtype, stream, x_dtype) + [
        Buffer("router", (E, D), dt), Buffer("combine", (M, E), "float32"),
        Buffer("selected", (1, E), "int32"), Buffer("gate", (M, Fe), "float32"),
        Buffer("up", (M, Fe), "float32"), Buffer("down", (M, D), "float32")]
    if router_bias:
        buffers.append(Buffer("router_bias", (1, E), dt))
    if shared_ffn:
        buffers += [Buffer("shared_gate", (M, shared_ffn), "float32"),
                    Buffer("shared_up", (M, shared_ffn), "float32")]
    return buffers


MOE_SCRATCH = ("router_vmem", "combine_vmem", "selected_vmem", "gate_vmem", "up_vmem",
               "down_vmem", "router_bias_vmem", "shared_gate_vmem", "shared_up_vmem",
               "small_sems", "selected_smem", "ids_smem", "count_smem")


def moe_kernel(inputs, out_vmem, loaded_smem, *, stream: TileStream, dtype,
               routing: Routing, sems, **scratch):
    """inputs (by name): layer [1] int32 (SMEM, the stacked weight row), h [M, D] (VMEM),
    and in HBM router [Lm, E, D] (transposed; router_bias [Lm, 1, E] for the sigmoid
    router), the experts we_* [Lm, E, ...] (weight dtype or tile-major
    `mk.model.quant.QuantWeight`s) and the shared expert's ws_* [Lm, ...] when there is one.
    outputs: out [M, D] f32, loaded [1] int32 (distinct experts loaded). scratch:
    `moe_buffers`' (`vmem_scratch` names), the ring's DMA semaphores `sems`, small_sems
    (`MOE_SMALL_LOADS`, by `small_sem`), the SMEM scalars; the rest are the ring's slots
    (as `swiglu_kernel`'s). dtype: the experts' compute dtype."""
    s = SimpleNamespace(**{n: scratch.pop(n) for n in MOE_SCRATCH if n in scratch})
    row = inputs["layer"][0]
    small = [("router", s.router_vmem)] + (
        [("router_bias", s.router_bias_vmem)] if "router_bias" in inputs else [])
    copies = []
    for name, ref in small:
        sem = s.small_sems.at[small_sem(name)]
        copies.append(pltpu.make_async_copy(inputs[name].at[row], ref, sem))
        start_dma(copies[-1], name, ref.size * ref.dtype.itemsize)
    s.count_smem[0], s.count_smem[ROUTED_LAYER] = 0, -1
    out_vmem[...] = jnp.zeros_like(out_vmem)
    fetch = moe_fetch({n: inputs[n] for n in EXPERT_WEIGHTS}, lambda layer: row, s.ids_smem,
                      s.count_smem)
    if "ws_gate" in inputs:
        fetch |= swiglu_fetch(*(inputs[n] for n in SHARED_WEIGHTS), lambda layer: row,
                              names=SHARED_WEIGHTS)
    ring = _ring(stream, fetch, scratch, sems, dtype)
    ring.prime()  # the shared expert's first tiles; expert tiles are no-ops until routing
    for copy in copies:
        copy.wait()
    loaded_smem[0] = moe_body(
        ring, 0, inputs["h"], s.router_vmem, s.combine_vmem, s.selected_vmem, s.selected_smem,
        s.small_sems.at[small_sem("selected")], s.ids_smem, s.count_smem, s.gate_vmem,
        s.up_vmem, s.down_vmem, out_vmem, routing=routing,
        bias_vmem=getattr(s, "router_bias_vmem", None),
        shared=((s.shared_gate_vmem, s.shared_up_vmem) if "ws_gate" in inputs else None))


def _moe_weights(h: jax.Array, router, we_gate, we_up, we_down, *, top_k: int,
                 renormalise: bool, router_score: str, router_bias, expert_groups: int,
                 topk_groups: int, routed_scale: float, shared):
    """`moe`'s weights checked: each stacked on a leading layer axis and its shape checked
    against h [M, D] and the others, the routing checked against E -> (weights by name, the
    `Routing`, the streamed names, the experts' formats, the dtype they multiply in)."""
    router, we_gate = _stacked(router, 2, "router"), _stacked(we_gate, 3, "we_gate")
    we_up, we_down = _stacked(we_up, 3, "we_up"), _stacked(we_down, 3, "we_down")
    Lm, E, D, Fe = we_gate.shape
    weights = dict(router=router, we_gate=we_gate, we_up=we_up, we_down=we_down)
    routing = Routing(top_k, renormalise, router_score, expert_groups, topk_groups,
                      routed_scale).check(E)
    if (router_bias is not None) != (router_score == "sigmoid"):
        raise ValueError(f"moe: router_bias is {'missing' if router_bias is None else 'given'}"
                         ": the sigmoid router needs one, the softmax router has none "
                         f"(router_score={router_score!r})")
    if router_bias is not None:
        weights["router_bias"] = _stacked(router_bias, 1, "router_bias")[:, None]
    Fs = 0
    if shared is not None:
        weights |= {n: _stacked(w, 2, n) for n, w in zip(SHARED_WEIGHTS, shared)}
        Fs = weights["ws_gate"].shape[2]
        want = dict(ws_gate=(Lm, D, Fs), ws_up=(Lm, D, Fs), ws_down=(Lm, Fs, D))
        got = {n: weights[n].shape for n in SHARED_WEIGHTS}
        if got != want:
            raise ValueError(f"shared expert shapes {got} must be {want}")
    streamed = EXPERT_WEIGHTS + (SHARED_WEIGHTS if Fs else ())
    formats, dtype = _check_rows_and_dtype(h, weights, streamed)
    if (h.shape[1] != D or router.shape != (Lm, D, E) or we_up.shape != (Lm, E, D, Fe)
            or we_down.shape != (Lm, E, Fe, D)
            or ("router_bias" in weights and weights["router_bias"].shape != (Lm, 1, E))):
        raise ValueError(f"h {h.shape}, router {router.shape}, we_gate {we_gate.shape}, "
                         f"we_up {we_up.shape}, we_down {we_down.shape} must be [M, D], "
                         "[Lm, D, E], [Lm, E, D, Fe], [Lm, E, D, Fe], [Lm, E, Fe, D]"
                         + ("" if router_bias is None else
                            f"; router_bias {jnp.shape(router_bias)} [Lm, E]"))
    return weights, routing, streamed, formats, dtype


def moe(h: jax.Array, router: jax.Array, we_gate: jax.Array, we_up: jax.Array,
        we_down: jax.Array, *, top_k: int, renormalise: bool, router_score: str = "softmax",
        router_bias: jax.Array | None = None, expert_groups: int = 1, topk_groups: int = 1,
        routed_scale: float = 1.0, shared=None, layer=0, block: BlockSizes | None = None,
        return_loaded: bool = False):
    """The MoE block (`mk.model.reference.mlp_block`'s): h [M, D] -> [M, D] float32.

    router [D, E]; we_gate, we_up [E, D, Fe]; we_down [E, Fe, D]; or each stacked on a
    leading layer axis with `layer` picking the row. Only the selected experts are read.
    The experts are arrays (of the router's dtype) or `mk.model.quant.QuantWeight`s of one
    scheme (multiplied in h's dtype); the router is an array. The routing (`Routing`):
    top_k, renormalise, router_score ("softmax": Qwen3-MoE; "sigmoid": DeepSeek-V3 / Kimi,
    with router_bias [E] (or [Lm, E]), expert_groups, topk_groups and routed_scale; the
    names are ModelConfig's). shared: a shared expert's (ws_gate, ws_up [D, Fs], ws_down
    [Fs, D]), stacked like the experts, added to every row (Kimi). With `return_loaded`,
    also returns the number of distinct experts loaded ([1] int32).
    """
    weights, routing, streamed, formats, dtype = _moe_weights(
        h, router, we_gate, we_up, we_down, top_k=top_k, renormalise=renormalise,
        router_score=router_score, router_bias=router_bias, expert_groups=expert_groups,
        topk_groups=topk_groups, routed_scale=routed_scale, shared=shared)
    router = weights["router"]
    Lm, E, D, Fe = weights["we_gate"].shape
    Fs = weights["ws_gate"].shape[2] if "ws_gate" in streamed else 0
    M = h.shape[0]
    layer_row = _check_layer(layer, Lm)
    block = block or stage_block(moe_segments(D, Fe, 1, Fs), dtype, formats)
    slots = expert_slots(E, top_k, M)
    stream = weight_stream(block, moe_segments(D, Fe, slots, Fs), formats)
    ring_inputs, specs = ring_weights({n: weights[n] for n in streamed}, stream)
    buffers = moe_buffers(M, D, E, Fe, router.dtype, block, h.dtype, formats, shared_ffn=Fs,
                          router_bias=router_bias is not None)
    expert_bytes = sum(a.nbytes for n in EXPERT_WEIGHTS
                       for a in jax.tree.leaves(ring_inputs[n])) // (Lm * E)
    shared_bytes = sum(a.nbytes for n in streamed if n in SHARED_WEIGHTS
                       for a in jax.tree.leaves(ring_inputs[n])) // Lm
    inputs = dict(layer=layer_row, h=h, router=router.swapaxes(1, 2)) | {  # [Lm, E, D]
        n: weights[n] for n in ("router_bias",) if n in weights} | ring_inputs
    spaces = {n: pl.BlockSpec(memory_space=pl.ANY) for n in inputs} | dict(
        layer=pl.BlockSpec(memory_space=pltpu.SMEM), h=pl.BlockSpec(memory_space=pltpu.VMEM))
    out, loaded = pl.pallas_call(
        functools.partial(moe_kernel, stream=stream, dtype=dtype, routing=routing),
        out_shape=(jax.ShapeDtypeStruct((M, D), jnp.float32),
                   jax.ShapeDtypeStruct((1,), jnp.int32)),
        in_specs=({n: spaces[n] if n not in specs else specs[n] for n in inputs},),
        out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM),
                   pl.BlockSpec(memory_space=pltpu.SMEM)),
        scratch_shapes=vmem_scratch(buffers) | dict(
            sems=pltpu.SemaphoreType.DMA((block.slots,)),
            small_sems=pltpu.SemaphoreType.DMA((len(MOE_SMALL_LOADS),)),
            selected_smem=pltpu.SMEM((1, E), jnp.int32),
            ids_smem=pltpu.SMEM((slots,), jnp.int32), count_smem=pltpu.SMEM((2,), jnp.int32)),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(buffers)),
        name="mk_moe",
        cost_estimate=pl.CostEstimate(  # an upper bound: every slot active
            flops=2 * M * D * E + 2 * M * 3 * D * (Fe * slots + Fs),
            transcendentals=M * E + M * (Fe * slots + Fs),
            bytes_accessed=D * E * router.dtype.itemsize + slots * expert_bytes
            + shared_bytes + h.size * h.dtype.itemsize + M * D * 4),
    )(inputs)
    return (out, loaded) if return_loaded else out


def moe_of(routing: Routing, h: jax.Array, weights: dict, **kw):
    """`moe` on h [M, D] with one layer's weights by their `mk.model.weights` names (the router,
    the experts, and the router's bias and a shared expert where the model has them) and a
    model's `routing` (`Routing.of(config)`); kw: `moe`'s others."""
    shared = tuple(weights[n] for n in SHARED_WEIGHTS if n in weights) or None
    return moe(h, weights["router"], *(weights[n] for n in EXPERT_WEIGHTS), top_k=routing.top_k,
               renormalise=routing.renormalise, router_score=routing.router_score,
               router_bias=weights.get("router_bias"), expert_groups=routing.expert_groups,
               topk_groups=routing.topk_groups, routed_scale=routing.routed_scale,
               shared=shared, **kw)
