"""The decode megakernel: every layer, the final norm, the lm_head and greedy argmax in one
pallas_call, with one weight ring that runs across layer boundaries.

The step's weights are one `TileStream` (`mk.schedule.decode_stream`): tile g of it lives
in ring slot g mod slots, and consuming tile g issues tile g + slots, so the next layer's
wq tiles load while this layer's MLP computes, and the lm_head's while the last layer's
does. A `lax.fori_loop` over layers runs `layer_body` (stage 05), built from the stage
pieces: prologue, attend, the output projection, SwiGLU or MoE. A model mixing dense and
MoE layers holds both kinds of MLP segments in every layer's period and skips the kind a
layer does not use (its tiles are neither loaded nor computed).

Small per-layer vectors (attn/mlp norms, q/k norms) stay in HBM and are prefetched a
layer ahead into two VMEM slots; each MoE layer's router [D, E] is DMA'd at the layer's
start and waited for just before routing. The final norm is VMEM-resident. Kept outside
the kernel: the embedding gather of the step's B*T tokens (an XLA gather before the call).

The staged debug path: `decode_step(..., taps=True)` also returns the residual stream
after every layer's attention and MLP blocks, the same record `mk.reference.decode_step(...,
taps=True)` returns, and `first_divergence` compares the two op by op up to a
`stop_after=(layer, op)` point and names the first op that differs.

Here: `prepare` (weights in the megakernel's layout, once), `megakernel_buffers`,
`decode_step`, `traced_step`, `first_divergence`, `generate`, `compile_target` (what
`mk.tpu.compile_megakernel` compiles). Not here: the compile-time benchmark
(benchmarks/compile_time.py).

Tensor parallelism is the same kernel with a static `tp` > 1, run inside `jax.shard_map`
on one device's shard (`mk.tensor_parallel` shards the weights and describes the shard as
a smaller `ModelConfig`): an entry barrier, an in-kernel all-reduce after the attention
output projection and after the MLP (`layer_body(..., all_reduce=...)`), and the
cross-shard argmax after the vocab-sharded lm_head (`mk.collectives`). tp=1 adds nothing.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk import backend as backends
from mk import reference
from mk.collectives import (AXIS, COLLECTIVE_IDS, CollectiveScratch, all_reduce_body,
                            argmax_body, barrier, collective_buffers, collective_scratch)
from mk.config import ModelConfig, check_rows, positive_int
from mk.kernels.common import BlockSizes, Buffer, vmem_limit_bytes
from mk.kernels.decode_attention import AttentionScratch
from mk.kernels.one_layer import (layer_block, layer_body, mlp_fetch, mlp_kinds,
                                  one_layer_buffers, scratch_shapes)
from mk.kernels.ring import Ring
from mk.reference import rms_norm
from mk.schedule import decode_stream, padded_vocab

MLP_WEIGHTS = {"dense": ("w_gate", "w_up", "w_down"),
               "moe": ("router", "we_gate", "we_up", "we_down")}
TAPS = ("attn", "mlp")  # where the residual stream is tapped in each layer (debug path)


def prepare(config: ModelConfig, params, block: BlockSizes) -> dict:
    """The megakernel's weights, made once per model: the stacked layer weights as they
    are, the norms stacked in float32, the lm_head [D, V] (embed.T when tied) padded with
    zero columns to whole tiles, and the per-layer MLP tables (kind, stacked row)."""
    V, Vp = config.vocab, padded_vocab(config, block)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    ones = jnp.ones((config.layers, config.head_dim), jnp.float32)
    qk = [params[n] if config.qk_norm else ones for n in ("q_norm", "k_norm")]
    kinds = [config.mlp_index(layer) for layer in range(config.layers)]
    weights = {name: params[name] for name in ("embed", "wq", "wk", "wv", "wo")}
    weights |= {name: params[name] for kind in mlp_kinds(config) for name in MLP_WEIGHTS[kind]}
    return weights | dict(
        lm_head=jnp.pad(head, ((0, 0), (0, Vp - V))),
        norms=jnp.stack([params["attn_norm"], params["mlp_norm"]], 1).astype(jnp.float32),
        qk_norms=jnp.stack(qk, 1).astype(jnp.float32),
        final_norm=params["final_norm"][None].astype(jnp.float32),
        is_moe=jnp.array([kind == "moe" for kind, _ in kinds], jnp.int32),
        mlp_row=jnp.array([row for _, row in kinds], jnp.int32))


def megakernel_buffers(config: ModelConfig, batch: int, rows: int, block: BlockSizes,
                       tp: int = 1) -> list[Buffer]:
    """Every VMEM buffer of the megakernel: the layer kernel's (but its output x_out), the
    two slots of per-layer norms, the final norm, the logits and the next tokens."""
    M = batch * rows
    layer = [b for b in one_layer_buffers(config, mlp_kinds(config), batch, rows, block)
             if b.name != "x_out"]  # the megakernel's residual never leaves the loop
    return layer + [
        Buffer("norms", (2, 2, config.hidden), "float32"),
        Buffer("qk_norms", (2, 2, config.head_dim), "float32"),
        Buffer("final_norm", (1, config.hidden), "float32"),
        Buffer("logits", (M, padded_vocab(config, block)), "float32"),
        Buffer("next_tokens", (M, 1), "int32")] + tp_buffers(M, config.hidden, tp)


def tp_buffers(M: int, D: int, tp: int) -> list[Buffer]:
    """The collectives' VMEM buffers of a tensor-parallel megakernel (none for tp=1): one
    all-reduce of [M, D] (its two slots serve the attention's and the MLP's) and the
    argmax's gather of one (value, id) row per token."""
    if tp == 1:
        return []
    return (collective_buffers("all_reduce", M, D, tp, reduce=True)
            + collective_buffers("argmax", M, 128, tp, reduce=False))


def tp_scratch(M: int, D: int, tp: int) -> list:
    """The pallas scratch of `tp_buffers` with their semaphores (the kernel's last)."""
    if tp == 1:
        return []
    return (collective_scratch(M, D, tp, reduce=True)
            + collective_scratch(M, 128, tp, reduce=False))


def megakernel_kernel(
    # Inputs
    positions_smem,  # [B] int32
    is_moe_smem,  # [L] int32: 1 for an MoE layer
    mlp_row_smem,  # [L] int32: the layer's row in the stacked dense or MoE weights
    x_vmem,  # [M, D] f32: the embedded tokens
    final_norm_vmem,  # [1, D] f32
    norms_hbm,  # [L, 2, D] f32: attn_norm, mlp_norm
    qk_norms_hbm,  # [L, 2, H] f32: q_norm, k_norm
    wq_hbm,  # [L, D, N*H]
    wk_hbm,  # [L, D, K*H]
    wv_hbm,  # [L, D, K*H]
    wo_hbm,  # [L, N*H, D]
    lm_head_hbm,  # [D, Vp]
    *rest,  # the MLP weights of every kind (MLP_WEIGHTS order), k_cache_in, v_cache_in;
    #         outputs next_tokens_vmem [M, 1] int32, logits_vmem [M, Vp] f32, k_cache_hbm,
    #         v_cache_hbm [L, B, K, S, H], with taps taps_vmem [L, 2, M, D] f32; scratch
    #         the layer's (named by `names`), norms_vmem [2, 2, D] f32, qk_norms_vmem
    #         [2, 2, H] f32, vector_sems [2, 2], then the attention scratch
    config: ModelConfig,
    stream,
    names: tuple[str, ...],
    block: BlockSizes,
    batch: int,
    rows: int,
    taps: bool,
    tp: int,
):
    kinds = mlp_kinds(config)
    n_mlp = sum(len(MLP_WEIGHTS[k]) for k in kinds)
    mlp_hbm, rest = rest[:n_mlp], rest[n_mlp + 2:]  # the cache inputs alias the outputs
    n_out = 5 if taps else 4
    next_tokens_vmem, logits_vmem, k_cache_hbm, v_cache_hbm = rest[:4]
    taps_vmem = rest[4] if taps else None
    s = SimpleNamespace(**dict(zip(names, rest[n_out:n_out + len(names)])))
    norms_vmem, qk_norms_vmem, vector_sems = rest[n_out + len(names):n_out + len(names) + 3]
    first = n_out + len(names) + 3
    attention = AttentionScratch(*rest[first:first + len(AttentionScratch._fields)])
    if tp > 1:  # tensor parallel: the collectives' scratch follows (tp_scratch)
        reduce_scratch = CollectiveScratch(*rest[-6:-2])
        argmax_scratch = CollectiveScratch(None, None, *rest[-2:])

    # Layer l's norm vectors live in slot l % 2. Layer l + 1's are issued at layer l's
    # start into the other slot, which layer l - 1 read and no longer needs, and waited for
    # at layer l + 1's start: two slots suffice.
    def vector_copies(layer):
        slot = layer % 2
        return [pltpu.make_async_copy(src.at[layer], dst.at[slot], vector_sems.at[slot, i])
                for i, (src, dst) in enumerate(((norms_hbm, norms_vmem),
                                                (qk_norms_hbm, qk_norms_vmem)))]

    def at_step(w_hbm):
        return lambda step: (w_hbm.at[step], None)

    fetch = dict(wq=at_step(wq_hbm), wk=at_step(wk_hbm), wv=at_step(wv_hbm),
                 wo=at_step(wo_hbm), lm_head=lambda step: (lm_head_hbm, None))
    fetch |= mlp_fetch(kinds, mlp_hbm, s, lambda step: mlp_row_smem[step],
                       lambda step: is_moe_smem[step] == 1)
    if "moe" in kinds:
        s.count_smem[0] = 0  # expert tiles issued before routing are no-ops
        router_hbm = mlp_hbm[-4]
    ring = Ring(stream, fetch, s.ring, s.sems)
    # Named scopes mark the kernel's phases: trace markers on a TPU compiled with
    # --xla_enable_custom_call_region_trace=true (mk.profiling), nothing otherwise.
    with jax.named_scope("prime"):
        ring.prime()
    barrier(tp)  # every peer is in the kernel before the first all-reduce writes to it
    for copy in vector_copies(0):
        copy.start()

    def one_layer(layer, x):
        for copy in vector_copies(layer):
            copy.wait()

        @pl.when(layer + 1 < config.layers)
        def prefetch_next_layer_vectors():
            for copy in vector_copies(layer + 1):
                copy.start()

        is_moe = is_moe_smem[layer] == 1
        router = None
        if "moe" in kinds:
            router = pltpu.make_async_copy(router_hbm.at[mlp_row_smem[layer]], s.router,
                                           s.small_sems.at[0])
            pl.when(is_moe)(router.start)
        norms, qk = norms_vmem[layer % 2], qk_norms_vmem[layer % 2]
        x_out = layer_body(
            ring, config, kinds, s, step=layer, layer=layer, is_moe=is_moe, x=x,
            norms=(norms[0:1], norms[1:2], qk[0:1], qk[1:2]), positions_smem=positions_smem,
            k_cache_hbm=k_cache_hbm, v_cache_hbm=v_cache_hbm, attention=attention,
            block=block, batch=batch, rows=rows,
            before_mlp=None if router is None else (lambda: pl.when(is_moe)(router.wait)),
            all_reduce=None if tp == 1 else (  # slot k: the attention's 0, the MLP's 1
                lambda value, k: all_reduce_body(value, reduce_scratch, n=tp, slot=k)))
        if taps:  # s.attn_out still holds this layer's attention output
            taps_vmem[layer, 0] = x + s.attn_out[...]
            taps_vmem[layer, 1] = x_out
        return x_out

    with jax.named_scope("layers"):
        x = lax.fori_loop(0, config.layers, one_layer, x_vmem[...])
    with jax.named_scope("lm_head"):
        s.h[...] = rms_norm(x, final_norm_vmem[...], config.rms_eps).astype(s.h.dtype)
        ring.matmul("lm_head", s.h, logits_vmem, layer=config.layers)
    logits = logits_vmem[...]
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    first_id = 0 if tp == 1 else lax.axis_index(AXIS) * config.vocab  # this vocab shard's
    next_tokens_vmem[...] = argmax_body(  # ties to the lowest id, on every device
        logits, first_id, None if tp == 1 else argmax_scratch, n=tp,
        valid=vocab < config.vocab)  # not the padding columns


def decode_step(config: ModelConfig, weights, cache: reference.KVCache, tokens, positions,
                *, block: BlockSizes, taps: bool = False):
    """One decode step in one kernel: tokens [B, T] at positions [B] -> (next tokens
    [B, T] int32 (greedy, ties to the lowest id), logits [B, T, V] float32, cache).

    With `taps=True` also returns {"attn", "mlp"}: the residual stream [L, B, T, D] after
    each layer's attention and MLP blocks, as `mk.reference.decode_step(..., taps=True)`.
    """
    tokens, positions = reference.validate_step(config, cache, tokens, positions)
    check_block(block, cache.k.shape[3], tokens.size)
    backends.check_active()
    return traced_step(config, block, weights, cache, tokens, positions, taps=taps)


def first_divergence(config: ModelConfig, params, cache: reference.KVCache, tokens,
                     positions, *, block: BlockSizes | None = None, stop_after=None,
                     rtol: float = 1e-2, backend: str = "auto", weights=None):
    """Run the reference and the megakernel on one step and compare the residual stream
    op by op, in execution order, up to `stop_after=(layer, op)` (op in TAPS; default: the
    last layer's MLP). `weights`: the megakernel's own (default `prepare(config, params,
    block)`), to test a preparation or a planted bug. Returns (the first (layer, op) whose
    max |mk - ref| exceeds rtol times the reference's max |x| there, or None; a list of
    dicts, one per compared op, with layer, op, max_abs_err, scale).

    Both sides round to bf16 in different places, so the tolerance is relative to the
    activations' scale; a wrong weight, mask or position moves the error by orders of
    magnitude more (tests/test_megakernel.py plants one)."""
    layer, op = (config.layers - 1, TAPS[-1]) if stop_after is None else stop_after
    if not (isinstance(layer, int) and 0 <= layer < config.layers and op in TAPS):
        raise ValueError(f"stop_after={stop_after!r} must be (layer, op) with 0 <= layer < "
                         f"layers={config.layers} and op in {TAPS}")
    block = block or layer_block(config)
    _, _, want = reference.decode_step(config, params, cache, tokens, positions, taps=True)
    with backends.use(backend):
        weights = prepare(config, params, block) if weights is None else weights
        *_, got = decode_step(config, weights, cache, tokens, positions, block=block,
                              taps=True)
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


def check_block(block: BlockSizes, context: int, rows: int) -> None:
    """The megakernel's own limits on the tiling and the M = B*T `rows` of a step, checked
    before tracing."""
    check_rows(rows)
    if block.slots < 2:
        raise ValueError(f"BlockSizes.slots={block.slots}: the megakernel's ring needs >= 2 "
                         "slots so a tile loads while another computes")
    block.check_context(context)


def compile_target(config: ModelConfig, block: BlockSizes, weights, k_cache, v_cache,
                   tokens, positions):
    """The traced decode step with no host-side checks: what `mk.tpu` compiles."""
    return traced_step(config, block, weights, reference.KVCache(k_cache, v_cache), tokens,
                        positions)


@functools.partial(jax.jit, static_argnames=("config", "block", "taps", "tp"))
def traced_step(config: ModelConfig, block: BlockSizes, weights, cache, tokens, positions,
                taps: bool = False, tp: int = 1):
    """`decode_step` as traced, with no host-side checks (callers validate first): what
    `generate`'s device loop, `mk.tensor_parallel` (static tp > 1, per device inside
    shard_map) and `compile_target` run."""
    B, T = tokens.shape
    M = B * T
    stream = decode_stream(config, M, block)
    kinds = mlp_kinds(config)
    names, scratch = scratch_shapes(config, kinds, B, T, block)
    mlp = [n for k in kinds for n in MLP_WEIGHTS[k]]
    Vp = padded_vocab(config, block)
    vmem, smem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.VMEM, pltpu.SMEM, pl.ANY))
    n_in = 12 + len(mlp) + 2
    D, H, L = config.hidden, config.head_dim, config.layers
    vectors = [pltpu.VMEM((2, 2, D), jnp.float32), pltpu.VMEM((2, 2, H), jnp.float32),
               pltpu.SemaphoreType.DMA((2, 2))]
    n_layer_scratch = len(names)
    out_shape = (jax.ShapeDtypeStruct((M, 1), jnp.int32),
                 jax.ShapeDtypeStruct((M, Vp), jnp.float32), cache.k, cache.v)
    if taps:
        out_shape += (jax.ShapeDtypeStruct((L, 2, M, D), jnp.float32),)
    weight_bytes = sum(weights[n].size * weights[n].dtype.itemsize
                       for n in ("wq", "wk", "wv", "wo", "lm_head", *mlp))
    x = weights["embed"][tokens].reshape(M, config.hidden).astype(jnp.float32)
    next_tokens, logits, k_cache, v_cache, *tapped = pl.pallas_call(
        functools.partial(megakernel_kernel, config=config, stream=stream,
                          names=tuple(names), block=block, batch=B, rows=T, taps=taps,
                          tp=tp),
        out_shape=out_shape,
        in_specs=[smem] * 3 + [vmem] * 2 + [hbm] * (n_in - 5),
        out_specs=(vmem, vmem, hbm, hbm) + (vmem,) * taps,
        scratch_shapes=(scratch[:n_layer_scratch] + vectors + scratch[n_layer_scratch:]
                        + tp_scratch(M, D, tp)),
        input_output_aliases={n_in - 2: 2, n_in - 1: 3},
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=vmem_limit_bytes(megakernel_buffers(config, B, T, block, tp)),
            **({} if tp == 1 else dict(collective_id=COLLECTIVE_IDS["megakernel"],
                                       has_side_effects=True))),
        name="mk_megakernel",
        cost_estimate=pl.CostEstimate(  # every expert counted: an upper bound for MoE
            flops=2 * M * weight_bytes // weights["wq"].dtype.itemsize, transcendentals=0,
            bytes_accessed=weight_bytes),
    )(positions, weights["is_moe"], weights["mlp_row"], x, weights["final_norm"],
      weights["norms"], weights["qk_norms"], weights["wq"], weights["wk"], weights["wv"],
      weights["wo"], weights["lm_head"], *(weights[n] for n in mlp), cache.k, cache.v)
    out = (next_tokens.reshape(B, T), logits[:, :config.vocab].reshape(B, T, -1),
           reference.KVCache(k_cache, v_cache))
    if taps:
        residual = tapped[0].reshape(L, 2, B, T, D)
        out += ({op: residual[:, i] for i, op in enumerate(TAPS)},)
    return out


@functools.partial(jax.jit, static_argnames=("config", "block", "steps"))
def _greedy_steps(config: ModelConfig, block: BlockSizes, weights, cache, token, position,
                  steps: int):
    """`steps` greedy decode steps in one dispatch: a device-side loop of megakernel calls
    from token [B] at position [B]. Returns (tokens [B, steps], cache)."""
    def step(carry, _):
        cache, token, position = carry
        nxt, _, cache = traced_step(config, block, weights, cache, token[:, None], position)
        return (cache, nxt[:, 0], position + 1), nxt[:, 0]

    (cache, _, _), tokens = lax.scan(step, (cache, token, position), None, length=steps)
    return tokens.T, cache


def check_generate(config: ModelConfig, prompt, steps: int, steps_per_call: int,
                   max_context: int | None):
    """The generate arguments checked before anything is traced -> (prompt as int32, the
    cache capacity S, steps, steps_per_call as ints)."""
    prompt = reference.check_prompt(config, prompt)
    S = config.max_context if max_context is None else max_context
    steps, steps_per_call = positive_int("steps", steps), positive_int("steps_per_call",
                                                                       steps_per_call)
    if prompt.ndim != 2 or prompt.shape[1] + steps - 1 > S:
        raise ValueError(f"prompt {prompt.shape} [B, P] with steps={steps} needs "
                         f"P + steps - 1 <= max_context={S}")
    return prompt, S, steps, steps_per_call


def generate(config: ModelConfig, params, prompt, steps: int, *, backend: str = "auto",
             block: BlockSizes | None = None, max_context: int | None = None,
             steps_per_call: int = 1) -> jax.Array:
    """Greedy decoding with the megakernel: prompt [B, P] -> the next `steps` tokens
    [B, steps] int32, the same contract as `mk.reference.generate`. The prompt is
    prefilled by the XLA reference; every later token comes from one megakernel call, and
    `steps_per_call` of them run per host dispatch (a device-side loop)."""
    prompt, S, steps, steps_per_call = check_generate(config, prompt, steps, steps_per_call,
                                                      max_context)
    block = block or layer_block(config)
    check_block(block, S, prompt.shape[0])
    reference.check_params(config, params)
    weights = prepare(config, params, block)
    logits, cache = reference.prefill(config, params, prompt, max_context=S)
    token = reference.greedy(logits[:, -1])
    out, done = [token[:, None]], 1
    position = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    with backends.use(backend):
        while done < steps:
            n = min(steps_per_call, steps - done)
            tokens, cache = _greedy_steps(config, block, weights, cache, token, position, n)
            out.append(tokens)
            token, position, done = tokens[:, -1], position + n, done + n
    return jnp.concatenate(out, axis=1)
