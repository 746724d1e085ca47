"""Kimi K3's latent mixture of experts (`LatentMoE`, the "latent_moe" kind) and its
simulator twin: `MoE`'s router on x (the sigmoid router and its bias, DMA'd whole with
latent_norm) and shared expert on x, but SiTU everywhere (`mk.model.ops.situ` at the config's
betas) and the routed experts on the latent z = x @ latent_down [M, Lt]: their weighted
sum is RMS-normed with latent_norm and projected back to D with latent_up
(`mk.model.reference.latent_moe_mlp`). Its stream: the shared expert, latent_down, the expert
slots on Lt, latent_up (`mk.kinds.mlp.latent_moe.latent_moe_segments`); the body:
`mk.kinds.mlp.latent_moe.latent_moe_body`. At tp > 1 a device holds whole lane tiles of
the latent (`latent_columns` of latent_down, rows of latent_up) and `MoE`'s split of the
experts: the latent is all-gathered after latent_down and the experts' partial sum
all-reduced before its norm (`latent_split`: two collectives a layer, groups
"latent_gather" and "latent_reduce", slots by the layer's parity).

Not here: a stage kernel (it runs in the megakernel only), quantised
latent_down/latent_up (`mk.model.weights` gives them no format group).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from mk.model.config import DTYPE_BITS
from mk.kernels.collectives import (AXIS, CollectiveScratch, all_gather_body, all_reduce_body,
                                    allgather_s, allreduce_s, collective_buffers)
from mk.kernels.common import Buffer
from mk.kinds.mlp.latent_moe import (LATENT_DOWN, LATENT_UP, LatentSplit, latent_columns,
                                   latent_moe_body, latent_moe_segments)
from mk.kinds.mlp.mlp import SHARED_WEIGHTS
from mk.kinds.mlp.routing import Routing
from mk.kinds.base import Kind, Step
from mk.kinds.mlp.kinds import MoE, MoETwin, SituDense, swiglu
from mk.model.weights import latent_held, param_shapes


class LatentMoE(MoE):
    """Kimi K3's MoE: SiTU experts on a latent (module docstring)."""

    name = "latent_moe"
    title = "latent-MoE"
    act = SituDense.act  # its experts' and shared expert's activation (the twin's tag)
    act_ops = SituDense.act_ops

    @property
    def expert_rows(self) -> int:
        """The width its experts read and write: the latent's."""
        return self.config.moe_latent

    def activation(self):
        """SiTU at the config's betas (`SituDense.activation`)."""
        return SituDense.activation(self)

    def shard_fields(self, tp: int) -> dict:
        """`MoE`'s, with the latent's tiles a device holds and the devices its collectives
        span (`mk.kinds.mlp.latent_moe.latent_columns`)."""
        return super().shard_fields(tp) | dict(
            latent_columns=latent_columns(self.config.moe_latent, tp), latent_shards=tp)

    def matrices(self, M: int) -> list:
        c = self.config
        return latent_moe_segments(c.hidden, c.moe_latent, c.expert_ffn, self.slots(M),
                                   c.shared_expert_ffn, self.joined, latent_held(c))

    def buffers(self, batch: int, rows: int, block) -> list:
        """`MoE`'s (its down [M, D] holds the shared expert's output, then latent_up's;
        e_gate, e_up an expert's), with the latent [M, Lt] (z, then the normed sum), the
        experts' sum on it and one expert's output (float32 each); at tp > 1 this device's
        latent_part [M, latent_columns] and its two collectives' buffers."""
        c, M = self.config, batch * rows
        Lt, n = c.moe_latent, c.latent_shards
        buffers = super().buffers(batch, rows, block) + [
            Buffer(name, (M, Lt), "float32") for name in ("latent", "latent_sum", "e_down")]
        if n > 1:  # the reduce's regions serve either algorithm ("two_phase" needs most)
            buffers += [Buffer("latent_part", (M, c.latent_columns), "float32"),
                        *collective_buffers("latent_gather", M, c.latent_columns, n,
                                            reduce=False),
                        *collective_buffers("latent_reduce", M, Lt, n, reduce=True,
                                            algorithm="two_phase")]
        return buffers

    def fetch(self, k: Step) -> dict:
        """`MoE`'s, with latent_down's and latent_up's rows (`Kind.fetch`)."""
        rows = Kind.fetch(self, k)
        return super().fetch(k) | {n: rows[n] for n in (LATENT_DOWN, LATENT_UP)}

    def run(self, k: Step, phase: str) -> None:
        if phase != "mlp":
            return super().run(k, phase)
        c, s = self.config, k.s
        s.mlp_out[...] = jnp.zeros_like(s.mlp_out)
        latent_moe_body(
            k.ring, k.step, s.h, s.router, s.combine, s.selected, s.selected_smem,
            s.small_sems.at[self.small_loads.index("selected")], s.ids_smem, s.count_smem,
            s.e_gate, s.e_up, s.latent, s.latent_sum, s.e_down, s.down, s.mlp_out,
            routing=Routing.of(c), norm_vmem=s.latent_norm, eps=c.rms_eps,
            activation=self.activation(),
            shared=(s.shared_gate, s.shared_up) if c.shared_expert_ffn else None,
            bias_vmem=getattr(s, "router_bias", None), gather=self.route_gather(k),
            used=c.own_width("expert_ffn") if self.joined else None,
            split=self.latent_split(k), part_vmem=getattr(s, "latent_part", None))

    def latent_split(self, k: Step) -> LatentSplit | None:
        """At tp > 1 this device's share of the latent (`LatentSplit`): z's all-gather (the
        first of its parts that hold the latent, side by side, cut to Lt: whole tiles),
        the partial sum's all-reduce, its own tiles of the normed sum picked by device
        index from static slices (zeros past the latent); else None."""
        c = self.config
        n, Lt, Lp = c.latent_shards, c.moe_latent, c.latent_columns
        if n <= 1:
            return None
        gathered = CollectiveScratch(**k.groups["latent_gather"])
        reduced = CollectiveScratch(**k.groups["latent_reduce"])
        slot, holding = lax.rem(k.step, 2), -(-Lt // Lp)

        def gather(part):
            parts = all_gather_body(part, gathered, n=n, slot=slot, algorithm=k.collective)
            return jnp.concatenate([parts[i] for i in range(holding)], axis=1)[:, :Lt]

        def reduce(partial):
            return all_reduce_body(partial, reduced, n=n, slot=slot, algorithm=k.collective)

        def own(normed):
            me, mine = lax.axis_index(AXIS), jnp.zeros((normed.shape[0], Lp), normed.dtype)
            for i in range(holding):
                tiles = normed[:, i * Lp:min((i + 1) * Lp, Lt)]
                if tiles.shape[1] < Lp:  # the last holder's: zeros after the latent
                    tiles = jnp.concatenate(
                        [tiles, jnp.zeros((tiles.shape[0], Lp - tiles.shape[1]),
                                          tiles.dtype)], axis=1)
                mine = jnp.where(me == i, tiles, mine)
            return mine

        return LatentSplit(gather, reduce, own)

    def stage(self, h, weights: dict):
        raise NotImplementedError("latent_moe has no stage kernel: it runs in the "
                                  "megakernel")

    def twin(self, sim) -> LatentMoETwin:
        return LatentMoETwin(self, sim)

    # -- Its cost (`mk.cost.perf`)
    def params(self) -> int:
        """`MoE`'s router and X experts (each 3 Lt Fe: `expert_params`), with latent_down
        and latent_up."""
        return super().params() + 2 * self.config.hidden * self.config.moe_latent

    def mxu_passes(self, batch: int, rows: int, context: int, touched: float) -> list:
        """`MoE`'s (its experts' slot elements on Lt), with latent_down and latent_up (the
        latent columns this device holds) over the M rows."""
        c = self.config
        return super().mxu_passes(batch, rows, context, touched) + [
            (batch * rows, 2 * c.hidden * latent_held(c), 1)]

    def collectives_s(self, m: int, spec, latency_s: float | None, algorithm=None) -> float:
        """`MoE`'s, with the latent's all-gather and its sum's all-reduce at tp > 1
        (`latent_gather_s`, `latent_reduce_s`)."""
        return (super().collectives_s(m, spec, latency_s, algorithm)
                + self.latent_gather_s(m, spec, latency_s, algorithm)
                + self.latent_reduce_s(m, spec, latency_s, algorithm))

    def latent_gather_s(self, m: int, spec, latency_s: float | None, algorithm=None) -> float:
        """The all-gather of each device's [m, latent_columns] float32 part of z
        (`latent_split`), else none."""
        c = self.config
        return (allgather_s(4 * m * c.latent_columns, c.latent_shards, spec, algorithm,
                            latency_s) if c.latent_shards > 1 else 0.0)

    def latent_reduce_s(self, m: int, spec, latency_s: float | None, algorithm=None) -> float:
        """The all-reduce of the experts' [m, Lt] float32 partial sum (`latent_split`),
        else none."""
        c = self.config
        return (allreduce_s(4 * m * c.moe_latent, c.latent_shards, spec, algorithm,
                            latency_s) if c.latent_shards > 1 else 0.0)

    def conventional(self, e) -> list:
        """latent_down, `MoE`'s ops on the latent (its experts' gate+up, SiTU, down, the
        combine), the latent's norm and latent_up (their bytes as stored: tp is 1)."""
        c, m, n = self.config, e.batch * e.rows, len(self.layers)
        D, E, Fe, X, Lt = c.hidden, c.experts, c.expert_ffn, c.experts_per_token, c.moe_latent
        experts, router = e.expert_bytes / n, e.router_bytes / n
        shapes = param_shapes(c)
        down, up = (math.prod(shapes[w][0][1:]) * DTYPE_BITS[shapes[w][1]] / 8
                    for w in (LATENT_DOWN, LATENT_UP))
        return [("latent_down", down, 2 * m * D * Lt, [D, Lt]),
                ("router", router, 2 * m * D * E, [D, E]),
                ("top_k", 0, 0, [2 * E]),
                ("experts_gate_up", 2 * experts / 3, 4 * m * X * Lt * Fe, [Lt, 2 * X * Fe]),
                (self.act, 0, 0, [3 * X * Fe]),
                ("experts_down", experts / 3, 2 * m * X * Fe * Lt, [X * Fe, X * Lt]),
                ("combine", 0, 0, [X * Lt, Lt]),
                ("latent_norm", 0, 0, [Lt, Lt]),
                ("latent_up", up, 2 * m * Lt * D, [Lt, D])]


class LatentMoETwin(MoETwin):
    """A latent MoE layer on the simulator (`mk.kinds.mlp.latent_moe.latent_moe_body`): the
    SiTU shared expert, latent_down (at tp > 1 the latent's all-gather), routing, the
    SiTU expert slots on the latent (at tp > 1 their sum's all-reduce), the sum's norm,
    latent_up."""

    def collective(self, seconds) -> None:
        """One of the kind's collectives, `seconds(m, spec, latency, algorithm)` long (0
        at tp = 1), as compute time."""
        sim = self.sim
        took = seconds(sim.m, sim.spec, sim.a.ici_latency_s, sim.collective_algorithm)
        if took:
            sim.mc.compute(took, sim.layer, "collective")

    def experts(self):
        sim, kind = self.sim, self.kind
        c = kind.config
        if c.shared_expert_ffn:
            swiglu(sim, SHARED_WEIGHTS, c.shared_expert_ffn, kind.act_ops, kind.act)
        sim.matmul(LATENT_DOWN)
        self.collective(kind.latent_gather_s)
        self.route()
        self.slots(kind.expert_rows, kind.act_ops, kind.act)
        self.collective(kind.latent_reduce_s)
        sim.vector(4 * sim.m * c.moe_latent, "latent_norm")  # square, sum, scale twice
        sim.matmul(LATENT_UP)
        sim.vector(sim.m * c.hidden, "combine")  # latent_up's rows added to the output
