"""Stage 05b, one gated-DeltaNet layer's decode step: B sequences x T rows against a
recurrent state and a conv state that live in HBM.

Here: `linear_mixer`, the layer's token mixer as one in-kernel body (run by the stage
kernel `gated_deltanet` on one layer and by the megakernel on every linear layer), its
parts (the gates, the conv, the head blocks, the gated norm), buffers (`linear_buffers`,
`gated_deltanet_buffers`, `linear_scratch`), the gates of each linear kind (`HEAD_GATES`,
`CHANNEL_GATES`, `BOUNDED_GATES`; by kind name `GATES`), `linear_weights`,
`linear_layer_shapes`, `linear_layers`, `linear_gates` and `decay_width`. Not here: the
delta rule and its state copies (`mk.kinds.linear.delta_rule`), the MLP after the layer (stage
04), the kind objects (`mk.kinds.linear.kinds`), the megakernel's mixed layer stream
(`mk.step.megakernel`), the sharding of heads (`mk.step.tensor_parallel`). The layer step by step,
KDA's changes, what is issued a layer ahead and why: docs/design/mk.kinds.linear.deltanet.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model import linear_attention as la
from mk.model.config import LANES, ModelConfig, check_rows
from mk.kernels.common import (BlockSizes, Buffer, memory_specs, start_dma, transposed_dot,
                               vmem_limit_bytes)
from mk.kinds.linear.delta_rule import ALIGN, StateCopies, delta_rule_body
from mk.kernels.ring import Ring, plain_ring, ring_layout
from mk.kernels.stream import TileStream
from mk.kernels.weight_streaming import stage_block
from mk.model.ops import exact, rms_norm
from mk.model.weights import dma_laid_out, dma_layout, kind_of, layer_rows, names_of, param_shapes

F32 = jnp.float32


# -- The whole layer: stage 05b ------------------------------------------------------------
# A linear layer's weights are its kind's rows of `mk.model.weights` (`linear_weights`): the
# ring streams the matrices with D rows or columns (in_proj_qkv, in_proj_z, out_proj); the
# narrow ones come whole by their own DMA at the layer's start, in table order: in_proj_b
# and in_proj_a ([D, Nv], Nv = 48 lanes in the 27B: narrower than a ring tile, as a MoE
# router is), the conv taps, A_log, dt_bias and the gated norm's weight (`Kind.prepare`
# gives the vectors a [1, n] row each). Kimi Delta Attention has no in_proj_z and no
# in_proj_a: its forget gate (one decay per key channel) and its output gate are low-rank
# pairs, D -> Hk -> Nv*Hk and D -> Hv -> Nv*Hv, whose rank (128) is narrower than a ring
# tile can be, so the four come by DMA as in_proj_b does.
# The layer's states: read (HBM [Ll, B, ...]) and their row states written (HBM
# [Ll, B, T, ...]), by name.
STATE_INPUTS = ("conv_state", "state")
STATE_OUTPUTS = ("conv_rows", "state_rows")


def linear_weights(config: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ring segments, weights brought by their own DMA) of `config`'s linear layers (the
    gated DeltaNet's or KDA's rows of `mk.model.weights`, in table order; empty without linear
    layers)."""
    kind = kind_of(config, "linear_layers")
    return names_of(config, kind, "ring"), names_of(config, kind, "dma")


def linear_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One linear layer's weights by name, ring segments first, each shape without the
    stacked layer axis (`mk.model.weights.param_shapes`): the one count of a linear layer's weights
    the plan, the simulator and the stage kernel's cost estimate read."""
    shapes = param_shapes(config)
    return {n: shapes[n][0][1:] for group in linear_weights(config) for n in group}


def gated_deltanet_matrices(config: ModelConfig) -> list[tuple[str, int, int]]:
    """The ring segments of one linear layer (gated DeltaNet or KDA), in consumption order,
    as (name, rows, columns) (the rest of its weights come by DMA: `linear_weights`)."""
    shapes = linear_layer_shapes(config)
    return [(n, *shapes[n]) for n in linear_weights(config)[0]]


@dataclasses.dataclass(frozen=True)
class Gates:
    """What differs between the linear kinds in `linear_mixer`, held by the kind
    (`mk.kinds.linear.kinds.DeltaNet.gates`: `HEAD_GATES`; `KDA`'s: `CHANNEL_GATES`;
    `BoundedKDA`'s: `BOUNDED_GATES`). compute(ring, config, ls, h_vmem, h, landed, step)
    fills ls.decay, ls.beta and ls.z (landed: the layer's DMA'd weights by name);
    decay(ls, b, head, rows): row t -> the factor that
    decays sequence b's state of head `head`; smem: the [M, Nv] gates copied to SMEM;
    blocks: extra [B, Nv, R, Hk] blocks beside q and k (ls.decay's per-key-channel
    columns); output_gate: the gated norm's gate of z."""

    compute: Callable
    decay: Callable
    smem: tuple[str, ...]
    blocks: tuple[str, ...]
    output_gate: Callable


def decay_width(config: ModelConfig) -> int:
    """A row's decays: one per value head (the gated DeltaNet's Nv) or per key channel
    (KDA's Nv*Hk), the width of dt_bias (added to the decay's pre-activation) in the
    weight table."""
    return linear_layer_shapes(config)["lin_dt_bias"][-1]


def linear_buffers(config: ModelConfig, gates: Gates, batch: int, rows: int, *,
                   layers: int = 2) -> list[Buffer]:
    """The VMEM scratch of `linear_mixer` (group "linear", names "linear.<field>"): the
    weights brought by DMA (`linear_weights`, each as `mk.model.weights.dma_layout` lays it
    out), the gates, the
    projections (z: the gated DeltaNet's z or KDA's output gate), the conv window and row
    states, the delta rule's blocks (and the kind's `Gates.blocks`: KDA's per-channel
    decays); the recurrent state: two slots of one sequence's state in, two of its T row
    states out. The DMA'd weights and the conv state have `layers` slots (linear row r's
    in slot r % layers): 2 in a kernel of several linear layers (the next one's load while
    this one computes), 1 in the one-layer stage kernel."""
    M, T, R = batch * rows, rows, -(-rows // ALIGN) * ALIGN
    C, W, dt = config.conv_channels, config.conv_kernel, config.dtype
    Vw = config.linear_value_width
    Nv, Hk, Hv = config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    f32 = "float32"
    shapes = linear_layer_shapes(config)
    fields = [(n, (layers, *layout), dtype) for n in linear_weights(config)[1]
              for layout, dtype in [dma_layout(n, shapes[n], dt)]]
    fields += [("decay", (M, decay_width(config)), f32),
               ("beta", (M, Nv), f32),
               ("qkv", (M, C), f32), ("z", (M, Vw), f32), ("o", (M, Vw), f32),
               ("conv_state", (layers, batch, W - 1, C), dt),
               ("window", (batch, W - 1 + T, C), f32),
               ("conv_rows", (batch, T, W - 1, C), dt),
               ("q", (batch, Nv, R, Hk), f32), ("k", (batch, Nv, R, Hk), f32),
               ("v", (batch, Nv, R, Hv), f32), ("heads", (batch, Nv, R, Hv), f32),
               ("state", (2, Nv, Hk, Hv), f32), ("state_rows", (2, T, Nv, Hk, Hv), f32)]
    fields += [(name, (batch, Nv, R, Hk), f32) for name in gates.blocks]
    return [Buffer(f"linear.{name}", shape, dtype, "linear") for name, shape, dtype in fields]


def linear_scratch(config: ModelConfig, gates: Gates, batch: int, rows: int, *,
                   layers: int = 2) -> dict:
    """The Pallas scratch of `linear_mixer` by field name: `linear_buffers` (`layers` as
    there) in VMEM and its `linear_semaphores`."""
    vmem = {b.name.removeprefix("linear."): pltpu.VMEM(b.shape, b.dtype)
            for b in linear_buffers(config, gates, batch, rows, layers=layers)}
    return vmem | linear_semaphores(config, gates, batch, rows, layers=layers)


def linear_semaphores(config: ModelConfig, gates: Gates, batch: int, rows: int, *,
                      layers: int = 2) -> dict:
    """`linear_mixer`'s scratch outside VMEM by field name: the gates' `Gates.smem` in
    SMEM and the DMA semaphores (`layers` slots of the small loads, as `linear_buffers`')."""
    M, Nv = batch * rows, config.linear_value_heads
    return {f"{n}_smem": pltpu.SMEM((M, Nv), F32) for n in gates.smem} | dict(
        load_sems=pltpu.SemaphoreType.DMA((2,)), store_sems=pltpu.SemaphoreType.DMA((2,)),
        # per slot: the weights' DMAs, then the conv state in (`layer_loads`)
        small_sems=pltpu.SemaphoreType.DMA((layers, len(linear_weights(config)[1]) + 1)),
        # the conv rows out, the gates to SMEM
        out_sems=pltpu.SemaphoreType.DMA((1 + len(gates.smem),)))


def linear_layers(config: ModelConfig) -> tuple[int, ...]:
    """`config`'s linear layers, in order (its linear kind's rows of `mk.model.weights`; none
    without linear layers)."""
    kind = kind_of(config, "linear_layers")
    return tuple(layer for layer, _ in layer_rows(config, kind)) if kind else ()


def gated_deltanet_buffers(config: ModelConfig, batch: int, rows: int,
                           block: BlockSizes) -> list[Buffer]:
    """Every VMEM buffer of the stage-05b kernel (the budget and the scratch come from
    here): its operands, the normed rows, the ring and `linear_buffers` (of the model's
    linear kind's `Gates`)."""
    M, D, dt = batch * rows, config.hidden, config.dtype
    return [Buffer("x", (M, D), "float32", "operand"),
            Buffer("out", (M, D), "float32", "operand"),
            Buffer("h", (M, D), dt),
            plain_ring(block, dt),
            *linear_buffers(config, linear_gates(config), batch, rows, layers=1)]


def gates_body(h, lin_b, lin_a, a_log, dt_bias):
    """(decay = exp(g), beta) [M, Nv] f32 of the normed rows h [M, D]: beta = sigmoid(h b),
    g = -exp(A_log) softplus(h a + dt_bias) (mk.model.linear_attention.linear_attention); lin_b
    and lin_a held transposed, [Nv, D]."""
    beta = jax.nn.sigmoid(transposed_dot(h, lin_b))
    g = -jnp.exp(a_log.astype(F32)) * jax.nn.softplus(transposed_dot(h, lin_a)
                                                      + dt_bias.astype(F32))
    return jnp.exp(g), beta


def low_rank(h, a, b):
    """h [M, D] @ a [D, r] @ b [r, n] f32, each product's input rounded to its weight's
    dtype (mk.model.ops.matmul twice)."""
    h = h.astype(a.dtype)
    inner = jnp.dot(h, a, precision=exact(h, a), preferred_element_type=F32).astype(b.dtype)
    return jnp.dot(inner, b, precision=exact(inner, b), preferred_element_type=F32)


def kda_gates_body(h, lin_b, f_a, f_b, a_log, dt_bias, decay_vmem, bound: float = 0.0):
    """KDA's gates of the normed rows h [M, D]: decay_vmem [M, Nv*Hk] f32 <- exp(g), one
    per key channel, g of exp(A_log[head]) and h f_a f_b + dt_bias: Kimi Linear's, or
    under Kimi K3's `bound` < 0 (`mk.model.linear_attention.kda_log_decay`); returns beta =
    sigmoid(h b) [M, Nv] (mk.model.linear_attention.kimi_delta_attention; lin_b held transposed,
    [Nv, D])."""
    Nv = a_log.shape[1]
    Hk = decay_vmem.shape[1] // Nv
    forget = low_rank(h, f_a, f_b) + dt_bias.astype(F32)
    rate = jnp.exp(a_log.astype(F32))
    for j in range(Nv):  # static lane slices: head j's Hk channels
        lanes = slice(j * Hk, (j + 1) * Hk)
        decay_vmem[:, lanes] = jnp.exp(la.kda_log_decay(rate[:, j:j + 1], forget[:, lanes],
                                                        bound))
    return jax.nn.sigmoid(transposed_dot(h, lin_b))


def channel_column(row):
    """row [1, n] -> the same values as a column [n, 1] (a per-channel decay that scales
    the state's rows), exactly: the diagonal of the broadcast row, summed over lanes."""
    n = row.shape[1]
    diagonal = (lax.broadcasted_iota(jnp.int32, (n, n), 0)
                == lax.broadcasted_iota(jnp.int32, (n, n), 1))
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=1, keepdims=True)


def deltanet_gates(ring: Ring, config: ModelConfig, ls, h_vmem, h, landed, step) -> None:
    """The gated DeltaNet's gates (`Gates.compute`): z = h @ in_proj_z through the ring
    (the first out_proj tiles load meanwhile), then decay and beta (`gates_body`) from the
    DMA'd in_proj_b and in_proj_a."""
    ring.matmul("lin_z", h_vmem, ls.z, layer=step)
    ls.decay[...], ls.beta[...] = gates_body(
        h, *landed("lin_b", "lin_a", "lin_a_log", "lin_dt_bias"))


def kda_gates(ring: Ring, config: ModelConfig, ls, h_vmem, h, landed, step) -> None:
    """KDA's gates (`Gates.compute`), from its DMA'd low-rank pairs while the ring brings
    lin_out's first tiles: the per-channel decays and beta (`kda_gates_body`), and the
    output gate's z = h g_a g_b."""
    ls.beta[...] = kda_gates_body(h, *landed("lin_b", "kda_f_a", "kda_f_b", "lin_a_log",
                                             "lin_dt_bias"), ls.decay)
    ls.z[...] = low_rank(h, *landed("kda_g_a", "kda_g_b"))


def bounded_kda_gates(ring: Ring, config: ModelConfig, ls, h_vmem, h, landed,
                      step) -> None:
    """Kimi K3's KDA gates (`Gates.compute`): the full-rank output gate z = h @ kda_g
    through the ring (lin_out's first tiles load meanwhile), then from the DMA'd weights
    beta and the per-channel decays under config.kda_gate_bound (`kda_gates_body`)."""
    ring.matmul("kda_g", h_vmem, ls.z, layer=step)
    ls.beta[...] = kda_gates_body(h, *landed("lin_b", "kda_f_a", "kda_f_b", "lin_a_log",
                                             "lin_dt_bias"), ls.decay,
                                  bound=config.kda_gate_bound)


def scalar_decay(ls, b: int, head, rows: int):
    """`Gates.decay` of a decay per head: row t's scalar, from SMEM."""
    return lambda t: ls.decay_smem[b * rows + t, head]


def column_decay(ls, b: int, head, rows: int):
    """`Gates.decay` of a decay per key channel: row t's [Hk] decays (head `head`'s block,
    `head_blocks`) as the column that scales the state's rows."""
    decays = ls.decays[b, head]  # [R, Hk]
    return lambda t: channel_column(decays[t:t + 1])


HEAD_GATES = Gates(deltanet_gates, scalar_decay, smem=("decay", "beta"), blocks=(),
                   output_gate=jax.nn.silu)
CHANNEL_GATES = Gates(kda_gates, column_decay, smem=("beta",), blocks=("decays",),
                      output_gate=jax.nn.sigmoid)
BOUNDED_GATES = dataclasses.replace(CHANNEL_GATES, compute=bounded_kda_gates)
# Each linear kind's gates by its name in the weight table (`mk.model.weights.kinds_of`); the
# kinds hold the same objects (`mk.kinds.linear.kinds.DeltaNet.gates`, a test keeps them equal).
GATES = {"deltanet": HEAD_GATES, "kda": CHANNEL_GATES, "bounded_kda": BOUNDED_GATES}


def linear_gates(config: ModelConfig) -> Gates | None:
    """`config`'s linear kind's `Gates` (None without linear layers)."""
    return GATES.get(kind_of(config, "linear_layers"))


def conv_state_after(window_vmem, b: int, t: int, taps: int):
    """Sequence b's conv state after its row t: the W-1 newest inputs, window rows t+1..t+W-1
    (the window holds the W-1 remembered rows, then the T new ones)."""
    return window_vmem[b, t + 1:t + taps]


def conv_body(qkv_vmem, conv_vmem, weight, window_vmem, conv_rows_vmem, *, batch: int,
              rows: int):
    """In place on qkv_vmem [M, C] f32: SiLU(depthwise causal conv) of each sequence's T rows
    after its remembered W-1 (conv_vmem [B, W-1, C]); conv_rows_vmem[b, t] <- the conv
    state after row t. The conv input is rounded to the cache dtype first (it is what the
    state stores; `mk.model.linear_attention.causal_conv`)."""
    T, W, dt = rows, weight.shape[0], conv_vmem.dtype
    w = weight.astype(F32)
    for b in range(batch):  # static: every row offset below is a constant
        window_vmem[b, :W - 1] = conv_vmem[b].astype(F32)
        window_vmem[b, W - 1:] = qkv_vmem[b * T:(b + 1) * T].astype(dt).astype(F32)
        out = sum(window_vmem[b, j:j + T] * w[j:j + 1] for j in range(W))
        qkv_vmem[b * T:(b + 1) * T] = jax.nn.silu(out)
        for t in range(T):
            conv_rows_vmem[b, t] = conv_state_after(window_vmem, b, t, W).astype(dt)


def head_blocks(mixed_vmem, q_vmem, k_vmem, v_vmem, *, config: ModelConfig, batch: int,
                rows: int, decays=None):
    """[M, C] rows (q | k | v channels, after the conv) -> the delta rule's per-(sequence,
    value head) blocks [B, Nv, R, H], q and k L2-normalised per key head, q / sqrt(Hk); key
    head j serves value heads j*G .. j*G + G-1 (G = Nv / Nk). decays: KDA's (decay [M,
    Nv*Hk], blocks [B, Nv, R, Hk]) refs, its per-channel decays blocked the same way. Rows
    >= T stay zero."""
    T, Nv, Hk, Hv = rows, config.linear_value_heads, config.linear_key_dim, \
        config.linear_value_dim
    G, kw = Nv // config.linear_key_heads, config.linear_key_width
    for ref in (q_vmem, k_vmem, v_vmem) + (() if decays is None else decays[1:]):
        ref[...] = jnp.zeros(ref.shape, F32)

    def head(h, carry):
        key = pl.multiple_of((h // G) * Hk, LANES)
        value = pl.multiple_of(2 * kw + h * Hv, LANES)
        for b in range(batch):
            m = slice(b * T, (b + 1) * T)
            q = la.l2norm(mixed_vmem[m, pl.ds(key, Hk)]) / np.float32(np.sqrt(Hk))
            q_vmem[b, h, :T] = q
            k_vmem[b, h, :T] = la.l2norm(mixed_vmem[m, pl.ds(kw + key, Hk)])
            v_vmem[b, h, :T] = mixed_vmem[m, pl.ds(value, Hv)]
            if decays is not None:  # KDA: Nk = Nv, so head h's channels are key's
                decays[1][b, h, :T] = decays[0][m, pl.ds(key, Hk)]
        return carry

    lax.fori_loop(0, Nv, head, 0)


def gated_norm_rows(heads_vmem, z_vmem, o_vmem, norm, *, batch: int, rows: int, eps: float,
                    gate=jax.nn.silu):
    """o_vmem [M, Nv*Hv] <- RMSNorm(head output) * norm * gate(z), per value head, from the
    delta rule's blocks heads_vmem [B, Nv, R, Hv] (rows >= T ignored); gate: SiLU (the
    gated DeltaNet) or sigmoid (KDA)."""
    T, Nv, Hv = rows, heads_vmem.shape[1], heads_vmem.shape[3]

    def head(h, carry):
        lanes = pl.ds(pl.multiple_of(h * Hv, LANES), Hv)
        for b in range(batch):
            o_vmem[b * T:(b + 1) * T, lanes] = heads_vmem[b, h, :T]
        o_vmem[:, lanes] = la.gated_rms_norm(o_vmem[:, lanes], z_vmem[:, lanes], norm, eps,
                                             gate)
        return carry

    lax.fori_loop(0, Nv, head, 0)


def linear_mixer(ring: Ring, config: ModelConfig, gates: Gates, ls, hbm: dict, *, step, row,
                 x, attn_norm, h_vmem, out_vmem, batch: int, rows: int):
    """One linear layer's token mixer inside a kernel (the gated DeltaNet, or KDA: its
    kind's `gates`): out_vmem [M, D] f32 <- out_proj(GatedNorm(DeltaRule(conv(qkv)))) of
    RMSNorm(x) (no residual), and the layer's conv and recurrent states after each row
    written to HBM.

    step: the layer's index in the ring's stream; row: its row in the stacked linear
    weights and states (traced); x [M, D] f32 and attn_norm [1, D] (any norm offset added)
    are values; ls: `linear_scratch` by field name; hbm: HBM refs by name, the DMA'd
    weights (`linear_weights`) [Ll, ...], STATE_INPUTS [Ll, B, ...] and STATE_OUTPUTS
    [Ll, B, T, ...]. What does not depend on this step's activations (the DMA'd weights, the
    conv state, the first sequence's state) was issued by the linear layer before (or
    `prime_linear`, at the kernel's start), so it has landed behind the weight tiles; this
    layer issues the next linear layer's at its start, and leaves its conv rows and row
    states in flight (waited for by the next linear layer, or `drain_linear`). KDA's gates
    come from its DMA'd low-rank pairs while the ring brings lin_out's first tiles (the
    gated DeltaNet's while it brings them behind lin_z, Kimi K3's behind kda_g)."""
    copies = state_copies(ls, hbm)
    slot, rows_total = row % ls.conv_state.shape[0], hbm["state"].shape[0]
    small = layer_loads(config, ls, hbm, row)

    @pl.when(row + 1 < rows_total)
    def prefetch_next_linear_layer():  # into the other slot, which row - 1 no longer needs
        start_layer_loads(config, ls, hbm, row + 1)

    def landed(*names):
        for name in names:
            small[name].wait()
        return [getattr(ls, name)[slot] for name in names]

    h_vmem[...] = rms_norm(x, attn_norm, config.rms_eps,
                           width=config.norm_width).astype(h_vmem.dtype)
    ring.matmul("lin_qkv", h_vmem, ls.qkv, layer=step)
    gates.compute(ring, config, ls, h_vmem, h_vmem[...], landed, step)
    to_smem = [pltpu.make_async_copy(getattr(ls, n), getattr(ls, f"{n}_smem"),
                                     ls.out_sems.at[1 + i])
               for i, n in enumerate(gates.smem)]
    for copy in to_smem:
        copy.start()

    (conv_weight,) = landed("lin_conv")
    small["conv_state"].wait()

    @pl.when(row > 0)
    def free_conv_rows():  # the row before sent them from this buffer
        conv_rows_out(ls, hbm, row - 1).wait()

    conv_body(ls.qkv, ls.conv_state.at[slot], conv_weight, ls.window, ls.conv_rows, batch=batch,
              rows=rows)
    start_dma(conv_rows_out(ls, hbm, row), "conv_rows",
              ls.conv_rows.size * ls.conv_rows.dtype.itemsize)
    blocks = [getattr(ls, name) for name in gates.blocks]
    head_blocks(ls.qkv, ls.q, ls.k, ls.v, config=config, batch=batch, rows=rows,
                decays=(ls.decay, *blocks) if blocks else None)

    for copy in to_smem:
        copy.wait()

    def scalars(b, h):
        return gates.decay(ls, b, h, rows), lambda t: ls.beta_smem[b * rows + t, h]

    delta_rule_body(ls.q, ls.k, ls.v, scalars, ls.heads, copies, rows=rows, row=row)
    (norm,) = landed("lin_norm")
    gated_norm_rows(ls.heads, ls.z, ls.o, norm, batch=batch, rows=rows, eps=config.rms_eps,
                    gate=gates.output_gate)
    ring.matmul("lin_out", ls.o, out_vmem, layer=step)


def state_copies(ls, hbm: dict) -> StateCopies:
    """The recurrent states' stream over every linear layer (`StateCopies`)."""
    return StateCopies(hbm["state"], hbm["state_rows"], ls.state, ls.state_rows,
                       ls.load_sems, ls.store_sems)


def layer_loads(config: ModelConfig, ls, hbm: dict, row) -> dict:
    """Linear row `row`'s own loads into its slot (row % the slots of `linear_buffers`) by
    name, each into the VMEM buffer of its name: its DMA'd weights (`linear_weights`) and
    its conv state."""
    slot = row % ls.conv_state.shape[0]
    names = linear_weights(config)[1] + ("conv_state",)
    return {n: pltpu.make_async_copy(hbm[n].at[row], getattr(ls, n).at[slot],
                                     ls.small_sems.at[slot, i]) for i, n in enumerate(names)}


def start_layer_loads(config: ModelConfig, ls, hbm: dict, row) -> None:
    for name, copy in layer_loads(config, ls, hbm, row).items():
        ref = getattr(ls, name)  # the conv state counts as "conv_load" (a state read)
        start_dma(copy, "conv_load" if name == "conv_state" else name,
                  ref.size // ref.shape[0] * ref.dtype.itemsize)


def conv_rows_out(ls, hbm: dict, row):
    """Linear row `row`'s conv states after each row, VMEM -> HBM."""
    return pltpu.make_async_copy(ls.conv_rows, hbm["conv_rows"].at[row], ls.out_sems.at[0])


def prime_linear(config: ModelConfig, ls, hbm: dict) -> None:
    """At a kernel's start: the first linear layer's weights, conv state and first state
    (every later linear layer's are issued by the one before it: `linear_mixer`)."""
    start_layer_loads(config, ls, hbm, 0)
    state_copies(ls, hbm).start_load(0)


def drain_linear(ls, hbm: dict) -> None:
    """At a kernel's end: wait for the last linear layer's conv rows and the last row
    states `linear_mixer` left in flight."""
    conv_rows_out(ls, hbm, hbm["state"].shape[0] - 1).wait()
    state_copies(ls, hbm).drain()


def gated_deltanet_kernel(inputs, outputs, *, config: ModelConfig, gates: Gates,
                          stream: TileStream, batch: int, rows: int, h_vmem, ring_vmem, sems,
                          linear):
    """inputs: x [M, D] f32, attn_norm [1, D] f32 (VMEM), the ring's weights and the
    DMA'd ones (`linear_weights`) and STATE_INPUTS (HBM, the one layer's, [1, ...]);
    outputs: out [M, D] f32 (x + the mixer), STATE_OUTPUTS (HBM, [1, ...]); scratch: h, the
    ring and its sems,
    `linear_scratch` as `linear`."""
    row = 0
    fetch = {n: (lambda layer, n=n: (inputs[n].at[row], None))
             for n in linear_weights(config)[0]}
    ring = Ring(stream, fetch, {"ring": ring_vmem}, sems)
    ring.prime()
    ls, hbm = SimpleNamespace(**linear), inputs | outputs
    prime_linear(config, ls, hbm)
    x = inputs["x"][...]
    linear_mixer(ring, config, gates, ls, hbm, step=0, row=row, x=x,
                 attn_norm=inputs["attn_norm"][...], h_vmem=h_vmem, out_vmem=outputs["out"],
                 batch=batch, rows=rows)
    drain_linear(ls, hbm)
    outputs["out"][...] = x + outputs["out"][...]


def check_conv_kernel(config: ModelConfig) -> None:
    """The kernels keep a conv state of W-1 rows (DMA'd, windowed, returned per row); W = 1
    (a conv with no state) is not built: raises NotImplementedError before tracing when
    the model has conv taps (a linear kind's lin_conv)."""
    if "lin_conv" in param_shapes(config) and config.conv_kernel < 2:
        raise NotImplementedError(f"{config.name}: conv_kernel={config.conv_kernel}: the "
                                  "linear-attention kernels keep a conv state of conv_kernel "
                                  "- 1 rows and need conv_kernel >= 2 (mk.model.reference runs "
                                  "conv_kernel=1)")


def check_linear_layer(config: ModelConfig, x, conv_state, state, layer) -> tuple[int, int]:
    """(B, T) of a linear layer step of `config`; raises ValueError naming a bad shape,
    row count or layer (or a model without linear layers) before anything is traced."""
    layers = linear_layers(config)
    if not layers:
        raise ValueError(f"{config.name} has no linear layers (layer_types="
                         f"{config.layer_types})")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in layers:
        raise ValueError(f"layer={layer!r} must be one of the linear layers {layers}")
    check_conv_kernel(config)
    B, T, D = x.shape
    if D != config.hidden:
        raise ValueError(f"x [B, T, D={D}] does not match hidden={config.hidden}")
    check_rows(B, T)
    Nv, Hk, Hv = config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    want = {"conv_state": (B, config.conv_kernel - 1, config.conv_channels),
            "state": (B, Nv, Hk, Hv)}
    for name, array in (("conv_state", conv_state), ("state", state)):
        if array.shape != want[name]:
            raise ValueError(f"{name} shape {array.shape} must be {want[name]}")
    if Hk % LANES or Hv % LANES:
        raise ValueError(f"head dims linear_key_dim={Hk}, linear_value_dim={Hv} must be "
                         f"multiples of {LANES} on TPU")
    return B, T


def gated_deltanet(config: ModelConfig, params, x, conv_state, state, *, layer: int,
                   block: BlockSizes | None = None):
    """One linear layer's decode step (the gated DeltaNet or Kimi Delta Attention: the
    model's linear kind and its `Gates`) for B sequences x T rows, up to the residual:
    x + out_proj(GatedNorm(DeltaRule(conv(qkv)))) (mk.model.reference.linear_decoder_layer's
    x after the mixer; the MLP is stage 04's).

    x [B, T, D] f32; conv_state [B, W-1, C] (config.dtype) and state [B, Nv, Hk, Hv] f32
    are the layer's states before row 0. Returns (x [B, T, D] float32, conv states
    [B, T, W-1, C] and recurrent states [B, T, Nv, Hk, Hv] after each row: a verifier that
    accepts k rows keeps row k-1's).
    """
    B, T = check_linear_layer(config, x, conv_state, state, layer)
    M, D, i = B * T, config.hidden, linear_layers(config).index(layer)
    gates = linear_gates(config)
    C, W, Vw = config.conv_channels, config.conv_kernel, config.linear_value_width
    Nv, Hk, Hv = config.linear_value_heads, config.linear_key_dim, config.linear_value_dim
    dt = jnp.dtype(config.dtype)
    block = block or stage_block(gated_deltanet_matrices(config), dt)
    stream = TileStream.build(block, gated_deltanet_matrices(config))
    segments, dmas = linear_weights(config)
    layer_params = {n: params[n][i:i + 1] for n in segments + dmas}
    inputs = dict(x=x.reshape(M, D).astype(F32),
                  attn_norm=(params["attn_norm"][layer].astype(F32) + config.norm_offset)[None],
                  conv_state=conv_state.astype(dt)[None], state=state.astype(F32)[None])
    laid_out = {n: dma_laid_out(n, layer_params[n]) for n in dmas}  # vectors as [1, 1, n]
    inputs |= ring_layout({n: layer_params[n] for n in segments}, stream)
    inputs |= laid_out
    outputs = dict(out=jax.ShapeDtypeStruct((M, D), F32),
                   conv_rows=jax.ShapeDtypeStruct((1, B, T, W - 1, C), dt),
                   state_rows=jax.ShapeDtypeStruct((1, B, T, Nv, Hk, Hv), F32))
    spaces = {n: pl.ANY for n in inputs} | dict(x=pltpu.VMEM, attn_norm=pltpu.VMEM)
    buffers = gated_deltanet_buffers(config, B, T, block)
    weight_elements = sum(math.prod(s) for s in linear_layer_shapes(config).values())
    weight_bytes = weight_elements * dt.itemsize
    state_bytes = B * Nv * Hk * Hv * 4
    conv_bytes = B * (W - 1) * C * dt.itemsize
    decays = decay_width(config)
    out = pl.pallas_call(
        functools.partial(gated_deltanet_kernel, config=config, gates=gates,
                          stream=stream, batch=B, rows=T),
        out_shape=outputs,
        in_specs=(memory_specs(spaces),),
        out_specs=memory_specs(dict(out=pltpu.VMEM, conv_rows=pl.ANY, state_rows=pl.ANY)),
        scratch_shapes=dict(**{f"{b.name}_vmem": pltpu.VMEM(b.shape, b.dtype)
                               for b in buffers if b.name in ("h", "ring")},
                            sems=pltpu.SemaphoreType.DMA((block.slots,)),
                            linear=linear_scratch(config, gates, B, T, layers=1)),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes(buffers)),
        name="mk_gated_deltanet",
        cost_estimate=pl.CostEstimate(
            flops=weight_elements * 2 * M + B * T * Nv * 3 * 2 * Hk * Hv,
            transcendentals=M * (C + 2 * Vw + Nv + 2 * decays),
            bytes_accessed=weight_bytes + (1 + T) * (state_bytes + conv_bytes) + 2 * M * D * 4),
    )(inputs)
    return out["out"].reshape(B, T, D), out["conv_rows"][0], out["state_rows"][0]
