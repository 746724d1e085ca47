"""The MLP layer kinds: the dense SwiGLU (`Dense`) and Kimi K3's dense SiTU (`SituDense`:
the same weights and stream, another activation), the mixture of experts (`MoE`:
Qwen3-MoE's softmax router, or DeepSeek/Kimi's sigmoid router with its bias, and Kimi's
shared expert) and gpt-oss's (`ClampedMoE`: a bias on the router's logits, biased
clamped-SwiGLU experts), each with its simulator twin and, but gpt-oss's, its stage
kernel (`stage`: the MLP as one pallas_call, `mk.measure.profiling`'s staged step).

A MoE layer DMAs its router (and the sigmoid router's bias) whole, the router transposed
([E, D]: `mk.kinds.base.TRANSPOSED`): at the layer's start, or at tp > 1 behind the token
mixer's tiles (`router_after_mixer`), and waits for it just before routing; where the plan
splits the router by experts (`mk.kinds.mlp.routing.router_columns`), a device's E/tp rows,
and its logits are all-gathered (`route_gather`). Its shared expert streams through the
ring before routing, its expert slots after (`mk.kinds.mlp.mlp.moe_body`). Not here: the
kernels' bodies (`mk.kinds.mlp.mlp`), the loop over kinds
(`mk.step.one_layer.layer_body`), Kimi K3's latent MoE (`mk.kinds.mlp.latent`).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from mk.model import quant
from mk.model.config import DTYPE_BITS, padded_width
from mk.kinds.mlp import mlp as mlp_kernels
from mk.kernels.collectives import (AXIS, CollectiveScratch, all_gather_body, allgather_s,
                                    collective_buffers)
from mk.kernels.common import Buffer, start_dma
from mk.kinds.mlp.joined_experts import gate_up_width
from mk.kinds.mlp.mlp import (DENSE_WEIGHTS, EXPERT_WEIGHTS, JOINED_EXPERT_WEIGHTS,
                            MOE_SMALL_LOADS, ROUTED_LAYER, SHARED_WEIGHTS, expert_slots,
                            moe_body, moe_fetch, moe_segments, silu_gate, swiglu_body,
                            swiglu_fetch, swiglu_segments)
from mk.kernels.stream import Repeat
from mk.kinds.mlp.routing import Routing, router_columns
from mk.kinds.base import Kind, Step, Twin
from mk.model.ops import clamped_swiglu, situ
from mk.model.weights import dma_layout, param_shapes


def router_after_mixer(tp: int) -> bool:
    """Where an MoE layer's router DMA is issued (the kernel's rule, the simulator's too):
    at tp > 1 in "after_mixer", behind all of the token mixer's tiles (a router issued
    first would delay them), loading during the mixer's all-reduce; at tp = 1, with no
    all-reduce to hide it, at the layer's start, behind the ring's look-ahead, loading
    during attention."""
    return tp > 1


class Dense(Kind):
    """The dense SwiGLU MLP."""

    name = "dense"
    title = "dense-MLP"
    role = "mlp"
    phases = ("mlp",)
    stream_phase = "mlp"
    skip_tag = "layer boundary"
    act = "swiglu"  # its activation's name (the simulator's vector work, `conventional`)
    act_ops = 6  # the activation's vector ops per element of the gate (`DenseTwin`)

    def activation(self):
        """Its activation of the gate and up projections [M, F] f32 (`swiglu_body`)."""
        return silu_gate

    def split_widths(self) -> dict[str, int]:
        return dict(ffn=self.config.ffn)

    def shard_fields(self, tp: int) -> dict:  # columns padded to whole lane tiles
        return dict(ffn=padded_width(self.config.ffn // tp))

    def matrices(self, M: int) -> list:
        return swiglu_segments(self.config.hidden, self.config.ffn)

    def buffers(self, batch: int, rows: int, block) -> list:
        M, F = batch * rows, self.config.ffn
        return [Buffer("gate", (M, F), "float32"), Buffer("up", (M, F), "float32")]

    def fetch(self, k: Step) -> dict:
        return swiglu_fetch(*(k.inputs[n] for n in DENSE_WEIGHTS), k.row(self), k.on(self))

    def run(self, k: Step, phase: str) -> None:
        swiglu_body(k.ring, k.step, k.s.h, k.s.gate, k.s.up, k.s.mlp_out,
                    activation=self.activation())

    def stage(self, h, weights: dict):
        """Its stage kernel on the normed rows h [M, D] (`mk.kinds.mlp.mlp.swiglu`): one
        layer's weights by name -> [M, D] float32."""
        return mlp_kernels.swiglu(h, *(weights[n] for n in DENSE_WEIGHTS),
                                  activation=self.activation())

    def twin(self, sim) -> DenseTwin:
        return DenseTwin(self, sim)

    # -- Its cost (`mk.cost.perf`): `params` and `mxu_passes` are the base's (gate, up, down)
    def conventional(self, e) -> list:
        """gate+up, SwiGLU, down over its share of the dense-MLP bytes (a shared expert's
        too: they are of that byte family)."""
        c, m = self.config, e.batch * e.rows
        D, F, w = c.hidden, c.ffn, e.dense_mlp_bytes / len(self.layers)
        return [("gate_up", 2 * w / 3, 4 * m * D * F, [D, 2 * F]),
                (self.act, 0, 0, [3 * F]),
                ("down", w / 3, 2 * m * F * D, [F, D])]


class SituDense(Dense):
    """Kimi K3's dense MLP: SwiGLU's weights and stream under the SiTU activation
    (`mk.model.ops.situ` at the config's situ_beta and situ_linear_beta: SiLU of the gate
    soft-capped by beta tanh(g / beta), times the up projection soft-capped by
    linear_beta tanh(u / linear_beta))."""

    name = "situ_dense"
    title = "SiTU dense-MLP"
    act = "situ"
    act_ops = 12  # SwiGLU's 6, two tanh, two divisions and two scalings

    def activation(self):
        c = self.config
        return functools.partial(situ, beta=c.situ_beta, linear_beta=c.situ_linear_beta)


class MoE(Kind):
    """The mixture of experts: router, expert slots, an optional shared expert."""

    name = "moe"
    title = "MoE"
    role = "mlp"
    phases = ("after_mixer", "before_mlp", "mlp")
    stream_phase = "mlp"

    def described(self) -> str:
        shared = " with a shared expert" if self.config.shared_expert_ffn else ""
        return super().described() + shared + self.layout_note()

    @property
    def router_shards(self) -> int:
        """The devices its router's experts are split over (1: whole on each device)."""
        c = self.config
        return c.experts // c.router_columns if c.router_columns else 1

    @property
    def joined(self) -> int | None:
        """The width of each expert's gate|up as one matrix where both fit one lane tile
        (`mk.kinds.mlp.joined_experts.gate_up_width`: the layout this shard streams) and
        their stored format keeps its scale blocks whole there (its config's `formats`, the
        plan's packed ones: `mk.step.plan.shard_config`; fp8's 128-column blocks do not
        fit a sliver of a lane tile, `mk.model.quant.column_block`), else None."""
        c = self.config
        used = c.own_width("expert_ffn")
        if used % quant.column_block(dict(c.formats).get("experts")):
            return None
        return gate_up_width(c.expert_ffn, used)

    @property
    def expert_rows(self) -> int:
        """The width its experts read and write: D."""
        return self.config.hidden

    def layout_note(self) -> str:
        """Its expert layout and why, in prose (the plan's choice: `joined`), with the
        bytes an expert streams over its values' where its shard pads them; its router's
        split where the plan splits it (`router_shards`)."""
        c = self.config
        used, ffn = c.own_width("expert_ffn"), c.expert_ffn
        router = (f", its router split by experts ({c.router_columns} of {c.experts} a "
                  "device, the logits all-gathered)" if self.router_shards > 1 else "")
        if used == ffn:
            return router
        share = self.slot_elements() / (3 * self.expert_rows * used)
        layout = (f"gate and up ({used} columns each a device) joined in {self.joined} "
                  f"lanes (apart: 2 x {ffn}), down's rows padded to {ffn}" if self.joined
                  else f"{used} columns a device padded to {ffn} lanes")
        return f", each expert's {layout}: {share:.3g}x its bytes" + router

    @property
    def expert_weights(self) -> tuple[str, ...]:
        """An expert slot's segments in its layout (`joined`)."""
        return JOINED_EXPERT_WEIGHTS if self.joined else EXPERT_WEIGHTS

    def slots(self, M: int) -> int:
        c = self.config
        return expert_slots(c.experts, c.experts_per_token, M)

    def split_widths(self) -> dict[str, int]:
        c = self.config
        return dict(expert_ffn=c.expert_ffn, shared_expert_ffn=c.shared_expert_ffn)

    def shard_fields(self, tp: int) -> dict:  # each expert's columns padded to whole tiles
        c = self.config
        columns = router_columns(c, tp)
        return dict(expert_ffn=padded_width(c.expert_ffn // tp),
                    shared_expert_ffn=padded_width(c.shared_expert_ffn // tp)
                    if c.shared_expert_ffn else 0,
                    router_split="experts" if columns < c.experts else "whole",
                    router_columns=columns if columns < c.experts else 0)

    def matrices(self, M: int) -> list:
        c = self.config
        return moe_segments(c.hidden, c.expert_ffn, self.slots(M), c.shared_expert_ffn,
                            self.joined)

    def buffers(self, batch: int, rows: int, block) -> list:
        c, M, f32 = self.config, batch * rows, "float32"
        E, Fe, D = c.experts, c.expert_ffn, c.hidden
        buffers = self.dma_buffers() + [  # the router (and the sigmoid router's bias)
            Buffer("combine", (M, E), f32), Buffer("selected", (1, E), "int32"),
            Buffer("e_gate", (M, Fe), f32), Buffer("e_up", (M, self.joined or Fe), f32),
            Buffer("down", (M, D), f32)]
        if c.shared_expert_ffn:
            Fs = c.shared_expert_ffn
            buffers += [Buffer("shared_gate", (M, Fs), f32), Buffer("shared_up", (M, Fs), f32)]
        if self.router_shards > 1:  # its logits' all-gather (semaphores: the plan's)
            buffers += collective_buffers("router_gather", M, c.router_columns,
                                          self.router_shards, reduce=False)
        return buffers

    @property
    def small_loads(self) -> tuple[str, ...]:
        """Its small DMAs, one semaphore each in `small_sems`: the router, the selected
        flags (`mk.kinds.mlp.mlp.MOE_SMALL_LOADS`' first two), then its other DMA'd weights
        (the sigmoid router's bias; gpt-oss's router and expert biases)."""
        return (*MOE_SMALL_LOADS[:2], *(n for n in self.weights("dma") if n != "router"))

    def scratch(self, batch: int, rows: int, block) -> dict:
        return {"layer": dict(
            small_sems=pltpu.SemaphoreType.DMA((len(self.small_loads),)),
            selected_smem=pltpu.SMEM((1, self.config.experts), jnp.int32),
            ids_smem=pltpu.SMEM((self.slots(batch * rows),), jnp.int32),
            count_smem=pltpu.SMEM((2,), jnp.int32))}

    def operands(self) -> tuple[str, ...]:
        """The base's, with we_gate_up in place of we_gate and we_up where `joined`."""
        names = super().operands()
        if not self.joined:
            return names
        gate, up = EXPERT_WEIGHTS[:2]
        return tuple(JOINED_EXPERT_WEIGHTS[0] if n == gate else n for n in names if n != up)

    def prepare(self, params) -> dict:
        """The base's, with each expert's gate and up joined where `joined` says
        (`mk.model.quant.side_by_side` of their columns of values)."""
        out = super().prepare(params)
        if self.joined:
            parts = [out.pop(n) for n in EXPERT_WEIGHTS[:2]]
            out["we_gate_up"] = quant.side_by_side(
                parts, self.config.own_width("expert_ffn"), self.joined)
        return out

    def fetch(self, k: Step) -> dict:
        row, s = k.row(self), k.s
        fetch = moe_fetch({n: k.inputs[n] for n in self.expert_weights}, row, s.ids_smem,
                          s.count_smem)
        if self.config.shared_expert_ffn:
            fetch |= swiglu_fetch(*(k.inputs[n] for n in SHARED_WEIGHTS), row, k.on(self),
                                  names=SHARED_WEIGHTS)
        return fetch

    def setup(self, k: Step) -> None:
        # expert tiles issued before their layer's routing are no-ops
        k.s.count_smem[0], k.s.count_smem[ROUTED_LAYER] = 0, -1

    def routers(self, k: Step) -> list:
        """The router's (and the sigmoid router's bias's) DMA of this layer, by name."""
        row = k.row(self)(k.step)
        return [(pltpu.make_async_copy(k.inputs[n].at[row], getattr(k.s, n),
                                       k.s.small_sems.at[self.small_loads.index(n)]),
                 getattr(k.s, n), n) for n in self.weights("dma")]

    def start_routers(self, k: Step) -> None:
        for copy, ref, name in self.routers(k):
            start_dma(copy, name, ref.size * ref.dtype.itemsize)

    def begin(self, k: Step) -> None:
        if not router_after_mixer(k.tp):
            self.start_routers(k)

    def run(self, k: Step, phase: str) -> None:
        if phase == "after_mixer" and router_after_mixer(k.tp):
            self.start_routers(k)
        elif phase == "before_mlp":
            for copy, _, _ in self.routers(k):
                copy.wait()
        elif phase == "mlp":
            s = k.s
            s.mlp_out[...] = jnp.zeros_like(s.mlp_out)
            moe_body(k.ring, k.step, s.h, s.router, s.combine, s.selected, s.selected_smem,
                     s.small_sems.at[self.small_loads.index("selected")], s.ids_smem,
                     s.count_smem, s.e_gate, s.e_up, s.down, s.mlp_out,
                     routing=Routing.of(self.config),
                     used=self.config.own_width("expert_ffn") if self.joined else None,
                     gather=self.route_gather(k), **self.body_options(k))

    def route_gather(self, k: Step):
        """Where its router is split: the all-gather of a device's logits [M, E/tp] into
        every device's, in device order [M, E] (`mk.kernels.collectives.all_gather_body`,
        the plan's algorithm, slot by the layer's parity); else None."""
        n = self.router_shards
        if n == 1:
            return None
        scratch = CollectiveScratch(**k.groups["router_gather"])

        def gather(logits):
            parts = all_gather_body(logits, scratch, n=n, slot=lax.rem(k.step, 2),
                                    algorithm=k.collective)
            return jnp.concatenate([parts[i] for i in range(n)], axis=1)
        return gather

    def body_options(self, k: Step) -> dict:
        """`moe_body`'s options of this kind: the sigmoid router's bias, the shared expert's
        scratch."""
        c, s = self.config, k.s
        return dict(bias_vmem=getattr(s, "router_bias", None),
                    shared=(s.shared_gate, s.shared_up) if c.shared_expert_ffn else None)

    def stage(self, h, weights: dict):
        """Its stage kernel on the normed rows h [M, D] (`mk.kinds.mlp.mlp.moe`): one layer's
        weights by name (its router's bias and shared expert where it has them) -> [M, D]
        float32."""
        return mlp_kernels.moe_of(Routing.of(self.config), h, weights)

    def twin(self, sim) -> MoETwin:
        return MoETwin(self, sim)

    # -- Its cost (`mk.cost.perf`)
    @property
    def routes(self) -> tuple[int, int]:
        return self.config.experts, self.config.experts_per_token

    def params(self) -> int:
        """The router and the X experts a token picks (the shared expert is not counted)."""
        c = self.config
        return c.hidden * c.experts + c.experts_per_token * c.expert_params

    def mxu_passes(self, batch: int, rows: int, context: int, touched: float) -> list:
        """The router (a device's columns of it) over the M rows; the `touched` experts
        share the M*X routed rows, at least the MXU's rows each (the kernel pushes all M
        rows through every active expert, which costs more once M > mxu_rows), each
        expert's matrices as its slot streams them (`matrices`: padded, or gate|up
        joined)."""
        c, m = self.config, batch * rows
        return [(m, c.hidden * (c.router_columns or c.experts), 1),
                (m * c.experts_per_token, self.slot_elements(), touched)]

    def collectives_s(self, m: int, spec, latency_s: float | None, algorithm=None) -> float:
        """Its split router's all-gather (`router_gather_s`)."""
        return self.router_gather_s(m, spec, latency_s, algorithm)

    def router_gather_s(self, m: int, spec, latency_s: float | None, algorithm=None) -> float:
        """Its split router's all-gather of each device's [m, E/tp] float32 logits
        (`route_gather`, `allgather_s`), else none."""
        n = self.router_shards
        return 0.0 if n == 1 else allgather_s(4 * m * self.config.router_columns, n, spec,
                                              algorithm, latency_s)

    def slot_elements(self) -> int:
        """The elements one expert slot streams (`matrices`: padded, or gate|up joined)."""
        slot = next(g for g in self.matrices(1) if isinstance(g, Repeat))
        return sum(r * k for _, r, k in slot.matrices)

    def conventional(self, e) -> list:
        """Router, top-k, the experts' gate+up, SwiGLU, down, the combine."""
        c, m, n = self.config, e.batch * e.rows, len(self.layers)
        D, E, Fe, X = c.hidden, c.experts, c.expert_ffn, c.experts_per_token
        experts, router = e.expert_bytes / n, e.router_bytes / n
        return [("router", router, 2 * m * D * E, [D, E]),
                ("top_k", 0, 0, [2 * E]),
                ("experts_gate_up", 2 * experts / 3, 4 * m * X * D * Fe, [D, 2 * X * Fe]),
                ("swiglu", 0, 0, [3 * X * Fe]),
                ("experts_down", experts / 3, 2 * m * X * Fe * D, [X * Fe, X * D]),
                ("combine", 0, 0, [X * D, D])]


class ClampedMoE(MoE):
    """gpt-oss's mixture of experts: the softmax router with a bias on its logits (the
    softmax over the picked logits), experts with biases on their three projections and
    the clamped SwiGLU (`mk.model.ops.clamped_swiglu`). Its vectors (the router's bias, every
    expert's biases: its DMA'd weights besides the router) load with the router; an
    expert slot picks its expert's bias rows. At tp > 1 the device holding the first
    shard adds the down projection's bias (the others' partial sums have none)."""

    name = "clamped_moe"
    title = "clamped-MoE"

    def body_options(self, k: Step) -> dict:
        """The router's logit bias, each expert's bias rows, the clamped SwiGLU."""
        s, c = k.s, self.config
        first = jnp.float32(1.0) if k.tp == 1 else (
            lax.axis_index(AXIS) == 0).astype(jnp.float32)  # adds the down bias

        def bias(j, expert):  # [1, width] f32: expert's row of bias j (gate, up, down)
            table = getattr(s, ("be_gate", "be_up", "be_down")[j])[...].astype(jnp.float32)
            rows = lax.broadcasted_iota(jnp.int32, table.shape, 0)
            row = jnp.sum(jnp.where(rows == expert, table, 0.0), axis=0, keepdims=True)
            return row * first if j == 2 else row

        return dict(bias_vmem=s.router_logit_bias, bias=bias,
                    activation=functools.partial(clamped_swiglu, limit=c.swiglu_limit,
                                                 alpha=c.swiglu_alpha))

    def stage(self, h, weights: dict):
        raise NotImplementedError("clamped_moe has no stage kernel: it runs in the "
                                  "megakernel")


def swiglu(sim, names, width: int, ops: int = Dense.act_ops, act: str = Dense.act) -> None:
    """`swiglu_body` on the simulator: the segments `names` (gate, up, down) of width
    `width` through the ring, the activation `act` between (`ops` vector ops per element
    of the gate)."""
    gate, up, down = names
    sim.matmul(gate)
    sim.matmul(up)
    sim.vector(ops * sim.m * width, act)
    sim.matmul(down)


class DenseTwin(Twin):
    """A dense layer on the simulator, under its kind's activation (SwiGLU or SiTU)."""

    def run(self, phase: str) -> None:
        kind = self.kind
        swiglu(self.sim, DENSE_WEIGHTS, kind.config.ffn, kind.act_ops, kind.act)


class MoETwin(Twin):
    """A MoE layer on the simulator: its router's DMA, routing, the active expert slots
    (`sim.experts_on` of them) and the off ones skipped."""

    def __init__(self, kind: MoE, sim):
        super().__init__(kind, sim)
        self.count = 0  # count_smem[0]: active expert slots, 0 outside routing
        self.routed = -1  # count_smem[ROUTED_LAYER]: the layer they were routed for
        self.router = 0.0  # when this layer's router lands

    def active(self, layer: int, segment: str, copy: int) -> bool:
        if segment in self.kind.expert_weights:
            return copy < self.count and layer == self.routed
        return super().active(layer, segment, copy)

    def start_router(self):
        """Its DMA'd weights as the kernel lays them out (`mk.model.weights.dma_layout`: a norm
        in float32)."""
        sim = self.sim
        shapes = param_shapes(self.kind.config)
        laid = {n: dma_layout(n, shapes[n][0][1:], shapes[n][1])
                for n in self.kind.weights("dma")}
        self.router = max(sim.mc.dma(math.prod(shape) * DTYPE_BITS[str(dtype)] / 8,
                                     sim.layer, n) for n, (shape, dtype) in laid.items())

    def begin(self) -> None:
        if not router_after_mixer(self.sim.tp):
            self.start_router()

    def run(self, phase: str) -> None:
        if phase == "after_mixer" and router_after_mixer(self.sim.tp):
            self.start_router()
        elif phase == "before_mlp":
            self.sim.mc.wait(self.router)
        elif phase == "mlp":
            self.experts()

    def experts(self):
        """`mk.kinds.mlp.mlp.moe_body`: the shared expert (Kimi) through the ring, routing
        (a split router's gather), the selected flags to SMEM, the expert slots, the off
        slots skipped."""
        c = self.kind.config
        if c.shared_expert_ffn:
            swiglu(self.sim, SHARED_WEIGHTS, c.shared_expert_ffn)
        self.route()
        self.slots(self.kind.expert_rows)

    def route(self):
        """`mk.kinds.mlp.mlp.route_experts`: the router (a split router's gather), the
        selected flags to SMEM, the active slots' first tiles issued."""
        sim, c = self.sim, self.kind.config
        M = sim.m
        E, X = c.experts, c.experts_per_token
        sim.mc.compute(sim.mxu_s(M, c.hidden * (c.router_columns or E)), sim.layer, "router")
        if self.kind.router_shards > 1:  # the logits' all-gather (`MoE.route_gather`)
            sim.mc.compute(self.kind.router_gather_s(M, sim.spec, sim.a.ici_latency_s,
                                                     sim.collective_algorithm),
                           sim.layer, "collective")
        sim.vector(M * E * (6 + 4 * X), "router")
        sim.mc.wait(sim.mc.dma(4 * E, sim.layer, "selected", weight=False))  # flags to SMEM
        sim.mc.compute(E * sim.a.scalar_op_s, sim.layer, "router")
        self.count, self.routed = sim.experts_on, sim.layer
        names = self.kind.expert_weights
        gate = sim.s.segment(names[0])
        base = sim.s.base(sim.layer, gate)
        for t in range(min(sim.n, gate.copies * gate.stride)):
            sim.start(base + t, "routing")

    def slots(self, width: int, ops: int = Dense.act_ops, act: str = "swiglu"):
        """`mk.kinds.mlp.mlp.experts_body`: the active expert slots on rows of `width` (D, or
        the latent's), their activation `act` (`ops` vector ops per element), the off
        slots skipped."""
        sim, c = self.sim, self.kind.config
        M, E, Fe = sim.m, c.experts, c.expert_ffn
        names = self.kind.expert_weights
        gate = sim.s.segment(names[0])
        first, end = sim.region(names[0], names[-1])
        for copy in range(self.count):
            for name in names[:-1]:
                sim.matmul(name, copy=copy)
            if self.kind.joined:  # up rotated out of the joined product, the padding masked
                sim.vector(M * (self.kind.joined + Fe), act)
            sim.vector(ops * M * Fe, act)
            sim.matmul(names[-1], copy=copy)
            sim.vector(3 * M * width + M * E, "combine")
        sim.skip(first + self.count * gate.stride, end, "layer boundary")
        self.count = 0
