"""The MoE router inside a kernel: `Routing` (how a layer picks and weighs its experts),
`router_columns` (whether tensor parallelism splits the router by experts) and
`route_body`, the first of the MoE block's four steps (`mk.kinds.mlp.mlp`): logits = h @
router in f32 (the router held transposed, [E, D]: `mk.kinds.base.TRANSPOSED`; at tp with
the router split, each device's E/tp rows, the logits all-gathered), softmax (Qwen3-MoE)
or sigmoid plus a choice bias within the best expert groups (`kept_groups`: DeepSeek-V3 /
Kimi), top-k by k rounds of (row max, lowest lane holding it) so ties go to the lower
expert id, the weights renormalised and scaled as asked. Its numerics are `mk.model.ops.route`
/ `mk.model.ops.route_grouped`'s. Not here: turning the selected flags into expert slots and
streaming them (`mk.kinds.mlp.mlp.select_experts`, `experts_body`), the router's DMA
(`mk.kinds.mlp.kinds.MoE`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mk.model.chips import all_chips
from mk.kernels.collectives import ICI_LATENCY_S, allgather_s
from mk.kernels.common import transposed_dot
from mk.model.kind_checks import check_routing


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a MoE layer picks and weighs its top_k experts (`mk.model.reference.mlp_block`); the
    fields after renormalise are ModelConfig's of the same names.

    router_score "softmax" (Qwen3-MoE, `mk.model.ops.route`): softmax probabilities, the
    top_k picked, renormalised if asked. "sigmoid" (DeepSeek-V3 / Kimi,
    `mk.model.ops.route_grouped`): sigmoid scores; the choice adds a per-expert bias and
    keeps the topk_groups of expert_groups groups whose two best biased scores sum
    highest; the weights are the unbiased scores, renormalised (+1e-20) if asked, times
    routed_scale. Ties go to the lower expert (and group) id, as lax.top_k's."""
    top_k: int
    renormalise: bool
    router_score: str = "softmax"
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0

    @classmethod
    def of(cls, config) -> Routing:
        """The routing of `config`'s MoE layers."""
        return cls(config.experts_per_token, config.norm_topk, config.router_score,
                   config.expert_groups, config.topk_groups, config.routed_scale)

    def check(self, experts: int) -> Routing:
        """Itself, after checking it against `experts` (`mk.model.kind_checks.check_routing`);
        raises ValueError naming the field."""
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) \
                or not 1 <= self.top_k <= experts:
            raise ValueError(f"top_k={self.top_k!r} must be an integer in [1, experts={experts}]")
        check_routing("moe", experts=experts, top_k=self.top_k,
                      **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)[2:]})
        return self


def router_columns(config, tp: int) -> int:
    """The router columns a device holds at tp (the experts whose logits it computes): E/tp
    where `config.router_split` is "experts", or "auto" and the split pays, else E.

    Pays: the router bytes a device no longer loads each MoE layer, (1 - 1/tp) of its D x E,
    take longer at the fastest HBM of data/chips.csv than the all-gather of one row's
    logits takes there at ICI_LATENCY_S a message round (`allgather_s`; more rows cost a
    few more bytes on the wire). It is a layout, chosen once for the shard, not per step.
    At TPU7x's measured round (4.1 us, `round_s`) the Kimi-sized routers would save less
    HBM time than the gather costs (1.7-3.4 us at tp 2-32) and stay whole, as the release
    keeps its router; but a whole router held in VMEM takes room the ring needs (Kimi K3
    at TP32, B 1, T 8: 4 ring slots instead of 33), which this rule does not weigh, so it
    keeps the 1-us round until it does. ValueError where "experts" is asked and tp does
    not divide E."""
    E = config.experts
    if tp == 1 or not E or config.router_split == "whole":
        return E
    if E % tp:
        if config.router_split == "experts":
            raise ValueError(f"{config.name}: router_split='experts' needs tp={tp} to "
                             f"divide experts={E}")
        return E
    if config.router_split == "experts":
        return E // tp
    fastest = max(all_chips("tpu"), key=lambda spec: spec.device_hbm_bw)
    saved_s = (1 - 1 / tp) * config.hidden * E * np.dtype(config.dtype).itemsize \
        / fastest.device_hbm_bw
    gather_s = allgather_s(4 * E // tp, tp, fastest, latency_s=ICI_LATENCY_S)
    return E // tp if saved_s > gather_s else E


def _first_max(values, lane, n):
    """(the row max [M, 1] of values [M, n], a mask of the lowest lane holding it)."""
    best = jnp.max(values, axis=1, keepdims=True)
    first = jnp.min(jnp.where(values == best, lane, n), axis=1, keepdims=True)
    return best, lane == first


def kept_groups(choice, expert, routing: Routing):
    """[M, E] bool: the experts of each row's topk_groups best groups, a group scored by the
    sum of its two best `choice` values (the lowest-id group among ties)."""
    M, E = choice.shape
    group = expert // (E // routing.expert_groups)
    scores = []
    for g in range(routing.expert_groups):  # static: a handful of groups
        inside = jnp.where(group == g, choice, -jnp.inf)
        best, hit = _first_max(inside, expert, E)
        scores.append(best + jnp.max(jnp.where(hit, -jnp.inf, inside), axis=1, keepdims=True))
    taken = [jnp.zeros((M, 1), jnp.bool_) for _ in scores]
    kept = jnp.zeros((M, E), jnp.bool_)
    for _ in range(routing.topk_groups):
        open_scores = [jnp.where(t, -jnp.inf, sc) for t, sc in zip(taken, scores)]
        best = functools.reduce(jnp.maximum, open_scores)
        chosen = jnp.full((M, 1), routing.expert_groups, jnp.int32)
        for g in reversed(range(routing.expert_groups)):  # the lowest group id holding the best
            chosen = jnp.where(open_scores[g] == best, g, chosen)
        for g in range(routing.expert_groups):
            hit = chosen == g
            taken[g] = taken[g] | hit
            kept = kept | (hit & (group == g))
    return kept


def route_body(x, router_vmem, combine_vmem, routing: Routing, bias_vmem=None,
               gather=None):
    """Write combine_vmem [M, E] f32 (routing weights, 0 where not picked); return the
    selected flags [1, E] int32. router_vmem [E, D] holds the router transposed, or at tp
    with the router split this device's [E/tp, D] and `gather` takes its logits [M, E/tp]
    to every device's, in device order [M, E] (an all-gather: copies, so the logits are
    bit-identical on every device and so is the routing). The numerics of `mk.model.ops.route`
    (softmax; with bias_vmem [1, E], gpt-oss's bias on the logits: `mk.model.ops.route_logits`,
    the softmax over the picked logits being the renormalised softmax's weights) or
    `mk.model.ops.route_grouped` (sigmoid: bias_vmem [1, E] holds the layer's choice bias)."""
    logits = transposed_dot(x[...], router_vmem[...])  # [M, E]
    if gather is not None:
        logits = gather(logits)
    if routing.router_score == "softmax" and bias_vmem is not None:
        logits = logits + bias_vmem[...].astype(jnp.float32)
    M, E = logits.shape
    expert = lax.broadcasted_iota(jnp.int32, (M, E), 1)
    if routing.router_score == "softmax":
        exp = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = choice = exp / jnp.sum(exp, axis=1, keepdims=True)  # [M, E]
        floor = 0.0  # the renormalisation's: x + 0.0 is x exactly
    else:
        scores, floor = jax.nn.sigmoid(logits), 1e-20
        choice = scores + bias_vmem[...].astype(jnp.float32)
        if routing.expert_groups > 1:
            choice = jnp.where(kept_groups(choice, expert, routing), choice, -jnp.inf)
    picked = jnp.zeros((M, E), jnp.bool_)
    left = choice
    for _ in range(routing.top_k):
        _, hit = _first_max(left, expert, E)  # the lowest expert id among the ties
        picked = picked | hit
        left = jnp.where(hit, -jnp.inf, left)  # never picked again
    weights = jnp.where(picked, scores, 0.0)
    if routing.renormalise:
        total = jnp.sum(weights, axis=1, keepdims=True)
        weights = weights / (total + floor)
    if routing.routed_scale != 1.0:
        weights = weights * np.float32(routing.routed_scale)
    combine_vmem[...] = weights
    return jnp.max(picked.astype(jnp.int32), axis=0, keepdims=True)
