"""Stage 05, one fused layer: every op of a decoder layer in one pallas_call, one ring.

prologue (norm, Q/K/V, QK-norm, RoPE) -> decode attention over the cache -> output
projection + residual -> norm -> SwiGLU or MoE -> residual. All weights of the layer are
ONE `TileStream` (wq, wk, wv, wo, then w_gate, w_up, w_down or the expert slots), so the
ring never drains between sub-blocks: while attention walks the KV cache, the first tiles
of wo are already in VMEM; while wo computes, the MLP's tiles are in flight. Expert tiles
are the one exception: they can only be issued once the router has chosen (see
`mk.kernels.mlp`).

Here: `layer_matrices` (the stream of one layer), `layer_body` (the in-kernel layer the
megakernel loops over), `one_layer_buffers`, and the stage wrapper `one_layer`. Every
piece is the stage kernels' own: `prologue`, `attend`, `swiglu_body`, `moe_body`.
Not here: the layer loop, the lm_head and the cross-layer ring (`mk.megakernel`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.config import ModelConfig
from mk.kernels.attention_prologue import check_layer_inputs, prologue, prologue_matrices
from mk.kernels.common import BlockSizes, Buffer, default_block, vmem_limit_bytes
from mk.kernels.decode_attention import (AttentionScratch, KvStream, attend,
                                         decode_attention_buffers, decode_attention_scratch)
from mk.kernels.mlp import (expert_slots, moe_body, moe_fetch, moe_segments, swiglu_body,
                            swiglu_fetch, swiglu_segments)
from mk.kernels.ring import Ring, TileStream
from mk.reference import check_positions, rms_norm


def mlp_kinds(config: ModelConfig) -> tuple[str, ...]:
    """The MLP kinds a whole-model kernel must hold: ("dense",), ("moe",) or both."""
    return tuple(k for k, layers in (("dense", config.dense_layers),
                                     ("moe", config.moe_layers)) if layers)


def layer_matrices(config: ModelConfig, kinds: tuple[str, ...], rows: int) -> list:
    """The ring segments of one layer in consumption order, with the MLP segments of every
    kind in `kinds` (a layer of the other kind switches them off); rows = B*T bounds the
    expert slots."""
    matrices = prologue_matrices(config) + [("wo", config.q_width, config.hidden)]
    if "dense" in kinds:
        matrices += swiglu_segments(config.hidden, config.ffn)
    if "moe" in kinds:
        slots = expert_slots(config.experts, config.experts_per_token, rows)
        matrices += moe_segments(config.hidden, config.expert_ffn, slots)
    return matrices


def layer_block(config: ModelConfig, slots: int = 3) -> BlockSizes:
    """Default tiles: the largest square tile every matrix of the layer divides into."""
    dims = [config.hidden, config.q_width, config.kv_width]
    dims += [config.ffn] if config.dense_layers else []
    dims += [config.expert_ffn] if config.moe_layers else []
    return default_block(*dims, slots=slots)


def one_layer_buffers(config: ModelConfig, kinds: tuple[str, ...], batch: int, rows: int,
                      block: BlockSizes) -> list[Buffer]:
    """Every VMEM buffer of a layer kernel holding the MLP `kinds`: the two operands x and
    x_out, then its scratch in kernel order, then the attention scratch."""
    M, D, dt = batch * rows, config.hidden, config.dtype
    f32 = "float32"
    buffers = [Buffer("x", (M, D), f32), Buffer("x_out", (M, D), f32),
               Buffer("ring", (block.slots, block.tile_k, block.tile_n), dt),
               Buffer("h", (M, D), dt), Buffer("q", (M, config.q_width), f32),
               Buffer("k", (M, config.kv_width), f32), Buffer("v", (M, config.kv_width), f32),
               Buffer("o", (M, config.q_width), f32), Buffer("attn_out", (M, D), f32),
               Buffer("mlp_out", (M, D), f32)]
    if "dense" in kinds:
        buffers += [Buffer("gate", (M, config.ffn), f32), Buffer("up", (M, config.ffn), f32)]
    if "moe" in kinds:
        E, Fe = config.experts, config.expert_ffn
        buffers += [Buffer("router", (D, E), dt), Buffer("combine", (M, E), f32),
                    Buffer("selected", (1, E), "int32"), Buffer("e_gate", (M, Fe), f32),
                    Buffer("e_up", (M, Fe), f32), Buffer("down", (M, D), f32)]
    return buffers + decode_attention_buffers(batch, rows, config.heads, config.kv_heads,
                                              config.head_dim, dt, block)


def scratch_shapes(config: ModelConfig, kinds: tuple[str, ...], batch: int, rows: int,
                   block: BlockSizes):
    """(names, pallas scratch shapes) of a layer kernel: the VMEM buffers after the two
    operands, the ring's semaphores, the MoE scalars, then the attention scratch (which the
    kernel wraps as `AttentionScratch`)."""
    own = one_layer_buffers(config, kinds, batch, rows, block)[2:]
    attention = decode_attention_scratch(batch, rows, config.heads, config.kv_heads,
                                         config.head_dim, config.dtype, block)
    own = own[:len(own) - (len(attention) - 2)]
    names = [b.name for b in own] + ["sems"]
    shapes = [pltpu.VMEM(b.shape, b.dtype) for b in own] + [
        pltpu.SemaphoreType.DMA((block.slots,))]
    if "moe" in kinds:
        slots = expert_slots(config.experts, config.experts_per_token, batch * rows)
        names += ["small_sems", "selected_smem", "ids_smem", "count_smem"]
        shapes += [pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1, config.experts), jnp.int32),
                   pltpu.SMEM((slots,), jnp.int32), pltpu.SMEM((1,), jnp.int32)]
    return names, shapes + attention


def mlp_fetch(kinds, mlp_hbm, s, row, is_moe) -> dict:
    """The ring's Fetch callables of the MLP segments. mlp_hbm: the dense weights (w_gate,
    w_up, w_down) and/or the MoE ones (router, we_gate, we_up, we_down), in that order;
    row(step) picks the stacked row; is_moe(step) (mixed models) switches dense off."""
    fetch = {}
    if "dense" in kinds:
        dense_off = (lambda step: ~is_moe(step)) if len(kinds) == 2 else None
        fetch |= swiglu_fetch(*mlp_hbm[:3], row, dense_off)
        mlp_hbm = mlp_hbm[3:]
    if "moe" in kinds:
        fetch |= moe_fetch(*mlp_hbm[1:], row, s.ids_smem, s.count_smem)
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
                 s.small_sems.at[1], s.ids_smem, s.count_smem, s.e_gate, s.e_up, s.down,
                 s.mlp_out, top_k=config.experts_per_token, renormalise=config.norm_topk)

    if kinds == ("dense",):
        dense()
    elif kinds == ("moe",):
        experts()
    else:
        @pl.when(~is_moe)
        def dense_layer():
            dense()
            ring.skip(*_region(ring, step, "we_gate", "we_down"))  # count is 0: all off

        @pl.when(is_moe)
        def moe_layer():
            ring.skip(*_region(ring, step, "w_gate", "w_down"))
            experts()


def layer_body(ring: Ring, config: ModelConfig, kinds, s, *, step, layer, is_moe, x, norms,
               positions_smem, k_cache_hbm, v_cache_hbm, attention: AttentionScratch,
               block: BlockSizes, batch: int, rows: int, before_mlp=None,
               all_reduce=None):
    """One decoder layer inside a kernel: returns the new residual x [M, D] f32.

    step: this layer's index in the ring's stream; layer: its index in the KV cache; s: the
    scratch refs by name; norms: (attn_norm, mlp_norm, q_norm, k_norm) values; is_moe: a
    traced flag for streams holding both MLP kinds; before_mlp: called just before the MLP
    (e.g. to wait for the router's DMA, issued at the layer's start); all_reduce(value,
    k): the tensor-parallel sum over devices of the attention (k=0) and MLP (k=1) outputs.
    """
    attn_norm, mlp_norm, q_norm, k_norm = norms
    # The layer's first KV tiles need only the positions: they load during the prologue.
    KvStream(positions_smem, k_cache_hbm, v_cache_hbm, attention, rows=rows, layer=layer,
             block=block).prime()
    prologue(ring, config, layer=step, x=x, attn_norm=attn_norm, q_norm=q_norm,
             k_norm=k_norm, positions_smem=positions_smem, batch=batch, rows=rows,
             h_vmem=s.h, q_vmem=s.q, k_vmem=s.k, v_vmem=s.v)
    attend(s.q, s.k, s.v, positions_smem, k_cache_hbm, v_cache_hbm, s.o, attention,
           layer=layer, block=block, primed=True)
    ring.matmul("wo", s.o, s.attn_out, layer=step)
    if all_reduce is not None:  # tensor parallel: wo's rows are split, its sums partial
        s.attn_out[...] = all_reduce(s.attn_out[...], 0)
    x = x + s.attn_out[...]
    s.h[...] = rms_norm(x, mlp_norm, config.rms_eps).astype(s.h.dtype)
    if before_mlp is not None:
        before_mlp()
    mlp_block(ring, config, kinds, s, step=step, is_moe=is_moe)
    if all_reduce is not None:
        s.mlp_out[...] = all_reduce(s.mlp_out[...], 1)
    return x + s.mlp_out[...]


def one_layer_kernel(
    # Inputs
    index_smem,  # [2] int32: (layer, its row in the stacked MLP weights)
    positions_smem,  # [B] int32
    x_vmem,  # [M, D] f32 residual stream
    norms_vmem,  # [2, D] f32: attn_norm, mlp_norm of this layer
    qk_norms_vmem,  # [2, H] f32: q_norm, k_norm (ones without QK-norm)
    wq_hbm,  # [L, D, N*H]
    wk_hbm,  # [L, D, K*H]
    wv_hbm,  # [L, D, K*H]
    wo_hbm,  # [L, N*H, D]
    *rest,  # MLP weights (dense: w_gate, w_up, w_down; moe: router, we_gate, we_up,
    #         we_down), k_cache_in, v_cache_in; outputs x_out_vmem, k_cache_hbm,
    #         v_cache_hbm; then the scratch named by `names`
    config: ModelConfig,
    kind: str,
    stream: TileStream,
    names: tuple[str, ...],
    block: BlockSizes,
    batch: int,
    rows: int,
):
    n_mlp = 3 if kind == "dense" else 4
    mlp_hbm, rest = rest[:n_mlp], rest[n_mlp + 2:]  # the cache inputs alias the outputs
    x_out_vmem, k_cache_hbm, v_cache_hbm = rest[:3]
    s = SimpleNamespace(**dict(zip(names, rest[3:3 + len(names)])))
    attention = AttentionScratch(*rest[3 + len(names):])
    layer, row = index_smem[0], index_smem[1]

    def at_layer(w_hbm):
        return lambda step: (w_hbm.at[layer], None)

    fetch = dict(wq=at_layer(wq_hbm), wk=at_layer(wk_hbm), wv=at_layer(wv_hbm),
                 wo=at_layer(wo_hbm))
    fetch |= mlp_fetch((kind,), mlp_hbm, s, lambda step: row, None)
    if kind == "moe":
        router = pltpu.make_async_copy(mlp_hbm[0].at[row], s.router, s.small_sems.at[0])
        router.start()  # waited below, long before the router runs
        s.count_smem[0] = 0  # expert tiles issued before routing are no-ops
    ring = Ring(stream, fetch, s.ring, s.sems)
    ring.prime()
    if kind == "moe":
        router.wait()
    norms = (norms_vmem[0:1, :], norms_vmem[1:2, :], qk_norms_vmem[0:1, :],
             qk_norms_vmem[1:2, :])
    x_out_vmem[...] = layer_body(
        ring, config, (kind,), s, step=0, layer=layer, is_moe=None, x=x_vmem[...],
        norms=norms, positions_smem=positions_smem, k_cache_hbm=k_cache_hbm,
        v_cache_hbm=v_cache_hbm, attention=attention, block=block, batch=batch, rows=rows)


def one_layer(config: ModelConfig, params, x, k_cache, v_cache, positions, *, layer: int,
              block: BlockSizes | None = None):
    """Decoder layer `layer` in one kernel: x [B, T, D] -> (x [B, T, D] float32, k_cache,
    v_cache [L, B, K, S, H] with this layer's new rows written in place)."""
    positions = jnp.asarray(positions, jnp.int32)
    B, T, D = check_layer_inputs(config, x, positions, layer)
    M = B * T
    expected = (config.layers, B, config.kv_heads, k_cache.shape[3], config.head_dim)
    if k_cache.shape != expected or v_cache.shape != expected:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} must be [L, B, K, S, H]="
                         f"{expected}")
    check_positions(positions, T, k_cache.shape[3])
    block = block or layer_block(config)
    block.check_context(k_cache.shape[3])
    kind, row = config.mlp_index(layer)
    stream = TileStream.build(block, layer_matrices(config, (kind,), M))
    names, scratch = scratch_shapes(config, (kind,), B, T, block)
    mlp = (("w_gate", "w_up", "w_down") if kind == "dense"
           else ("router", "we_gate", "we_up", "we_down"))
    ones = jnp.ones((config.head_dim,), jnp.float32)
    qk = [params[n][layer] if config.qk_norm else ones for n in ("q_norm", "k_norm")]
    vmem, smem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.VMEM, pltpu.SMEM, pl.ANY))
    n_in = 9 + len(mlp) + 2
    weight_bytes = sum(params[n][0].size * params[n].dtype.itemsize
                       for n in ("wq", "wk", "wv", "wo"))
    x_out, k_cache, v_cache = pl.pallas_call(
        functools.partial(one_layer_kernel, config=config, kind=kind, stream=stream,
                          names=tuple(names), block=block, batch=B, rows=T),
        out_shape=(jax.ShapeDtypeStruct((M, D), jnp.float32), k_cache, v_cache),
        in_specs=[smem, smem, vmem, vmem, vmem] + [hbm] * (n_in - 5),
        out_specs=(vmem, hbm, hbm),
        scratch_shapes=scratch,
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(
            one_layer_buffers(config, (kind,), B, T, block))),
        name="mk_one_layer",
        cost_estimate=pl.CostEstimate(
            flops=2 * M * weight_bytes // params["wq"].dtype.itemsize, transcendentals=0,
            bytes_accessed=weight_bytes),
    )(jnp.array([layer, row], jnp.int32), positions, x.reshape(M, D).astype(jnp.float32),
      jnp.stack([params["attn_norm"][layer], params["mlp_norm"][layer]]).astype(jnp.float32),
      jnp.stack(qk).astype(jnp.float32), params["wq"], params["wk"], params["wv"],
      params["wo"], *(params[n] for n in mlp), k_cache, v_cache)
    return x_out.reshape(B, T, D), k_cache, v_cache
