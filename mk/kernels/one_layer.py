"""Stage 05, one fused layer: every op of a decoder layer in one pallas_call, one ring.

prologue (norm, Q/K/V, QK-norm, RoPE) -> decode attention over the cache -> output
projection + residual -> norm -> SwiGLU or MoE -> residual. All weights of the layer are
ONE `TileStream` (wq, wk, wv, wo, then the dense MLP's or the expert slots), so the
ring never drains between sub-blocks: while attention walks the KV cache, the first tiles
of wo are already in VMEM; while wo computes, the MLP's tiles are in flight. Expert tiles
are the one exception: they can only be issued once the router has chosen (see
`mk.kernels.mlp`).

A hybrid's layer (Qwen3.5) has a gated-DeltaNet token mixer instead of attention
(`mk.kernels.deltanet.linear_mixer`): the megakernel's stream holds both mixers' segments
and each layer skips the kind it does not use (`layer_body(..., linear=)`). A Kimi Linear
model's full layers are MLA (`mk.kernels.mla`: its absorbed prologue and epilogue around
the same `attend`, over the latent cache; `layer_body(..., mla=)`).

Here: `mixer_kinds` and `mlp_kinds` (what a whole-model kernel holds), `router_after_mixer`
(where an MoE layer issues its router's DMA), `full_matrices` (a
full layer's attention segments), `mlp_weights` (an
MLP kind's weights: Kimi's MoE adds a router bias and a shared expert), `layer_matrices`
(the stream of one layer), `model_block` (the tiling its matrices share), `layer_buffers` /
`layer_scratch` (its VMEM and scratch by name), `mlp_fetch`, `LAYER_PHASES` (the layer's
program order as data, `FULL_PHASES` those of attention) and `layer_body` (the in-kernel
layer the megakernel loops over, in that order), and the stage wrapper `one_layer` with its
`one_layer_buffers` (its weights may be `mk.quant.QuantWeight`s: packed tiles through the
ring, dequantised in VMEM; its layer is Qwen3's). Every piece is the stage kernels' own:
`prologue`, `attend`, `linear_mixer`, `swiglu_body`, `moe_body`. Not here: the layer loop,
the lm_head and the cross-layer ring (`mk.megakernel`).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk import quant
from mk.config import ModelConfig
from mk.kernels.attention_prologue import check_layer_inputs, prologue, prologue_matrices
from mk.kernels.common import (SLOTS, BlockSizes, Buffer, aliases, default_block,
                               memory_specs, start_dma, vmem_limit_bytes)
from mk.kernels.decode_attention import attend, decode_attention_buffers, decode_attention_scratch
from mk.kernels.deltanet import gated_deltanet_matrices, linear_mixer
from mk.kernels.kv_stream import AttentionScratch, KvStream, drain_write_backs, start_write_backs
from mk.kernels.mla import (mla_buffers, mla_epilogue, mla_matrices, mla_prologue,
                            start_mla_loads)
from mk.kernels.mlp import (DENSE_WEIGHTS, EXPERT_WEIGHTS, MOE_SMALL_LOADS,
                            SHARED_WEIGHTS, Routing, expert_slots, moe_body, moe_fetch,
                            moe_segments, small_sem, swiglu_body, swiglu_fetch,
                            swiglu_segments)
from mk.kernels.ring import Ring, TileStream, ring_buffers
from mk.kernels.weight_streaming import ring_weights, weight_stream
from mk.ops import rms_norm
from mk.reference import check_positions
from mk.weights import names_of


def mlp_kinds(config: ModelConfig) -> tuple[str, ...]:
    """The MLP kinds a whole-model kernel must hold: ("dense",), ("moe",) or both."""
    return tuple(k for k, layers in (("dense", config.dense_layers),
                                     ("moe", config.moe_layers)) if layers)


def mixer_kinds(config: ModelConfig) -> tuple[str, ...]:
    """The token-mixer kinds a whole-model kernel must hold: ("full",), ("linear",) or
    both (a hybrid: Qwen3.5's gated-DeltaNet layers beside full attention)."""
    return tuple(k for k, layers in (("full", config.full_layers),
                                     ("linear", config.linear_layers)) if layers)


def layer_matrices(config: ModelConfig, kinds: tuple[str, ...], M: int,
                   mixers: tuple[str, ...] = ("full",)) -> list:
    """The ring segments of one layer in consumption order: the token mixers of every kind
    in `mixers` (linear: lin_qkv, lin_z, lin_out; then attention: wq, wk, wv, wq_gate, wo),
    then the MLP segments of every kind in `kinds` (MoE, then dense); a layer switches off
    the kinds it does not use. M = B*T activation rows bound the expert slots.

    The order places each switched-off region where its skip (`Ring.skip`: the tiles past
    it are issued only then) comes before a collective or the layer's end: a linear
    layer skips attention after its mixer, an MoE layer the dense MLP after its experts, so
    the refill loads during the all-reduce that follows; only a full layer of a hybrid
    (skipping the linear region at its start) and a dense layer of a mixed model (the MoE
    region) wait for theirs."""
    matrices = []
    if "linear" in mixers:
        matrices += gated_deltanet_matrices(config)
    if "full" in mixers:
        matrices += full_matrices(config)
    if "moe" in kinds:
        slots = expert_slots(config.experts, config.experts_per_token, M)
        matrices += moe_segments(config.hidden, config.expert_ffn, slots,
                                 config.shared_expert_ffn)
    if "dense" in kinds:
        matrices += swiglu_segments(config.hidden, config.ffn)
    return matrices


def full_matrices(config: ModelConfig) -> list[tuple[str, int, int]]:
    """The ring segments of a full layer's attention: the prologue's and wo (MLA's
    `mla_matrices` in a Kimi Linear model)."""
    if config.is_mla:
        return mla_matrices(config)
    return prologue_matrices(config) + [("wo", config.q_width, config.hidden)]


def model_block(config: ModelConfig, *, context: int | None = None, slots: int = SLOTS,
                formats=None) -> BlockSizes:
    """The default tiling of a whole-model kernel of `config` (or of one of its layers):
    `default_block` over every ring matrix of its layers (`layer_matrices`), the lm_head's
    D rows (its columns are padded to whole tiles), the weights of quantised `formats`
    ({family: mk.quant scheme}) never transposed."""
    matrices = layer_matrices(config, mlp_kinds(config), 1, mixer_kinds(config))
    return default_block(matrices, context=context, slots=slots,
                         itemsize=jnp.dtype(config.dtype).itemsize,
                         quantised=tuple(quant.schemes_of(formats)),
                         padded_rows=(config.hidden,))


def layer_buffers(config: ModelConfig, kinds: tuple[str, ...], batch: int, rows: int,
                  block: BlockSizes, ring: list[Buffer] | None = None) -> list[Buffer]:
    """The VMEM scratch of `layer_body` holding the MLP `kinds` (group "layer": the
    attributes of its scratch namespace `s`); the attention's are `attend`'s own. ring:
    the ring's slots (`mk.kernels.ring.ring_buffers` of the kernel's stream; default one
    plain ring of config.dtype)."""
    M, D, dt = batch * rows, config.hidden, config.dtype
    f32 = "float32"
    if ring is None:
        ring = [Buffer("ring", (block.slots, block.tile_rows, block.tile_cols), dt)]
    attention = mla_buffers(config, M) if config.is_mla else [
        Buffer("q", (M, config.q_width), f32), Buffer("k", (M, config.kv_width), f32),
        Buffer("v", (M, config.kv_width), f32), Buffer("o", (M, config.q_width), f32)]
    buffers = [*ring, Buffer("h", (M, D), dt), *attention, Buffer("attn_out", (M, D), f32),
               Buffer("mlp_out", (M, D), f32)]
    if config.attn_output_gate:
        buffers.append(Buffer("q_gate", (M, config.q_width), f32))
    if "dense" in kinds:
        buffers += [Buffer("gate", (M, config.ffn), f32), Buffer("up", (M, config.ffn), f32)]
    if "moe" in kinds:
        E, Fe = config.experts, config.expert_ffn
        buffers += [Buffer("router", (D, E), dt), Buffer("combine", (M, E), f32),
                    Buffer("selected", (1, E), "int32"), Buffer("e_gate", (M, Fe), f32),
                    Buffer("e_up", (M, Fe), f32), Buffer("down", (M, D), f32)]
        if config.router_score == "sigmoid":
            buffers.append(Buffer("router_bias", (1, E), dt))
        if config.shared_expert_ffn:
            Fs = config.shared_expert_ffn
            buffers += [Buffer("shared_gate", (M, Fs), f32), Buffer("shared_up", (M, Fs), f32)]
    return buffers


def one_layer_buffers(config: ModelConfig, kinds: tuple[str, ...], batch: int, rows: int,
                      block: BlockSizes, formats=None) -> list[Buffer]:
    """Every VMEM buffer of the stage-05 kernel holding the MLP `kinds`: its operands x
    and x_out, the layer scratch (the ring's slots for the weights' `formats`, {family:
    mk.quant scheme}) and the attention scratch."""
    M, D = batch * rows, config.hidden
    return ([Buffer("x", (M, D), "float32", "operand"),
             Buffer("x_out", (M, D), "float32", "operand")]
            + layer_buffers(config, kinds, batch, rows, block,
                            ring=_ring_slots(config, kinds, M, block, formats))
            + decode_attention_buffers(batch, rows, config.heads, config.kv_heads,
                                       config.head_dim, config.dtype, block))


def _stream(config: ModelConfig, kinds: tuple[str, ...], M: int, block: BlockSizes,
            formats) -> TileStream:
    return weight_stream(block, layer_matrices(config, kinds, M), formats)


def _ring_slots(config: ModelConfig, kinds: tuple[str, ...], M: int, block: BlockSizes,
                formats) -> list[Buffer]:
    return ring_buffers(_stream(config, kinds, M, block, formats), config.dtype)


def layer_scratch(config: ModelConfig, kinds: tuple[str, ...], batch: int, rows: int,
                  block: BlockSizes, formats=None) -> dict:
    """The pallas scratch of `layer_body` by name: the layer buffers (the ring's slots for
    the weights' `formats`), the ring's semaphores and, with MoE, the router's and flags'
    semaphores and the SMEM scalars."""
    ring = _ring_slots(config, kinds, batch * rows, block, formats)
    scratch = {b.name: pltpu.VMEM(b.shape, b.dtype)
               for b in layer_buffers(config, kinds, batch, rows, block, ring=ring)}
    scratch["sems"] = pltpu.SemaphoreType.DMA((block.slots,))
    if "moe" in kinds:
        slots = expert_slots(config.experts, config.experts_per_token, batch * rows)
        scratch |= dict(small_sems=pltpu.SemaphoreType.DMA((len(MOE_SMALL_LOADS),)),
                        selected_smem=pltpu.SMEM((1, config.experts), jnp.int32),
                        ids_smem=pltpu.SMEM((slots,), jnp.int32),
                        count_smem=pltpu.SMEM((1,), jnp.int32))
    return scratch


def mlp_weights(config: ModelConfig, kind: str) -> tuple[str, ...]:
    """The HBM weights of `config`'s MLP `kind` ("dense" or "moe": its rows of
    `mk.weights`; a MoE's router, a sigmoid router's bias, the experts and a shared
    expert)."""
    return names_of(config, kind, "ring", "dma")


def mlp_fetch(kinds, weights, s, row, is_moe) -> dict:
    """The ring's Fetch callables of the MLP segments. weights: HBM refs by name (those of
    `mlp_weights` for each kind); row(step) picks the stacked row; is_moe(step) (mixed
    models) switches dense off, and a shared expert on."""
    fetch = {}
    mixed = len(kinds) == 2
    if "dense" in kinds:
        dense_off = (lambda step: ~is_moe(step)) if mixed else None
        fetch |= swiglu_fetch(*(weights[n] for n in DENSE_WEIGHTS), row, dense_off)
    if "moe" in kinds:
        fetch |= moe_fetch(*(weights[n] for n in EXPERT_WEIGHTS), row, s.ids_smem,
                           s.count_smem)
        if "ws_gate" in weights:
            fetch |= swiglu_fetch(*(weights[n] for n in SHARED_WEIGHTS), row,
                                  is_moe if mixed else None, names=SHARED_WEIGHTS)
    return fetch


def _region(ring: Ring, step, first: str, last: str):
    """[first tile, end) of the segments first..last of layer `step` in the stream."""
    a, b = ring.stream.segment(first), ring.stream.segment(last)
    return (ring.stream.base(step, a),
            ring.stream.base(step, b) + (b.copies - 1) * b.stride + b.tiles)


def mlp_block(ring: Ring, config: ModelConfig, kinds, s, *, step, is_moe):
    """s.mlp_out [M, D] f32 = this layer's MLP of s.h; is_moe: a traced flag, used only
    when the stream holds both kinds (the other kind's segments are then skipped)."""
    def dense():
        swiglu_body(ring, step, s.h, s.gate, s.up, s.mlp_out)

    def experts():
        s.mlp_out[...] = jnp.zeros_like(s.mlp_out)
        moe_body(ring, step, s.h, s.router, s.combine, s.selected, s.selected_smem,
                 s.small_sems.at[small_sem("selected")], s.ids_smem, s.count_smem, s.e_gate,
                 s.e_up, s.down, s.mlp_out, routing=Routing.of(config),
                 bias_vmem=getattr(s, "router_bias", None),
                 shared=(s.shared_gate, s.shared_up) if config.shared_expert_ffn else None)

    if kinds == ("dense",):
        dense()
    elif kinds == ("moe",):
        experts()
    else:  # the MoE segments come first in the period (`layer_matrices`)
        @pl.when(~is_moe)
        def dense_layer():
            first = "ws_gate" if config.shared_expert_ffn else "we_gate"
            ring.skip(*_region(ring, step, first, "we_down"))  # count is 0: all off
            dense()

        @pl.when(is_moe)
        def moe_layer():
            experts()
            ring.skip(*_region(ring, step, "w_gate", "w_down"))


# The phases of one layer in program order, as data: `layer_body` runs them in this order
# (each under `phase`, which checks it at trace time and names it for the profiler), and
# `mk.sim` replays the same list with its cost model of each phase.
LAYER_PHASES = ("linear", "prologue", "attend", "kv_prime", "wo", "after_mixer",
                "attn_all_reduce", "mlp_norm", "before_mlp", "mlp", "mlp_all_reduce",
                "residual")
FULL_PHASES = ("prologue", "attend", "kv_prime", "wo")  # a full layer's mixer; a linear
#                                                         layer's is "linear"


def router_after_mixer(tp: int) -> bool:
    """Where an MoE layer's router DMA is issued (the kernel's rule, the simulator's too):
    at tp > 1 in "after_mixer", behind all of the token mixer's tiles (a router issued
    first would delay them), loading during the mixer's all-reduce; at tp = 1, with no
    all-reduce to hide it, at the layer's start, behind the ring's look-ahead, loading
    during attention."""
    return tp > 1


def phases():
    """A checker for one layer's trace: `phase(name)` is a `jax.named_scope(name)` after
    checking that `name` is LAYER_PHASES' next phase; `phase.done()` that none is left."""
    order = iter(LAYER_PHASES)

    def phase(name: str):
        expected = next(order, None)
        if name != expected:
            raise AssertionError(f"layer_body runs {name!r} where LAYER_PHASES has "
                                 f"{expected!r}: the simulator replays that list")
        return jax.named_scope(name)

    def done():
        left = next(order, None)
        if left is not None:
            raise AssertionError(f"layer_body never ran {left!r} of LAYER_PHASES")

    phase.done = done
    return phase


def residual(x, block_out):
    """The residual stream after a block: its input x plus the block's output (both [M, D]
    f32). A function of its own so the course can plant a wrong one (`mk.course`)."""
    return x + block_out


def layer_body(ring: Ring, config: ModelConfig, kinds, s, *, step, layer, is_moe, x, norms,
               positions_smem, k_cache_hbm, v_cache_hbm, attention: AttentionScratch,
               block: BlockSizes, batch: int, rows: int, after_mixer=None, before_mlp=None,
               all_reduce=None, linear=None, kv_next=None, mla=None):
    """One decoder layer inside a kernel: returns the new residual x [M, D] f32.

    step: this layer's index in the ring's stream; layer: its index in the KV cache (a full
    layer's row in the stacked attention weights), whose first KV tiles the caller primed
    (`KvStream.prime`: at the kernel's start for the first full layer); kv_next: the cache
    layer a full layer primes after its attention (traced; none past the cache's last),
    or None; s: the scratch refs by name; norms:
    (attn_norm, mlp_norm, q_norm, k_norm) values (the q/k norms unused without
    config.qk_norm); is_moe: a traced flag for streams holding
    both MLP kinds; after_mixer: called after the token mixer, before its all-reduce (e.g.
    to issue the router's DMA: behind the mixer's tiles in the DMA queue, landing during
    the all-reduce); before_mlp: called just before the MLP (e.g. to wait for the router's
    DMA); all_reduce(value, k): the tensor-parallel sum over
    devices of the attention (k=0) and MLP (k=1) outputs. linear: for a model with linear
    layers, (is_linear: a traced flag (None when every layer is linear), the layer's row in
    the stacked linear weights and states, `linear_scratch` as a namespace, the HBM refs
    `linear_mixer` reads by name). A hybrid's stream holds both mixers: a layer skips the
    other kind's segments (neither loaded nor computed). mla: for an MLA model, the HBM
    refs of `mk.kernels.mla.mla_loads` by name; its caches are (the latent cache [La, B, 1,
    S, W], None).
    """
    attn_norm, mlp_norm, q_norm, k_norm = norms
    if not config.qk_norm:  # the tables hold ones; RMSNorm by ones is not the identity
        q_norm = k_norm = None
    mixers = mixer_kinds(config)
    is_linear = None if linear is None else linear[0]
    phase = phases()

    def mixer(kind: str, body):
        """Run body for a layer of mixer `kind` (a run-time branch in a hybrid)."""
        def run():  # a pl.when branch returns nothing
            body()

        if mixers == (kind,):
            run()
        elif kind in mixers:
            pl.when(is_linear if kind == "linear" else ~is_linear)(run)

    def attention_prologue():
        if config.is_mla:
            loads = start_mla_loads(config, s, mla, layer)
            mla_prologue(ring, config, s, loads, layer=step, x=x, attn_norm=attn_norm)
            return
        prologue(ring, config, layer=step, x=x, attn_norm=attn_norm, q_norm=q_norm,
                 k_norm=k_norm, positions_smem=positions_smem, batch=batch, rows=rows,
                 h_vmem=s.h, q_vmem=s.q, k_vmem=s.k, v_vmem=s.v,
                 gate_vmem=getattr(s, "q_gate", None))

    def attend_cache():  # its first KV tiles were primed (`kv_next`)
        if config.is_mla:  # the latent rows are the keys and the values
            attend(s.queries, s.latent_new, None, positions_smem, k_cache_hbm, None,
                   s.o_latent, attention, layer=layer, block=block, primed=True,
                   scale=1 / math.sqrt(config.head_dim))  # the unabsorbed head's
        else:
            attend(s.q, s.k, s.v, positions_smem, k_cache_hbm, v_cache_hbm, s.o,
                   attention, layer=layer, block=block, primed=True)

    def output_projection():
        if config.is_mla:
            mla_epilogue(config, s)
        if config.attn_output_gate:  # Qwen3.5: o * sigmoid(h @ wq_gate)
            s.o[...] = s.o[...] * jax.nn.sigmoid(s.q_gate[...])
        ring.matmul("wo", s.o, s.attn_out, layer=step)

    def linear_layer():  # the full region after it is skipped before the all-reduce
        _, row, ls, hbm = linear
        linear_mixer(ring, config, ls, hbm, step=step, row=row, x=x, attn_norm=attn_norm,
                     h_vmem=s.h, out_vmem=s.attn_out, batch=batch, rows=rows)
        if "full" in mixers:
            ring.skip(*_region(ring, step, full_matrices(config)[0][0], "wo"))

    def prime_next_kv():  # the next full layer's first KV tiles: they need only the
        @pl.when(kv_next < k_cache_hbm.shape[0])  # positions, so they load across the
        def prime():  # layer edge, behind this layer's weight tiles, long before use
            KvStream(positions_smem, k_cache_hbm, v_cache_hbm, attention, rows=rows,
                     layer=kv_next, block=block).prime()

    with phase("linear"):
        mixer("linear", linear_layer)
        if len(mixers) == 2:
            mixer("full", lambda: ring.skip(*_region(ring, step, "lin_qkv", "lin_out")))
    with phase("prologue"):
        mixer("full", attention_prologue)
    with phase("attend"):
        mixer("full", attend_cache)
    with phase("kv_prime"):
        if kv_next is not None:
            mixer("full", prime_next_kv)
    with phase("wo"):
        mixer("full", output_projection)
    with phase("after_mixer"):
        if after_mixer is not None:
            after_mixer()
    with phase("attn_all_reduce"):
        if all_reduce is not None:  # tensor parallel: wo's rows are split, its sums partial
            s.attn_out[...] = all_reduce(s.attn_out[...], 0)
    with phase("mlp_norm"):
        x = residual(x, s.attn_out[...])
        s.h[...] = rms_norm(x, mlp_norm, config.rms_eps).astype(s.h.dtype)
    with phase("before_mlp"):
        if before_mlp is not None:
            before_mlp()
    with phase("mlp"):
        mlp_block(ring, config, kinds, s, step=step, is_moe=is_moe)
    with phase("mlp_all_reduce"):
        if all_reduce is not None:
            s.mlp_out[...] = all_reduce(s.mlp_out[...], 1)
    with phase("residual"):
        x = residual(x, s.mlp_out[...])
    phase.done()
    return x


def one_layer_kernel(inputs, outputs, *, config: ModelConfig, kind: str,
                     stream: TileStream, block: BlockSizes, batch: int, rows: int,
                     **scratch):
    """inputs: index [2] int32 (layer, its row in the stacked MLP weights), positions [B],
    x [M, D] f32, norms [2, D] f32 (attn, mlp), qk_norms [2, H] f32 (ones without
    QK-norm), wq, wk, wv, wo and the MLP weights of `kind` (`mlp_weights`), the caches;
    outputs: x_out [M, D] f32 and the caches (aliased); scratch: `layer_scratch` as
    "layer", `attend`'s as "attention"."""
    s = SimpleNamespace(**scratch["layer"])
    layer, row = inputs["index"][0], inputs["index"][1]

    def at_layer(name):
        return lambda step: (inputs[name].at[layer], None)

    fetch = {name: at_layer(name) for name in ("wq", "wk", "wv", "wo")}
    fetch |= mlp_fetch((kind,), inputs, s, lambda step: row, None)
    if kind == "moe":
        router = pltpu.make_async_copy(inputs["router"].at[row], s.router,
                                       s.small_sems.at[small_sem("router")])
        start_dma(router, "router", s.router.size * s.router.dtype.itemsize)
        s.count_smem[0] = 0  # expert tiles issued before routing are no-ops
    ring = Ring.in_scratch(stream, fetch, s, s.sems, config.dtype)
    ring.prime()
    attention = AttentionScratch(**scratch["attention"])
    start_write_backs(attention)
    KvStream(inputs["positions"], outputs["k_cache"], outputs["v_cache"], attention,
             rows=rows, layer=layer, block=block).prime()  # they load during the prologue
    if kind == "moe":
        router.wait()  # long before the router runs
    norms, qk = inputs["norms"], inputs["qk_norms"]
    outputs["x_out"][...] = layer_body(
        ring, config, (kind,), s, step=0, layer=layer, is_moe=None, x=inputs["x"][...],
        norms=(norms[0:1, :], norms[1:2, :], qk[0:1, :], qk[1:2, :]),
        positions_smem=inputs["positions"], k_cache_hbm=outputs["k_cache"],
        v_cache_hbm=outputs["v_cache"], attention=attention, block=block, batch=batch,
        rows=rows)
    drain_write_backs(attention, outputs["k_cache"], outputs["v_cache"])


def one_layer(config: ModelConfig, params, x, k_cache, v_cache, positions, *, layer: int,
              block: BlockSizes | None = None):
    """Decoder layer `layer` in one kernel: x [B, T, D] -> (x [B, T, D] float32, k_cache,
    v_cache [L, B, K, S, H] with this layer's new rows written in place). params' weights
    may be `mk.quant.QuantWeight`s (`mk.quant.quantize`: one scheme per family), streamed
    packed and dequantised in VMEM to config.dtype."""
    positions = jnp.asarray(positions, jnp.int32)
    B, T, D = check_layer_inputs(config, x, positions, layer)
    M, S = B * T, k_cache.shape[3]
    expected = (config.layers, B, config.kv_heads, S, config.head_dim)
    if k_cache.shape != expected or v_cache.shape != expected:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} must be [L, B, K, S, H]="
                         f"{expected}")
    check_positions(positions, T, S)
    formats = quant.formats_of(params)
    block = block or model_block(config, context=S, formats=formats)
    block.check_context(S)
    kind, row = config.mlp_index(layer)
    stream = _stream(config, (kind,), M, block, formats)
    ones = jnp.ones((config.head_dim,), jnp.float32)
    qk = [params[n][layer] if config.qk_norm else ones for n in ("q_norm", "k_norm")]
    attention_weights = ("wq", "wk", "wv", "wo")
    weights, weight_specs = ring_weights(
        {n: params[n] for n in attention_weights + mlp_weights(config, kind)}, stream)
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
    attention = [weights[n] for n in attention_weights]  # one layer's: 1 / L of them
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(attention)) // config.layers
    elements = sum(math.prod(w.shape[1:]) for w in attention)
    out = pl.pallas_call(
        functools.partial(one_layer_kernel, config=config, kind=kind, stream=stream,
                          block=block, batch=B, rows=T),
        out_shape=outputs,
        in_specs=(memory_specs(spaces) | weight_specs,),
        out_specs=memory_specs(dict(x_out=pltpu.VMEM, k_cache=pl.ANY, v_cache=pl.ANY)),
        scratch_shapes=dict(
            layer=layer_scratch(config, (kind,), B, T, block, formats),
            attention=decode_attention_scratch(B, T, config.heads, config.kv_heads,
                                               config.head_dim, config.dtype, block)),
        input_output_aliases=aliases(inputs, outputs, ("k_cache", "v_cache")),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(
            one_layer_buffers(config, (kind,), B, T, block, formats))),
        name="mk_one_layer",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * elements, transcendentals=0, bytes_accessed=weight_bytes),
    )(inputs)
    return out["x_out"].reshape(B, T, D), out["k_cache"], out["v_cache"]
