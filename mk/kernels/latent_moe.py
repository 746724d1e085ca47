"""Kimi K3's latent MoE in the kernel: routed experts on a latent, streamed through the ring.

Its stream (`latent_moe_segments`, `mk.weights`' order): the shared expert's segments on
D, latent_down [D, Lt], the expert slots on Lt (`mk.kernels.mlp.moe_segments` at width
Lt), latent_up [Lt, D]. Its body (`latent_moe_body`): the shared expert on x, z = x @
latent_down, the routing on x (`mk.kernels.mlp.route_experts`), the chosen experts on z
(`mk.kernels.mlp.experts_body`) summed, that sum RMS-normed and projected back to D by
latent_up. latent_down comes before the expert region while the count is still 0 and
latent_up after it, so the ring's invariant around routing holds unchanged.

Here: `LATENT_DOWN`, `LATENT_UP`, `latent_moe_segments`, `latent_moe_body`. Not here: the
routing and expert steps it is built from (`mk.kernels.mlp`), its buffers, fetches and
simulator twin (the kind, `mk.kinds.latent.LatentMoE`), a stage kernel (it runs in the
megakernel only), tensor parallelism (refused by the kind). The design:
docs/design/mk.kernels.mlp.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from mk.kernels.mlp import (SHARED_WEIGHTS, experts_body, moe_segments, route_experts,
                            swiglu_body, swiglu_segments)
from mk.kernels.ring import Ring
from mk.kernels.routing import Routing
from mk.ops import rms_norm

# The segments around the expert slots: x's projection to the latent before routing, the
# normed latent sum's back to D after the slots (`mk.weights`' rows of "latent_moe").
LATENT_DOWN, LATENT_UP = "latent_down", "latent_up"


def latent_moe_segments(D: int, Lt: int, Fe: int, slots: int, shared_ffn: int = 0,
                        joined: int | None = None) -> list:
    """A latent MoE layer's ring segments (`mk.weights` stream order): the shared expert's
    on D (when shared_ffn > 0), latent_down [D, Lt], the expert slots on the latent
    (`moe_segments` at width Lt), latent_up [Lt, D]."""
    shared = swiglu_segments(D, shared_ffn, SHARED_WEIGHTS) if shared_ffn else []
    return (shared + [(LATENT_DOWN, D, Lt)] + moe_segments(Lt, Fe, slots, 0, joined)
            + [(LATENT_UP, Lt, D)])


def latent_moe_body(ring: Ring, layer, x, router_vmem, combine_vmem, selected_vmem,
                    selected_smem, sem, ids_smem, count_smem, gate_vmem, up_vmem,
                    latent_vmem, sum_vmem, expert_vmem, down_vmem, out_ref, *,
                    routing: Routing, norm_vmem, eps: float, activation, shared=None,
                    bias_vmem=None, gather=None, used: int | None = None):
    """out_ref [M, D] f32 += Kimi K3's latent MoE of x [M, D] (`mk.reference.
    latent_moe_mlp`): the shared expert on x (`activation`; shared: its (gate, up) [M, Fs]
    f32 scratch, or None), latent_vmem [M, Lt] f32 = x @ latent_down, the routing on x,
    the chosen experts (`activation`) on the latent summed into sum_vmem [M, Lt] f32
    (expert_vmem [M, Lt] f32: one expert's output), that sum RMS-normed (norm_vmem [1, Lt]
    f32, `eps`) into latent_vmem and projected back by latent_up through down_vmem [M, D]
    f32 (which first holds the shared expert's output). The routing's arguments are
    `moe_body`'s; count_smem[0] is 0 before and after. Returns the number of distinct
    experts loaded (a scalar)."""
    if shared is not None:
        swiglu_body(ring, layer, x, *shared, down_vmem, names=SHARED_WEIGHTS,
                    activation=activation)
        out_ref[...] += down_vmem[...]
    ring.matmul(LATENT_DOWN, x, latent_vmem, layer=layer)
    route_experts(ring, layer, x, router_vmem, combine_vmem, selected_vmem, selected_smem,
                  sem, ids_smem, count_smem, routing=routing, bias_vmem=bias_vmem,
                  gather=gather)
    sum_vmem[...] = jnp.zeros_like(sum_vmem)
    experts_body(ring, layer, latent_vmem, combine_vmem, ids_smem, count_smem, gate_vmem,
                 up_vmem, expert_vmem, sum_vmem, activation=activation, used=used)
    latent_vmem[...] = rms_norm(sum_vmem[...], norm_vmem[...], eps)
    ring.matmul(LATENT_UP, latent_vmem, down_vmem, layer=layer)
    out_ref[...] += down_vmem[...]
    loaded = count_smem[0]
    count_smem[0] = 0
    return loaded
