"""The linear-attention layer kinds: the gated DeltaNet (`DeltaNet`: Qwen3.5), Kimi Delta
Attention (`KDA`: Kimi Linear, a per-channel forget gate) and Kimi K3's KDA (`BoundedKDA`:
a bounded decay, a full-rank output gate), each with its simulator twin.

All run `mk.kinds.linear.deltanet.linear_mixer`: their big projections through the ring, their
small weights and conv state DMA'd by the linear layer before (the first at the step's
start: `prime_linear`), the recurrent states streamed per sequence, the conv and recurrent
states after each of the T rows written to HBM (waited for a linear layer later, the last
at the step's end: `drain_linear`). What differs between them there is their `gates`
(`mk.kinds.linear.deltanet.Gates`: the gates' code, where a row's decay lives, the output
gate). Not here: the kernel (`mk.kinds.linear.deltanet`), the loop over kinds
(`mk.step.one_layer.layer_body`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax

from mk.kinds.attention.decode_attention import block_rows
from mk.kinds.linear.deltanet import (BOUNDED_GATES, CHANNEL_GATES, HEAD_GATES, STATE_INPUTS,
                                 STATE_OUTPUTS, drain_linear, gated_deltanet_matrices,
                                 linear_buffers, linear_layer_shapes, linear_mixer,
                                 linear_semaphores, prime_linear)
from mk.kinds.base import Kind, Step, Twin
from mk.model.weights import param_shapes


class DeltaNet(Kind):
    """The gated DeltaNet token mixer."""

    name = "deltanet"
    title = "gated-DeltaNet"
    note = "the linear states are read once and written after every verified row"
    role = "mixer"
    phases = ("linear",)
    stream_phase = "linear"
    skip_tag = "skipped mixer"
    # Off the MXU: the conv, the decay and bias vectors, the gated norm (its matmuls are
    # the rest: DeltaNet's qkv, z, b, a, out; KDA's qkv, b, the low-rank gates, out).
    elementwise = ("lin_conv", "lin_a_log", "lin_dt_bias", "lin_norm")
    # What `linear_mixer` does differently per kind (`mk.kinds.linear.deltanet.Gates`): a decay
    # per value head (to SMEM with beta), z through the ring, the SiLU output gate
    gates = HEAD_GATES

    def split_widths(self) -> dict[str, int]:
        return dict(linear_key_heads=self.config.linear_key_heads)

    def shard_fields(self, tp: int) -> dict:
        c = self.config
        return dict(linear_key_heads=c.linear_key_heads // tp,
                    linear_value_heads=c.linear_value_heads // tp)

    def matrices(self, M: int) -> list:
        return gated_deltanet_matrices(self.config)

    def buffers(self, batch: int, rows: int, block) -> list:
        return linear_buffers(self.config, self.gates, batch, rows)

    def scratch(self, batch: int, rows: int, block) -> dict:
        return {"linear": linear_semaphores(self.config, self.gates, batch, rows)}

    def state_operands(self, cache, batch: int, rows: int) -> tuple[dict, dict]:
        """The conv and recurrent states in; the states after every row out."""
        states = (cache.conv, cache.state)
        return (dict(zip(STATE_INPUTS, states)),
                {out: jax.ShapeDtypeStruct((a.shape[0], batch, rows, *a.shape[2:]), a.dtype)
                 for out, a in zip(STATE_OUTPUTS, states)})

    def cache_fields(self, out) -> dict:  # the cache keeps the states after the last row
        return dict(conv=out["conv_rows"][:, :, -1], state=out["state_rows"][:, :, -1])

    @staticmethod
    def scratch_of(k: Step) -> SimpleNamespace:
        """`linear_mixer`'s scratch (the "linear" group) by field name."""
        return SimpleNamespace(**k.groups["linear"])

    def hbm(self, k: Step) -> dict:
        """The HBM refs `linear_mixer` reads by name: its DMA'd weights, the states in and
        the states after each row out."""
        return ({n: k.inputs[n] for n in self.weights("dma") + STATE_INPUTS}
                | {n: k.outputs[n] for n in STATE_OUTPUTS})

    def start(self, k: Step) -> None:  # the first linear layer's loads; each primes the next
        prime_linear(self.config, self.scratch_of(k), self.hbm(k))

    def run(self, k: Step, phase: str) -> None:
        linear_mixer(k.ring, self.config, self.gates, self.scratch_of(k), self.hbm(k),
                     step=k.step, row=k.row(self)(k.step), x=k.x, attn_norm=k.norms[0],
                     h_vmem=k.s.h, out_vmem=k.s.attn_out, batch=k.batch, rows=k.rows)

    def finish(self, k: Step) -> None:
        drain_linear(self.scratch_of(k), self.hbm(k))

    def twin(self, sim) -> LinearTwin:
        return LinearTwin(self, sim)

    # -- Its cost (`mk.cost.perf`)
    def mixing_flops(self, batch: int, rows: int, context: int) -> float:
        """The delta rule: per row and value head, three [Hk] x [Hk, Hv] products."""
        c = self.config
        return (6.0 * batch * rows * c.linear_value_heads * c.linear_key_dim
                * c.linear_value_dim)

    def mxu_passes(self, batch: int, rows: int, context: int, touched: float) -> list:
        """Its projections, then the kernel's delta rule: per sequence, value head and row,
        three products of the sequence's round_up(T, 8) rows by the [Hk, Hv] state."""
        c = self.config
        return super().mxu_passes(batch, rows, context, touched) + [
            (-(-rows // 8) * 8, 3 * batch * rows * c.linear_value_heads * c.linear_key_dim
             * c.linear_value_dim, 1)]

    def conventional(self, e) -> list:
        """Its input projections (qkv, gates), the conv, the delta rule over its share of
        the state bytes, the gated norm, out_proj."""
        c, m, layers = self.config, e.batch * e.rows, len(self.layers)
        D, C, Vw = c.hidden, c.conv_channels, c.linear_value_width
        params, shapes = self.params(), param_shapes(c)
        inputs = params - Vw * D  # every matmul but out_proj
        columns = sum(shapes[n][0][-1] for n in self.matmuls() if n != "lin_out")
        weights = e.linear_bytes / layers
        return [("in_proj", weights * inputs / params, 2 * m * inputs, [D, columns]),
                ("conv_gates", 0, 0, [2 * C]),
                ("delta_rule", e.state_bytes / layers,
                 self.mixing_flops(e.batch, e.rows, e.context), [C, Vw]),
                ("gated_norm", 0, 0, [3 * Vw]),
                ("out_proj", weights * Vw * D / params, 2 * m * Vw * D, [Vw, D])]


class KDA(DeltaNet):
    """Kimi Delta Attention: the gated DeltaNet's kernel with a decay per key channel (its
    low-rank forget and output gates DMA'd, no lin_z segment; the decays blocked beside q
    and k, a sigmoid output gate: `CHANNEL_GATES`)."""

    name = "kda"
    title = "KDA"
    gates = CHANNEL_GATES

    def twin(self, sim) -> KDATwin:
        return KDATwin(self, sim)


class BoundedKDA(KDA):
    """Kimi K3's KDA: KDA's kernel with its log-decay kda_gate_bound * sigmoid(exp(A_log)
    f), in (bound, 0), and a full-rank sigmoid output gate kda_g [D, Nv*Hv] streamed
    through the ring after lin_qkv (`BOUNDED_GATES`; `mk.model.linear_attention.kda_decay`)."""

    name = "bounded_kda"
    title = "bounded-KDA"
    gates = BOUNDED_GATES

    def twin(self, sim) -> BoundedKDATwin:
        return BoundedKDATwin(self, sim)


class LinearTwin(Twin):
    """A linear layer on the simulator (`linear_mixer`, step by step)."""

    def __init__(self, kind: DeltaNet, sim):
        super().__init__(kind, sim)
        self.states_landed: dict[int, float] = {}  # the states' stream: item -> landed
        self.states_sent: list[float] = []  # when each item's row states land in HBM
        self.conv_sent = 0.0  # when the last linear layer's conv rows land in HBM
        self.loads = (0.0, 0.0)  # the next linear layer's small weights, conv state landed

    def start(self) -> None:  # `prime_linear`
        self.layer_loads(0, "step start")
        self.state_load(0, "step start")

    def finish(self) -> None:  # `drain_linear`: the last conv rows and row states
        self.sim.mc.wait(max([self.conv_sent] + self.states_sent[-2:]))

    def layer_loads(self, row, tag=""):
        """`mk.kinds.linear.deltanet.start_layer_loads`: linear row `row`'s DMA'd weights and
        conv state (issued by the linear layer before it, the first at the step's start)."""
        sim, c = self.sim, self.kind.config
        item, layer = c.weight_bits / 8, self.kind.layers[row]
        shapes = linear_layer_shapes(c)
        small = max(sim.mc.dma(math.prod(shapes[what]) * item, layer, what, tag)
                    for what in self.kind.weights("dma"))
        conv = sim.mc.dma(sim.batch * (c.conv_kernel - 1) * c.conv_channels * item, layer,
                          "conv_load", tag, weight=False)
        self.loads = (small, conv)

    def state_load(self, n, tag=""):
        """Item n = row * B + b of the recurrent states' stream (`StateCopies`)."""
        c = self.kind.config
        self.states_landed[n] = self.sim.mc.dma(
            c.linear_value_heads * c.linear_key_dim * c.linear_value_dim * 4,
            self.kind.layers[n // self.sim.batch], "state_load", tag, weight=False)

    def run(self, phase: str) -> None:
        """`linear_mixer`: its weights, conv state and first state were issued by the
        linear layer before; it issues the next one's; lin_qkv and lin_z; the gates; the
        conv (its row states sent once the row before's have landed); per sequence the
        delta rule (the next item's state issued, item n - 2's row states waited for, this
        one's sent); the gated norm; lin_out."""
        sim, c = self.sim, self.kind.config
        B, T, M, layer, layers = sim.batch, sim.rows, sim.m, sim.layer, self.kind.layers
        C, W, Vw, Nv = c.conv_channels, c.conv_kernel, c.linear_value_width, \
            c.linear_value_heads
        Hk, Hv, item = c.linear_key_dim, c.linear_value_dim, c.weight_bits / 8
        row = layers.index(layer)
        small, conv = self.loads
        if row + 1 < len(layers):
            self.layer_loads(row + 1)
        sim.vector(4 * M * c.hidden, "norm")
        sim.matmul("lin_qkv")
        sim.mc.compute(sim.mxu_s(M, self.gates(small)), layer, "gates")
        sim.mc.wait(max(conv, self.conv_sent))
        sim.vector(2 * W * M * C, "conv")
        self.conv_sent = sim.mc.dma(B * T * (W - 1) * C * item, layer, "conv_rows",
                                    weight=False)
        sim.vector(6 * M * C, "l2norm")
        rows = block_rows(1, T)
        for b in range(B):
            n = row * B + b
            sim.mc.wait(self.states_landed.pop(n))
            if n + 1 < len(layers) * B:
                self.state_load(n + 1)
            if n >= 2:
                sim.mc.wait(self.states_sent[n - 2])
            sim.mc.compute(T * Nv * (3 * sim.mxu_s(rows, Hk * Hv) + 4 * Hk * Hv / sim.vpu),
                           layer, "delta_rule")
            self.states_sent.append(sim.mc.dma(T * Nv * Hk * Hv * 4, layer, "state_rows",
                                               weight=False))
        sim.vector(8 * M * Vw, "gated_norm")
        sim.matmul("lin_out")

    def gates(self, small) -> int:
        """The gated DeltaNet: lin_z through the ring, then b and a (waited for); returns
        the gates' weight elements."""
        self.sim.matmul("lin_z")
        self.sim.mc.wait(small)
        c = self.kind.config
        return 2 * c.hidden * c.linear_value_heads


class KDATwin(LinearTwin):
    def gates(self, small) -> int:
        """KDA: b, then the low-rank forget and output gates (waited for)."""
        self.sim.mc.wait(small)
        c = self.kind.config
        D, Nv, Hk, Hv = c.hidden, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
        return D * Nv + D * Hk + Hk * Nv * Hk + D * Hv + Hv * Nv * Hv


class BoundedKDATwin(LinearTwin):
    def gates(self, small) -> int:
        """Kimi K3's KDA: kda_g through the ring, then b and the low-rank forget gate
        (waited for)."""
        self.sim.matmul("kda_g")
        self.sim.mc.wait(small)
        c = self.kind.config
        D, Nv, Hk = c.hidden, c.linear_value_heads, c.linear_key_dim
        return D * Nv + D * Hk + Hk * Nv * Hk
