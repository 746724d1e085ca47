"""Kimi K3's latent mixture of experts (`LatentMoE`, the "latent_moe" kind) and its
simulator twin: `MoE`'s router on x (the sigmoid router and its bias, DMA'd whole with
latent_norm) and shared expert on x, but SiTU everywhere (`mk.ops.situ` at the config's
betas) and the routed experts on the latent z = x @ latent_down [M, Lt]: their weighted
sum is RMS-normed with latent_norm and projected back to D with latent_up
(`mk.reference.latent_moe_mlp`). Its stream: the shared expert, latent_down, the expert
slots on Lt, latent_up (`mk.kernels.latent_moe.latent_moe_segments`); the body:
`mk.kernels.latent_moe.latent_moe_body`.

Not here: tensor parallelism (the norm of the latent sum needs the whole sum, which a
device's share of each expert's columns does not give before an all-reduce: refused at tp
> 1, so none of `MoE`'s shard layouts, a split router or gate|up joined, is exercised
here), a stage kernel (it runs in the megakernel only), quantised latent_down/latent_up
(`mk.weights` gives them no format group).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from mk.config import DTYPE_BITS
from mk.kernels.common import Buffer
from mk.kernels.latent_moe import LATENT_DOWN, LATENT_UP, latent_moe_body, latent_moe_segments
from mk.kernels.mlp import SHARED_WEIGHTS
from mk.kernels.routing import Routing
from mk.kinds.base import Kind, Step
from mk.kinds.mlp import MoE, MoETwin, SituDense, swiglu
from mk.weights import param_shapes


class LatentMoE(MoE):
    """Kimi K3's MoE: SiTU experts on a latent (module docstring)."""

    name = "latent_moe"
    title = "latent-MoE"
    act = SituDense.act  # its experts' and shared expert's activation (the twin's tag)
    act_ops = SituDense.act_ops

    def activation(self):
        """SiTU at the config's betas (`SituDense.activation`)."""
        return SituDense.activation(self)

    def shard_fields(self, tp: int) -> dict:
        raise NotImplementedError(
            f"{self.config.name}: the latent MoE at tp={tp} (each device's share of its "
            "experts' columns gives a partial latent sum, and its RMS norm needs the whole "
            "one: an all-reduce before latent_up that the kernel does not make); run tp=1")

    def matrices(self, M: int) -> list:
        c = self.config
        return latent_moe_segments(c.hidden, c.moe_latent, c.expert_ffn, self.slots(M),
                                   c.shared_expert_ffn, self.joined)

    def buffers(self, batch: int, rows: int, block) -> list:
        """`MoE`'s (its down [M, D] holds the shared expert's output, then latent_up's;
        e_gate, e_up an expert's), with the latent [M, Lt] (z, then the normed sum), the
        experts' sum on it and one expert's output (float32 each)."""
        M, Lt = batch * rows, self.config.moe_latent
        return super().buffers(batch, rows, block) + [
            Buffer(n, (M, Lt), "float32") for n in ("latent", "latent_sum", "e_down")]

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
            used=c.own_width("expert_ffn") if self.joined else None)

    def stage(self, h, weights: dict):
        raise NotImplementedError("latent_moe has no stage kernel: it runs in the "
                                  "megakernel")

    def twin(self, sim) -> LatentMoETwin:
        return LatentMoETwin(self, sim)

    # -- Its cost (`mk.perf`)
    def params(self) -> int:
        """`MoE`'s router and X experts (each 3 Lt Fe: `expert_params`), with latent_down
        and latent_up."""
        return super().params() + 2 * self.config.hidden * self.config.moe_latent

    def mxu_passes(self, batch: int, rows: int, context: int, touched: float) -> list:
        """`MoE`'s (its experts' slot elements on Lt), with latent_down and latent_up over
        the M rows."""
        c = self.config
        return super().mxu_passes(batch, rows, context, touched) + [
            (batch * rows, 2 * c.hidden * c.moe_latent, 1)]

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
    """A latent MoE layer on the simulator (`mk.kernels.latent_moe.latent_moe_body`): the
    SiTU shared expert, latent_down, routing, the SiTU expert slots on the latent, the
    latent sum's norm, latent_up."""

    def experts(self):
        sim, kind = self.sim, self.kind
        c = kind.config
        if c.shared_expert_ffn:
            swiglu(sim, SHARED_WEIGHTS, c.shared_expert_ffn, kind.act_ops, kind.act)
        sim.matmul(LATENT_DOWN)
        self.route()
        self.slots(c.moe_latent, kind.act_ops, kind.act)
        sim.vector(4 * sim.m * c.moe_latent, "latent_norm")  # square, sum, scale twice
        sim.matmul(LATENT_UP)
        sim.vector(sim.m * c.hidden, "combine")  # latent_up's rows added to the output
