"""The pipeline simulator: the megakernel's own tile schedule replayed on a model of a chip.

`simulate(plan, ...)` takes the `DecodePlan` the kernel executes (`mk.step.plan`,
made for a chip at a position) and walks its stream in the kernel's program order (each layer's
phases of `mk.kinds.base.LAYER_PHASES`, each layer kind's part by its twin, `mk.kinds`),
on `mk.cost.machine.Machine`: every `start(g)` / `wait(g)` of the kernel is a DMA issue / a
compute-lane wait here, with the kernel's rules for the ring, switched-off segments and
expert slots. The result, `mk.cost.machine.Simulation`, has the step time, the HBM
utilisation, a timeline of DMA and compute events and the bubbles with their causes.

Here: `Assumptions` (defined in `mk.cost.machine`), `Replay` (the kernel step by step; its
fast-forward `FAST_FORWARD`), `tile_seconds` (each ring segment's tile cost),
`active_experts`, `latency_slots` (Little's law), `simulate`, `replay_matmul` (a stream
of plain matmuls: the synthetic case with a closed form). Not here: the DMA engine,
the compute lane and their records (`mk.cost.machine`), each layer kind's twin (`mk.kinds`),
design sweeps and the published numbers (`mk.course.review`), drawing (`mk.plots`).

The modelling assumptions (each number, its source, what is not modelled) and the
fast-forward of repeated tiles: docs/design/mk.cost.sim.md.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from mk.cost import feed_costs, perf
from mk.model import quant
from mk.model.chips import ChipSpec, spec_of
from mk.model.config import DTYPE_BITS, ModelConfig, check_formats, positive_int
from mk.model.errors import shown
from mk.kernels.common import BlockSizes
from mk.kinds.mlp.mlp import expert_slots
from mk.step.plan import DecodePlan, model_stream, plan_chip
from mk.kernels.stream import ring_slots
from mk.kernels.stream import TileStream
from mk.kinds.base import LAYER_PHASES, STREAM
from mk.kinds.layers import KINDS, kind_at, layer_kinds
from mk.cost.machine import Assumptions, Machine, Simulation
from mk.cost.routing_trace import RoutingTrace


def tile_seconds(stream: TileStream, spec: ChipSpec, m: int, formats, dtype: str,
                 a: Assumptions) -> dict[str, float]:
    """{segment name: seconds} one weight tile of each segment of `stream` keeps the
    compute lane busy against m rows (module docstring): for a plain tile of the block's
    shape the recorded loop of `a` when given, for a packed tile the recorded loop of its
    scheme and shape (`Assumptions.packed_bundles`) when given, else the tile cost
    table's row for the segment's storage (its group's scheme of `formats`, its own
    scheme, else plain `dtype`) and its feed at `a.rate_end`, for its tile's elements."""
    schemes = quant.schemes_of(formats)
    own = (stream.block.tile_rows, stream.block.tile_cols)
    packed = {(q, (r, c)): bundles for q, r, c, bundles in a.packed_bundles}

    def seconds(s) -> float:
        if a.recorded_loop and (s.scheme, s.tile) == (None, own):
            return a.issue_s(spec, m)
        if (s.scheme, s.tile) in packed:
            return packed[s.scheme, s.tile] / spec.bundle_rate(a.rate_end, m)
        return feed_costs.tile_s(spec, feed_costs.weight_dtype(
            dtype, schemes.get(s.name, s.scheme)), m, math.prod(s.tile), a.rate_end, s.feed)

    return {s.name: seconds(s) for s in stream.segments + stream.tail}


def active_experts(config: ModelConfig, m: int, routing: str | RoutingTrace = "uniform") -> int:
    """Active expert slots of one MoE layer: the expected distinct experts M rows touch
    (`mk.cost.perf.experts_touched`), rounded. The same on every device: each holds a slice of
    every expert and all route identically (`mk.step.plan`'s sharding)."""
    perf.check_routing(routing, config)
    slots = expert_slots(config.experts, config.experts_per_token, m)
    mean = perf.experts_touched(config.experts, config.experts_per_token, m, routing)
    return max(1, min(slots, round(mean)))


# -- The replay of the megakernel ----------------------------------------------------------
# The phases a layer kind acts in; the others are `Replay.phase`'s own.
_KIND_PHASES = {phase for kind in KINDS for phase in kind.phases}


# Whether a replay fast-forwards runs of identical tiles (exact: a test switches it off and
# compares, tests/builders.replay_tile_by_tile).
FAST_FORWARD = True


class Replay:
    """`mk.step.megakernel.megakernel_kernel`, step by step, on a `Machine`: the ring and the
    step's frame here, each layer kind's part by its twin (`mk.kinds.base.Twin`, which
    acts on it). `simulate` and `replay_matmul` make one and run it."""

    def __init__(self, config, stream: TileStream, machine: Machine, *, m, batch, rows,
                 context, spec, tp, formats, experts_on, prefetch, a: Assumptions,
                 vocab: int, collective: str = "recursive"):
        self.c, self.s, self.mc, self.a = config, stream, machine, a
        self.vocab = vocab  # the logits' columns (the shard's vocab, padded to tiles)
        self.m, self.batch, self.rows, self.context, self.tp = m, batch, rows, context, tp
        self.collective_algorithm = collective
        self.prefetch, self.experts_on = prefetch, experts_on
        self.fast = FAST_FORWARD  # fast-forward runs of identical tiles
        self.n = stream.block.slots
        self.peak = perf.peak_flops(spec, a.compute) / spec.cores_per_chip
        self.vpu = spec.bf16_flops / spec.cores_per_chip * a.vpu_flops_ratio
        self.mxu = spec.mxu_rows
        self.spec = spec
        schemes = quant.schemes_of(formats)  # packed, or charged so on plain tiles
        item = DTYPE_BITS[config.dtype if config is not None else "bfloat16"] / 8
        self.tile_bytes = {s.name: quant.tile_bytes(schemes[s.name], *s.tile) if s.name in
                           schemes else stream.segment_tile_bytes(s, item)
                           for s in stream.segments + stream.tail}
        self.tile_s = tile_seconds(stream, spec, m, formats, config.dtype if config is not None
                                   else "bfloat16", a)
        self.landed: dict[int, float] = {}
        self.layer = 0  # the layer the kernel is in (for prefetch off)
        self.kinds = layer_kinds(config) if config is not None else ()
        self.twins = {kind: kind.twin(self) for kind in self.kinds}  # `mk.kinds`' twins
        self.owner = {name: twin for kind, twin in self.twins.items()  # segment -> twin
                      for name in kind.segment_names()}
        self.period, self.total = stream.period, stream.total  # properties: sum each call
        self.layered = stream.layers * self.period
        # local tile offset -> (segment, copy, what) of one layer's period and of the tail
        self.local = [None] * self.period
        self.tail = [None] * (self.total - self.layered)
        for table, segments in ((self.local, stream.segments), (self.tail, stream.tail)):
            for offset, (seg, copy) in stream.owners(segments).items():
                table[offset] = (seg, copy, f"{seg.name}[{copy}]" if seg.stride else seg.name)

    # The ring: start / wait / matmul / skip, as in mk.kernels.ring.Ring
    def locate(self, g):
        if g < self.layered:
            return (g // self.period,) + self.local[g % self.period]
        return (self.s.layers,) + self.tail[g - self.layered]

    def active(self, layer, seg, copy) -> bool:
        """Whether a tile loads: its kind's rule (`mk.kinds.base.Twin.active`)."""
        owner = self.owner.get(seg.name)
        return owner is None or owner.active(layer, seg.name, copy)

    def start(self, g, tag=""):
        if g >= self.total:
            return
        layer, seg, copy, what = self.locate(g)
        if not self.prefetch and layer != self.layer:
            return  # a kernel without cross-layer prefetch primes each layer at its start
        if self.active(layer, seg, copy):
            self.landed[g] = self.mc.dma(self.tile_bytes[seg.name], layer, what, tag)

    def wait(self, g):
        self.mc.wait(self.landed.pop(g))

    def mxu_s(self, rows, elements) -> float:
        """One pass of `rows` activation rows over `elements` weights at one core's peak,
        by the MXU rule (`mk.cost.perf.mxu_flops`): what the products that are not ring tiles
        cost (KV tiles, weights moved by whole DMA)."""
        return perf.mxu_flops(rows, elements, self.mxu) / self.peak

    def matmul(self, name, copy=0):
        """`Ring.matmul`: per tile wait, compute, issue the tile `slots` ahead. Once a tile
        repeats the previous one's timing exactly (same gaps, same issue), the rest of the
        run of identical tiles is fast-forwarded (`Machine.shift`)."""
        seg = self.s.segment(name)
        base = self.s.base(self.layer, seg, copy)
        mc, n = self.mc, self.n
        seconds = self.tile_s[name]
        what = "lm_head" if name == "lm_head" else (f"{name}[{copy}]" if seg.stride else name)
        seen, history, t = {}, [], 0  # state -> tile index; (now, gaps) per tile
        while t < seg.tiles:
            g = base + t
            mc.gap_log = []
            self.wait(g)
            mc.compute(seconds, self.layer, what)
            self.start(g + n)
            t += 1
            # a state costs O(slots) to build: worth it only while a run of at least
            # slots tiles is left to skip (a deep ring over short matrices has none)
            state = self._state(g + 1) if self.fast and seg.tiles - t > n else None
            history.append((mc.now, mc.gap_log))
            if state is None:
                seen, history = {}, history[-1:]
                continue
            if state not in seen:
                seen[state] = len(history) - 1
                continue
            p = len(history) - 1 - seen[state]  # the ring repeats every p tiles
            cycles = self._repeatable(g + 1, base + seg.tiles) // p
            period = mc.now - history[-1 - p][0]
            if cycles and period > 0:
                gaps = [pair for _, log in history[-p:] for pair in log]
                mc.shift(cycles, p, period, gaps, seconds,
                         self.tile_bytes[self.locate(g + n)[1].name])
                for h in sorted(self.landed, reverse=True):
                    self.landed[h + cycles * p] = self.landed.pop(h) + cycles * period
                t += cycles * p
            seen, history = {}, history[-1:]

    def _state(self, g):
        """Everything the next tiles' timing depends on, relative to the compute clock
        and on a 0.1 ps grid (hashable): the machine's state and landed - now of the tiles
        of g .. g+slots-1 still in flight (the engine lands them in order, so the scan
        stops at the first landed one); None unless tile g+slots-1 was issued."""
        now, landed = self.mc.now, self.landed
        if g + self.n - 1 not in landed:
            return None
        flight = []
        for h in range(g + self.n - 1, g - 1, -1):
            t = landed.get(h)
            if t is None or t <= now:
                break
            flight.append(round((t - now) * 1e13))
        return self.mc.state() + tuple(flight)

    def _repeatable(self, g, end):
        """How many tiles from g on repeat the last one: consumed before `end`, and the
        tiles they issue (g + slots ...) continue the run (one matrix, one copy) of the
        tile the last one issued, which is active and untagged."""
        issued = g + self.n - 1
        if issued + 1 >= self.total:
            return 0
        layer, seg, copy, _ = self.locate(issued)
        if not self.active(layer, seg, copy) or (not self.prefetch and layer != self.layer):
            return 0
        first = (layer * self.period if issued < self.layered else self.layered)
        run_end = first + seg.start + copy * seg.stride + seg.tiles
        return max(0, min(end - g, run_end - issued - 1))

    def skip(self, first, end, tag=""):
        for t in range(self.n):
            g = end - self.n + t
            if g >= first:
                self.start(g + self.n, tag)

    def prime_layer(self, first, tag):
        for g in range(first, min(first + self.n, self.total)):
            self.start(g, tag)

    def region(self, first, last):
        a, b = self.s.segment(first), self.s.segment(last)
        return (self.s.base(self.layer, a),
                self.s.base(self.layer, b) + (b.copies - 1) * b.stride + b.tiles)

    def vector(self, ops, what):
        self.mc.compute(ops / self.vpu, self.layer, what)

    def collective(self, nbytes):
        if self.tp > 1:
            self.mc.compute(perf.allreduce_s(nbytes, self.tp, self.spec,
                                             self.collective_algorithm,
                                             self.a.ici_latency_s), self.layer, "collective")

    def vectors(self, layer, tag=""):
        """Issue layer `layer`'s norm vectors (two DMAs, then one per `Kind.vectors` of its
        kinds, issued at the previous layer's start); `tag` names the HBM gap they may end
        (the step's start)."""
        c = self.c
        return max([self.mc.dma(8 * c.hidden, layer, "norms", tag),
                    self.mc.dma(8 * c.head_dim, layer, "qk_norms", tag)]
                   + [self.mc.dma(8 * width, layer, name, tag) for kind in self.kinds
                      for name, width in kind.vectors().items()])

    # The kernel
    def run(self):
        """`megakernel_kernel`: prime the ring, the final norm, the first norms, each
        kind's start; per layer its kinds' `begin` and `LAYER_PHASES` (`layer_body`); the
        lm_head, each kind's finish, argmax."""
        c, M, D = self.c, self.m, self.c.hidden
        twins = self.twins
        self.prime_layer(0, "step start")
        final_norm = self.mc.dma(4 * D, c.layers, "final_norm", "step start")
        vectors = self.vectors(0, "step start")
        for twin in twins.values():
            twin.start()
        for layer in range(c.layers):
            self.layer = layer
            ours = [kind_at(self.kinds, role, layer)[0] for role in ("mixer", "mlp")]
            ours += [k for k in self.kinds if k.role == STREAM]  # every layer's
            self.mc.wait(vectors)
            if layer and not self.prefetch:  # a kernel that primes each layer at its start:
                self.prime_layer(layer * self.period, "layer boundary")  # these close the
                for kind in ours:  # layer edge's gap
                    twins[kind].boundary()
            if layer + 1 < c.layers:  # the ring's next tiles, not these, close a layer
                vectors = self.vectors(layer + 1)  # edge's gap
            for kind in ours:
                twins[kind].begin()
            for phase in LAYER_PHASES:  # the kernel's own order (`layer_body`)
                for kind, twin in twins.items():
                    mine = kind in ours
                    if phase == kind.stream_phase and not mine:
                        self.skip(*self.region(*kind.region()), kind.skip_tag)
                    if phase in kind.phases and mine:
                        twin.run(phase)
                self.phase(phase)
        self.layer = c.layers
        if not self.prefetch:
            self.prime_layer(self.layered, "layer boundary")
        self.mc.wait(final_norm)
        self.vector(4 * M * D, "final_norm")
        self.matmul("lm_head")
        for twin in reversed(twins.values()):
            twin.finish()
        self.vector(4 * M * self.vocab, "argmax")
        self.collective(8 * M)

    def phase(self, name: str):
        """A phase's own part of `layer_body` (the kinds' parts are their twins')."""
        M, D = self.m, self.c.hidden
        if name in ("attn_all_reduce", "mlp_all_reduce"):
            self.collective(M * D * perf.PARTIAL_SUM_BYTES)
        elif name == "mlp_norm":
            self.vector(5 * M * D, "norm")
        elif name == "residual":
            self.vector(M * D, "residual")
        elif name not in _KIND_PHASES:
            raise ValueError(f"no cost model for layer phase {name!r}")

    def run_matmuls(self):
        """A stream of plain matmuls (no attention, no MLP logic): `replay_matmul`."""
        self.prime_layer(0, "step start")
        for layer in range(self.s.layers):
            self.layer = layer
            if layer and not self.prefetch:
                self.prime_layer(layer * self.period, "layer boundary")
            for seg in self.s.segments:
                for copy in range(seg.copies):
                    self.matmul(seg.name, copy)
        self.layer = self.s.layers
        if self.s.tail and not self.prefetch:
            self.prime_layer(self.layered, "layer boundary")
        for seg in self.s.tail:
            self.matmul(seg.name)


def _tpu(chip) -> ChipSpec:
    spec = spec_of(chip)
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}: the simulator models a TPU "
                         "core's DMA ring and MXU")
    return spec


def _check_context(config: ModelConfig, context, rows: int) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context={context!r} must be a non-negative integer")
    if context + rows > config.max_position:
        raise ValueError(f"context+rows={context + rows} exceeds {config.name}'s "
                         f"max_position={config.max_position}")


def latency_slots(config: ModelConfig, chip: ChipSpec | str, block: BlockSizes, *,
                  formats=None, assumptions: Assumptions | None = None) -> int:
    """Ring slots that keep HBM busy through one descriptor latency: the plan's rule
    (`mk.kernels.stream.ring_slots`, Little's law over the stream's tiles, in config.dtype
    or their scheme of `formats`, default the config's) with bandwidth x latency in
    flight, at the assumed share of one core's bandwidth."""
    spec = spec_of(chip)
    a = assumptions or Assumptions()
    formats = check_formats(config, config.formats if formats is None else formats)
    stream = model_stream(config, block, 1, formats)
    bw = spec.device_hbm_bw * a.hbm_share
    return ring_slots(stream, DTYPE_BITS[config.dtype] // 8, bw * a.dma_latency_s)


def simulate(plan: DecodePlan, *, cross_layer_prefetch: bool = True,
             routing: str | RoutingTrace = "uniform", experts_active: int | None = None,
             assumptions: Assumptions | None = None) -> Simulation:
    """Replay one decode step of the megakernel (module docstring): the step of `plan` on
    one device of the chip it was made for, every sequence at its position (make it with
    `DecodePlan.make(config, chip=, batch=, rows=, position=, tp=, ...)`: the position is
    the cached positions each sequence reads, its rows at position .. position + T - 1;
    `kernel=False` for a step no core holds; its block defaults to the ring Little's law
    asks for at `mk.step.plan.ring_cover_s`).

    routing: `mk.cost.perf.experts_touched`'s (a `mk.cost.routing_trace.RoutingTrace` of this model,
    or an assumed routing); experts_active overrides it (active expert slots per MoE
    layer).
    """
    spec = _tpu(plan_chip(plan, "the simulator replays the step"))
    config, batch, rows, context = plan.config, plan.batch, plan.rows, plan.position
    if context is None:
        raise ValueError(f"a plan of a cache of context={plan.context}: the simulator "
                         "replays every sequence at a position (`DecodePlan.make(position=)`)")
    _check_context(config, context, rows)
    perf.check_routing(routing, config)  # a trace of another model, as perf.predict
    if assumptions is not None and not isinstance(assumptions, Assumptions):
        raise ValueError(f"assumptions is a {type(assumptions).__name__}; it must be a "
                         "mk.cost.sim.Assumptions")
    if not isinstance(cross_layer_prefetch, (bool, np.bool_)):  # "no" would be truthy
        raise ValueError(f"cross_layer_prefetch={shown(cross_layer_prefetch)} must be True "
                         "or False")
    a = assumptions or Assumptions()
    on = 0
    if experts_active is not None and not plan.expert_slots:
        raise ValueError(f"experts_active={shown(experts_active)}: {config.name} has no MoE "
                         "layers, so no expert slots to fill (leave it None)")
    if plan.expert_slots:  # 0 without MoE layers
        on = experts_active if experts_active is not None else active_experts(
            config, plan.M, routing)
        limit = plan.expert_slots
        if isinstance(on, bool) or not isinstance(on, numbers.Integral) or not 1 <= on <= limit:
            raise ValueError(f"experts_active={on} must be in [1, {limit}] (the expert "
                             "slots of the stream)")
    bw = spec.device_hbm_bw * a.hbm_share
    machine = Machine(bw, a.dma_latency_s)
    kernel = Replay(plan.local, plan.stream, machine, m=plan.M, batch=batch, rows=rows,
                     context=context, spec=spec, tp=plan.tp, formats=dict(plan.formats),
                     experts_on=on, prefetch=cross_layer_prefetch, a=a, vocab=plan.vocab,
                     collective=plan.collective)
    kernel.run()
    step_s = machine.finish()
    return Simulation(
        config_name=config.name, chip_name=spec.name, batch=batch, rows=rows,
        context=context, tp=plan.tp, block=plan.block,
        cross_layer_prefetch=cross_layer_prefetch, experts_active=on, hbm_bandwidth=bw,
        step_s=step_s, dma_bytes=machine.dma_bytes, weight_bytes=machine.weight_bytes,
        events=machine.event_records(plan.local.layers),
        bubbles=machine.bubble_records(plan.local.layers), assumptions=a, plan=plan)


def replay_matmul(stream: TileStream, chip: ChipSpec | str, *, rows: int = 1,
                  cross_layer_prefetch: bool = True,
                  assumptions: Assumptions | None = None) -> Simulation:
    """Replay a stream of plain matmuls (every segment of every layer, then the tail; bf16
    tiles, or a quantised segment's packed ones): the synthetic case. With N tiles of DMA
    time d = tile bytes / bandwidth, compute time c, latency l and s >= 2 slots with l
    small enough, the step is l + N*d + c if c <= d and l + d + N*c if c > d; with one
    slot it is N*(l + d + c)."""
    spec = _tpu(chip)
    positive_int("rows", rows)
    a = assumptions or Assumptions()
    bw = spec.device_hbm_bw * a.hbm_share
    machine = Machine(bw, a.dma_latency_s)
    kernel = Replay(None, stream, machine, m=rows, batch=rows, rows=1, context=0,
                     spec=spec, tp=1, formats={},
                     experts_on=0, prefetch=cross_layer_prefetch, a=a, vocab=0)
    kernel.run_matmuls()
    step_s = machine.finish()
    return Simulation(
        config_name="matmul stream", chip_name=spec.name, batch=rows, rows=1, context=0,
        tp=1, block=stream.block, cross_layer_prefetch=cross_layer_prefetch,
        experts_active=0, hbm_bandwidth=bw, step_s=step_s, dma_bytes=machine.dma_bytes,
        weight_bytes=machine.weight_bytes, events=machine.event_records(stream.layers),
        bubbles=machine.bubble_records(stream.layers), assumptions=a)
