"""Kimi K3's latent MoE in the kernel: routed experts on a latent, streamed through the ring.

Its stream (`latent_moe_segments`, `mk.model.weights`' order): the shared expert's segments on
D, latent_down [D, Lt], the expert slots on Lt (`mk.kinds.mlp.mlp.moe_segments` at width
Lt), latent_up [Lt, D]. Its body (`latent_moe_body`): the shared expert on x, z = x @
latent_down, the routing on x (`mk.kinds.mlp.mlp.route_experts`), the chosen experts on z
(`mk.kinds.mlp.mlp.experts_body`) summed, that sum RMS-normed and projected back to D by
latent_up. latent_down comes before the expert region while the count is still 0 and
latent_up after it, so the ring's invariant around routing holds unchanged.

At tp > 1 (`LatentSplit`) a device holds whole lane tiles of the latent
(`latent_columns`): z's parts are all-gathered, the experts' partial sum all-reduced
before the norm, and each device projects its own tiles of the normed sum back.

Here: `LATENT_DOWN`, `LATENT_UP`, `latent_columns`, `LatentSplit`, `latent_moe_segments`,
`latent_moe_body`. Not here: the routing and expert steps it is built from
(`mk.kinds.mlp.mlp`), its buffers, fetches and simulator twin (the kind,
`mk.kinds.mlp.latent.LatentMoE`), a stage kernel (it runs in the megakernel only). The
design, the split at tp > 1 too: docs/design/mk.kinds.mlp.mlp.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

from mk.model.config import LANES
from mk.kinds.mlp.mlp import (SHARED_WEIGHTS, experts_body, moe_segments, route_experts,
                            swiglu_body, swiglu_segments)
from mk.kernels.ring import Ring
from mk.kinds.mlp.routing import Routing
from mk.model.ops import rms_norm

# The segments around the expert slots: x's projection to the latent before routing, the
# normed latent sum's back to D after the slots (`mk.model.weights`' rows of "latent_moe").
LATENT_DOWN, LATENT_UP = "latent_down", "latent_up"


def latent_columns(latent: int, tp: int) -> int:
    """The latent columns one device of tp holds (latent_down's columns, latent_up's rows):
    the latent's 128-lane tiles dealt ceil(tiles / tp) a device, in device order, so
    devices past the last tile hold zeros; the latent itself at tp = 1. ValueError where
    the latent is not whole tiles (its all-gather would leave it scattered between
    padding)."""
    if tp == 1:
        return latent
    if latent % LANES:
        raise ValueError(f"moe_latent={latent} must be a multiple of {LANES} lanes at "
                         f"tp={tp}: each device holds whole lane tiles of the latent")
    return -(-latent // LANES // tp) * LANES


class LatentSplit(NamedTuple):
    """A device's share of the latent at tp > 1 (module docstring), as three functions of
    values: gather [M, Lp] (its part of z) -> [M, Lt] (z); reduce [M, Lt] (its partial
    sum) -> [M, Lt] (the sum, bit-identical on every device); own [M, Lt] (the normed
    sum) -> [M, Lp] (its tiles of it, zeros past the latent)."""

    gather: Callable
    reduce: Callable
    own: Callable


def latent_moe_segments(D: int, Lt: int, Fe: int, slots: int, shared_ffn: int = 0,
                        joined: int | None = None, held: int | None = None) -> list:
    """A latent MoE layer's ring segments (`mk.model.weights` stream order): the shared expert's
    on D (when shared_ffn > 0), latent_down [D, held], the expert slots on the latent
    (`moe_segments` at width Lt), latent_up [held, D]; held: the latent columns a device
    holds (`latent_columns`; default all Lt)."""
    held = held or Lt
    shared = swiglu_segments(D, shared_ffn, SHARED_WEIGHTS) if shared_ffn else []
    return (shared + [(LATENT_DOWN, D, held)] + moe_segments(Lt, Fe, slots, 0, joined)
            + [(LATENT_UP, held, D)])


def latent_moe_body(ring: Ring, layer, x, router_vmem, combine_vmem, selected_vmem,
                    selected_smem, sem, ids_smem, count_smem, gate_vmem, up_vmem,
                    latent_vmem, sum_vmem, expert_vmem, down_vmem, out_ref, *,
                    routing: Routing, norm_vmem, eps: float, activation, shared=None,
                    bias_vmem=None, gather=None, used: int | None = None,
                    split: LatentSplit | None = None, part_vmem=None):
    """out_ref [M, D] f32 += Kimi K3's latent MoE of x [M, D] (`mk.model.reference.
    latent_moe_mlp`): the shared expert on x (`activation`; shared: its (gate, up) [M, Fs]
    f32 scratch, or None), latent_vmem [M, Lt] f32 = x @ latent_down, the routing on x,
    the chosen experts (`activation`) on the latent summed into sum_vmem [M, Lt] f32
    (expert_vmem [M, Lt] f32: one expert's output), that sum RMS-normed (norm_vmem [1, Lt]
    f32, `eps`) into latent_vmem and projected back by latent_up through down_vmem [M, D]
    f32 (which first holds the shared expert's output). The routing's arguments are
    `moe_body`'s; count_smem[0] is 0 before and after. At tp > 1, `split` (`LatentSplit`)
    with part_vmem [M, Lp] f32: this device's columns of z, then its tiles of the normed
    sum (module docstring). Returns the number of distinct experts loaded (a scalar)."""
    if shared is not None:
        swiglu_body(ring, layer, x, *shared, down_vmem, names=SHARED_WEIGHTS,
                    activation=activation)
        out_ref[...] += down_vmem[...]
    part = latent_vmem if split is None else part_vmem
    ring.matmul(LATENT_DOWN, x, part, layer=layer)
    if split is not None:
        latent_vmem[...] = split.gather(part_vmem[...])
    route_experts(ring, layer, x, router_vmem, combine_vmem, selected_vmem, selected_smem,
                  sem, ids_smem, count_smem, routing=routing, bias_vmem=bias_vmem,
                  gather=gather)
    sum_vmem[...] = jnp.zeros_like(sum_vmem)
    experts_body(ring, layer, latent_vmem, combine_vmem, ids_smem, count_smem, gate_vmem,
                 up_vmem, expert_vmem, sum_vmem, activation=activation, used=used)
    total = sum_vmem[...] if split is None else split.reduce(sum_vmem[...])
    latent_vmem[...] = rms_norm(total, norm_vmem[...], eps)
    if split is not None:
        part_vmem[...] = split.own(latent_vmem[...])
    ring.matmul(LATENT_UP, part, down_vmem, layer=layer)
    out_ref[...] += down_vmem[...]
    loaded = count_smem[0]
    count_smem[0] = 0
    return loaded
