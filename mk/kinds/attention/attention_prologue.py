"""Stage 02, the attention prologue: RMSNorm, Q/K/V through the ring, QK-norm, RoPE.

h = RMSNorm(x); q, k, v = h @ Wq, h @ Wk, h @ Wv with the three weights streamed through
one ring (the k and v tiles are in flight while q computes); then per head RMSNorm over
the head dim (Qwen3's QK-norm) and rotate-half RoPE at each row's absolute position
(row t of sequence b sits at positions[b] + t). Qwen3.5's full-attention layers add an
output gate, h @ Wq_gate, a fourth segment of the same ring (the layer multiplies the
attention output by its sigmoid before wo), and rotate only the first
`config.rotary_dim` dims of each head (partial RoPE).

RoPE in the kernel: rotate_half(x) = [-x2, x1] over the rotated dims d is a lane roll by
d/2 (two rolls and a select when d < H) times a sign vector, and cos/sin are computed
from the row positions; no table is read from HBM.

Here: `prologue` (the in-kernel body the fused layer and the megakernel call), its stream
segments, and the stage wrapper `attention_prologue`, whose wq, wk, wv may be stored
quantised (`mk.model.quant.QuantWeight`s: packed tiles streamed, dequantised in VMEM). Not here:
attention itself (`decode_attention`).
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
from mk.model.config import MAX_ROWS, ModelConfig
from mk.kernels.common import BlockSizes, Buffer
from mk.kernels.ring import Ring, ring_buffers
from mk.kernels.stream import TileStream
from mk.kernels.weight_streaming import ring_weights, stage_block, weight_stream
from mk.model.ops import rms_norm, rope_inv_freq
from mk.model.weights import kind_of, layer_rows, names_of, param_shapes

# The token mixer the stage kernels build (Qwen3's attention): its ring weights in order
STAGE_MIXER = ("wq", "wk", "wv", "wo")


def prologue_matrices(config: ModelConfig, kind: str = "gqa") -> list[tuple[str, int, int]]:
    """The ring segments of the prologue, in consumption order: (name, rows, cols), the
    ring weights of `mk.model.weights` before wo of the attention kind `kind` (wq, wk, wv and a
    gated model's wq_gate)."""
    shapes, ring = param_shapes(config), names_of(config, kind, "ring")
    return [(n, *shapes[n][0][1:]) for n in ring if n != "wo"]


def row_positions(positions_smem, batch: int, rows: int):
    """[B*T, 1] int32: the absolute position of each activation row b*T + t."""
    m = lax.broadcasted_iota(jnp.int32, (batch * rows, 1), 0)
    pos = jnp.zeros((batch * rows, 1), jnp.int32)
    for b in range(batch):
        pos = jnp.where(m // rows == b, positions_smem[b] + m % rows, pos)
    return pos


def rope_rows(x, pos, theta: float, dims: int | None = None, yarn=None):
    """Rotate-half RoPE of x [M, H] float32 at positions pos [M, 1] on the first `dims`
    (default all) lanes, the rest passed through (mk.model.ops.rope); with `yarn` (a
    `mk.model.config.Yarn`) each pair's frequency is `mk.model.ops.rope_inv_freq`'s and cos and sin
    are scaled by its attention factor."""
    M, H = x.shape
    d = dims or H
    half = d // 2
    lane = lax.broadcasted_iota(jnp.int32, (M, H), 1)
    if yarn is None:
        exponent = (2 * (lane % half)).astype(jnp.float32) / d
        angle = pos.astype(jnp.float32) / jnp.power(jnp.float32(theta), exponent)
    else:
        inv_freq = rope_inv_freq((lane % half).astype(jnp.float32), d, theta, yarn)
        angle = pos.astype(jnp.float32) * inv_freq
    sign = jnp.where(lane < half, -1.0, 1.0)
    if d == H:  # lane i's partner is i + H/2 mod H
        partner = pltpu.roll(x, half, 1)
    else:  # i + d/2 below d/2, i - d/2 from d/2 on (beyond d: not rotated)
        partner = jnp.where(lane < half, pltpu.roll(x, H - half, 1), pltpu.roll(x, half, 1))
    rotated = lane < d
    cos = jnp.where(rotated, jnp.cos(angle), 1.0)
    sin = jnp.where(rotated, jnp.sin(angle), 0.0)
    if yarn is not None:
        cos, sin = cos * np.float32(yarn.scale), sin * np.float32(yarn.scale)
    return x * cos + partner * sign * sin


def normalise_heads(ref, heads: int, norm, pos, config: ModelConfig):
    """In place on ref [M, heads*H] f32: QK-norm (if the model has it), then RoPE."""
    H = config.head_dim
    for n in range(heads):
        x = ref[:, n * H:(n + 1) * H]
        if norm is not None:
            x = rms_norm(x, norm, config.rms_eps)
        ref[:, n * H:(n + 1) * H] = rope_rows(x, pos, config.rope_theta, config.rotary_dim,
                                              config.yarn)


def prologue(ring: Ring, config: ModelConfig, *, layer, x, attn_norm, q_norm, k_norm,
             positions_smem, batch: int, rows: int, h_vmem, q_vmem, k_vmem, v_vmem,
             gate_vmem=None, biases=None):
    """The prologue of one layer inside a kernel; x [M, D] f32 and the norms are values
    (any norm offset already added: `mk.step.megakernel.prepare`), h_vmem [M, D] is scratch for
    the normed activations; gate_vmem [M, N*H] f32 receives h @ wq_gate when the model
    gates its attention output (None: it has no wq_gate); q_norm, k_norm: None without
    the QK norms; biases: a callable giving the [1, width] biases of q, k and v ("q",
    "k", "v"; gpt-oss's), waited for at first use, or None."""
    h_vmem[...] = rms_norm(x, attn_norm, config.rms_eps,
                           width=config.norm_width).astype(h_vmem.dtype)
    for name, out in (("q", q_vmem), ("k", k_vmem), ("v", v_vmem)):
        ring.matmul(f"w{name}", h_vmem, out, layer=layer)
        if biases is not None:
            out[...] = out[...] + biases(name).astype(jnp.float32)
    if gate_vmem is not None:
        ring.matmul("wq_gate", h_vmem, gate_vmem, layer=layer)
    pos = row_positions(positions_smem, batch, rows)
    normalise_heads(q_vmem, config.heads, q_norm, pos, config)
    normalise_heads(k_vmem, config.kv_heads, k_norm, pos, config)


def layer_mixer(config: ModelConfig, layer: int) -> str:
    """Layer `layer`'s token-mixer kind, by its name in the weight table (`mk.model.weights`:
    the kind whose `KIND_LAYERS` field holds the layer; `mk.kinds.layers.kinds_at` asks
    the same of the kind objects)."""
    return next(kind for field in ("linear_layers", "full_layers")
                if (kind := kind_of(config, field)) and layer in dict(layer_rows(config, kind)))


def check_layer_inputs(config: ModelConfig, x, positions, layer) -> tuple[int, int, int]:
    """(B, T, D) of a layer-level stage's residual stream x [B, T, D]; raises ValueError
    naming a bad shape, row count or layer (one whose token mixer is not `STAGE_MIXER`,
    or a norm offset: the wrappers pass the checkpoint's norms) before anything is
    traced."""
    B, T, D = x.shape
    if D != config.hidden:
        raise ValueError(f"x [B, T, D={D}] does not match hidden={config.hidden}")
    if not 1 <= B * T <= MAX_ROWS:
        raise ValueError(f"B*T={B * T} activation rows must be in [1, {MAX_ROWS}]")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < config.layers:
        raise ValueError(f"layer={layer!r} must be an integer in [0, layers={config.layers})")
    mixer = layer_mixer(config, layer)
    ring = names_of(config, mixer, "ring")
    if ring != STAGE_MIXER or config.norm_offset:
        raise ValueError(f"{config.name}: layer {layer}'s token mixer ({mixer}) streams "
                         f"{ring}, norm_offset={config.norm_offset}: the "
                         f"stage kernels build Qwen3's layer ({', '.join(STAGE_MIXER)}, no "
                         "norm offset); Qwen3.5's and Kimi's layers run in the megakernel")
    if positions.shape != (B,):
        raise ValueError(f"positions shape {positions.shape} must be [B={B}]")
    return B, T, D


def attention_prologue_buffers(config: ModelConfig, M: int, block: BlockSizes,
                               formats=None) -> list[Buffer]:
    """Every VMEM buffer of the stage-02 kernel (the budget and the scratch come from
    here); formats: {family: mk.model.quant scheme} of quantised weights (the ring's slots)."""
    D, dt = config.hidden, config.dtype
    return [Buffer("x", (M, D), "float32", "operand"),
            Buffer("h", (M, D), dt),
            Buffer("q", (M, config.q_width), "float32", "operand"),
            Buffer("k", (M, config.kv_width), "float32", "operand"),
            Buffer("v", (M, config.kv_width), "float32", "operand"),
            *ring_buffers(_stream(config, block, formats), dt)]


def _stream(config: ModelConfig, block: BlockSizes, formats) -> TileStream:
    return weight_stream(block, prologue_matrices(config), formats)


def attention_prologue_kernel(
    # Inputs
    positions_smem,  # [B] int32
    x_vmem,  # [M, D] f32
    attn_norm_vmem,  # [1, D]
    head_norms_vmem,  # {"q_norm", "k_norm": [1, H]}: the layer's QK-norms ({} without)
    wq_hbm,  # [tiles, tile_rows, tile_cols] config dtype (`ring_layout` of [D, N*H]), or
    #          an mk.model.quant.QuantWeight (tile-major)
    wk_hbm,  # [tiles, tile_rows, tile_cols] (of [D, K*H])
    wv_hbm,  # [tiles, tile_rows, tile_cols] (of [D, K*H])
    # Outputs
    q_vmem,  # [M, N*H] f32
    k_vmem,  # [M, K*H] f32
    v_vmem,  # [M, K*H] f32
    # Scratch
    scratch,  # {name: ref} (`attention_prologue_buffers`): h [M, D] config dtype, the
    #           normed activations; the ring's slots (`mk.kernels.ring.ring_buffers`)
    sems,  # DMA [slots]
    *,
    config: ModelConfig,
    stream: TileStream,
    batch: int,
    rows: int,
):
    fetch = {"wq": lambda layer: (wq_hbm, None), "wk": lambda layer: (wk_hbm, None),
             "wv": lambda layer: (wv_hbm, None)}
    s = SimpleNamespace(**scratch)
    ring = Ring.in_scratch(stream, fetch, s, sems, config.dtype)
    ring.prime()
    q_norm, k_norm = (head_norms_vmem[n][...] if n in head_norms_vmem else None
                      for n in ("q_norm", "k_norm"))
    prologue(ring, config, layer=0, x=x_vmem[...], attn_norm=attn_norm_vmem[...],
             q_norm=q_norm, k_norm=k_norm, positions_smem=positions_smem, batch=batch, rows=rows,
             h_vmem=s.h, q_vmem=q_vmem, k_vmem=k_vmem, v_vmem=v_vmem)


def attention_prologue(config: ModelConfig, params, x, positions, *, layer: int = 0,
                       block: BlockSizes | None = None):
    """Layer `layer`'s q [B, T, N, H], k, v [B, T, K, H] (float32; q, k normed and roped).

    x [B, T, D] is the residual stream; positions [B] where each sequence's row 0 sits.
    params' wq, wk, wv: config.dtype arrays, or `mk.model.quant.QuantWeight`s of one scheme
    (`mk.model.quant.quantize`), streamed packed and dequantised in VMEM to config.dtype.
    """
    B, T, D = check_layer_inputs(config, x, positions, layer)
    M = B * T
    weights = {n: jax.tree.map(lambda w: w[layer], params[n]) for n in ("wq", "wk", "wv")}
    formats = quant.formats_of(weights)
    block = block or stage_block(prologue_matrices(config), config.dtype, formats)
    stream = _stream(config, block, formats)
    weights, weight_specs = ring_weights(weights, stream)
    buffers = attention_prologue_buffers(config, M, block, formats)
    H = config.head_dim
    head_norms = {n: params[n][layer][None]
                  for n in names_of(config, layer_mixer(config, layer), "vector")}
    vmem, smem = (pl.BlockSpec(memory_space=s) for s in (pltpu.VMEM, pltpu.SMEM))
    q, k, v = pl.pallas_call(
        functools.partial(attention_prologue_kernel, config=config, stream=stream,
                          batch=B, rows=T),
        out_shape=[jax.ShapeDtypeStruct((M, w), jnp.float32)
                   for w in (config.q_width, config.kv_width, config.kv_width)],
        in_specs=[smem, vmem, vmem, dict.fromkeys(head_norms, vmem), *weight_specs.values()],
        out_specs=[vmem, vmem, vmem],
        scratch_shapes=[{b.name: pltpu.VMEM(b.shape, b.dtype) for b in buffers
                         if b.group != "operand"},
                        pltpu.SemaphoreType.DMA((block.slots,))],
        name="mk_attention_prologue",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * D * (config.q_width + 2 * config.kv_width),
            transcendentals=2 * M * (config.q_width + config.kv_width),
            bytes_accessed=sum(a.nbytes for a in jax.tree.leaves(weights))),
    )(positions.astype(jnp.int32), x.reshape(M, D).astype(jnp.float32),
      params["attn_norm"][layer][None], head_norms,
      *weights.values())
    N, K = config.heads, config.kv_heads
    return q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
