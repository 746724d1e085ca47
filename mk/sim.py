"""The pipeline simulator: the megakernel's own tile schedule replayed on a model of a chip.

`simulate(config, chip, ...)` makes the `DecodePlan` the kernel executes
(`mk.kernels.plan`: its shard, tiles and `TileStream`; `DecodePlan.make(position=)`) and
walks the stream in
the kernel's program order (`mk.megakernel`; inside a layer the phases of
`mk.kinds.base.LAYER_PHASES`, the list `layer_body` runs, each layer kind's part by its
twin, `mk.kinds`): prime
the ring, per layer the prologue's wq/wk/wv (MLA's ring matrices, its DMA'd weights,
the absorption), the KV stream of `attend` (MLA's latent tiles), wo (or a linear
layer's mixer: the gated DeltaNet's or Kimi Delta Attention's projections, gates, conv and
delta rule), the dense MLP or the router (Kimi's sigmoid router with its bias), a shared
expert, expert selection and the expert slots, then the lm_head and argmax. Every
`start(g)` / `wait(g)` of the kernel is a DMA issue / a compute-lane wait here, with the
kernel's rule: consuming tile g issues tile g + slots, a switched-off segment's tiles are
neither loaded nor waited for, expert tiles issued before routing are no-ops, `ring.skip`
issues the tiles past the off expert slots. The result, `mk.machine.Simulation`, has the
step time, the HBM utilisation, a timeline of DMA and compute events and the bubbles
(HBM idle) with their causes (`mk.machine`: the DMA engine and the compute lane they are
replayed on, its records and the causes).

Modelling assumptions (`Assumptions` holds the numbers; none is fitted to a measurement):
- One DMA engine per device, first in first out, at `hbm_share` x the device's datasheet
  HBM bandwidth (`ChipSpec.device_hbm_bw`; hbm_share = 1.0, optimistic). A transfer
  issued at t starts moving at max(t + `dma_latency_s`, end of the transfer before it):
  the per-descriptor latency (0.5 us, an assumption, not measured) is hidden when the
  engine is busy. Weight tiles, KV tiles, KV write-backs, routers and the 4-byte-per-expert
  selection copy all share the engine. `Assumptions.measured(chip)` takes the latency and
  hbm_share from a TPU's measured file instead (`mk.measure`, data/measured/<chip>.json;
  `source` says which); `simulate` uses them only when passed them.
- Compute is one in-order lane. A weight tile [tk, tn] of the ring against M rows costs
  what the tile cost table says (`mk.feed_costs`, measured by compiling the ring kernel's
  own per-tile loop: `mk.probes.probe_tile`): its bundles per element for the chip, the
  weight's storage (its segment's scheme, or the format it is charged in, else the
  plain dtype), the segment's feed (the plan's `feeds`) and M rounded up to the next
  recorded M bucket, x tk*tn / the chip's clock at the `Assumptions.clock` end of its
  range (`mk.chips.ChipSpec.clock`: the clock is not known, so a step is simulated at
  each end). A chip with no rows, or M past the largest bucket, is an error, not a
  fallback to a rule. One alternative, as before: a whole compiled kernel's recorded
  per-tile loop (`Assumptions.tile_bundles` at the clock, or `tile_issue_s` seconds:
  `Ring.matmul`'s costliest loop over plain tiles, read from that kernel by
  `mk.bundles.measure`) is, when given, the cost of every plain tile of the block's shape
  instead of the table: it is the same quantity measured on that very kernel; likewise
  the packed tiles of a scheme and shape whose loop that kernel shows
  (`Assumptions.packed_bundles`; plain tiles of a shape of their own keep the table's
  row, `mk.bundles.TileCost.row` reports their loops). Products that are not ring tiles
  (KV tiles, the router and other weights moved by whole DMA, the delta rule) cost the MXU rule
  (`mk.perf.mxu_flops`: 2 * max(M, mxu_rows) * elements / peak, fewer rows than the MXU costing as
  many; the chip's `mxu_rows` from data/chips.csv; peak the device's dense bf16, or fp8 with
  compute="fp8", FLOP/s).
- Weight formats: a plan's `formats` (default the config's, e.g. kimi-k2-shaped's FP4 experts)
  move each tile of their groups at `mk.quant.tile_bytes` (packed data and scales) and
  cost the table's row of their scheme; where the kernel does not pack them (a group with
  a weight moved by whole DMA: `mk.kernels.plan.packed_formats`) this models a kernel that
  streams the plain tiles so packed and dequantises them in VMEM.
- Vector work (norms, RoPE, softmax, SwiGLU, the router's top-k, argmax) runs at
  `vpu_flops_ratio` (1/64) of the MXU bf16 peak in elementwise ops/s, an assumption (not on
  any datasheet); it is small in decode. The expert compaction loop runs on the scalar
  unit at `scalar_op_s` (2 ns, ~2 cycles at ~1 GHz, an assumption) per expert.
- Attention: every sequence sits at position `context`, so each reads
  (context + T - 1) // kv_tile + 1 KV tiles of K_dev x kv_tile x H (K and V: two DMAs;
  MLA's one latent tile of kv_tile x (R + Hr), `mk.kernels.plan.kv_layout`),
  through `kv_slots` (the kernel primes kv_slots - 1 of them right after the previous full
  layer's attention, across the layer edge, the first full layer's at the step's start);
  per tile 2 matmuls per kv
  head at the MXU rule with R = round_up(G*T, 8) rows, plus ~8 vector ops per
  score; the one or two tiles holding the new rows are written back from a staging slot,
  waited for only when write-back n + 2B needs that slot (normally a full layer later) and
  at the step's end (`mk.kernels.kv_stream.drain_write_backs`).
- Tensor parallelism (tp > 1): each device runs the kernel on the plan's shard (the
  kernel's own: `mk.kernels.plan`'s sharding model): query heads, FFN, each expert's width
  and the vocab split tp ways and padded to whole tiles, KV heads split or replicated when
  tp > K, every expert on every device. The collectives are the kernel's
  (`mk.kernels.collectives`): an all-reduce of the [M, D] float32 partial sums after wo and
  after the MLP, the argmax's all-gather after the lm_head, and where the plan splits the
  router by experts its logits' all-gather in each MoE layer (`mk.kinds.mlp.MoETwin`),
  each blocking the compute lane (`mk.perf.allreduce_s` by the plan's algorithm,
  `DecodePlan.collective`, each message round `Assumptions.ici_latency_s`:
  ICI_LATENCY_S, 1 us, by default).
- Active experts per MoE layer: the expected distinct experts of `mk.perf.experts_touched`
  (routing "uniform" by default, or a measured `mk.routing_trace.RoutingTrace`: its
  layers' mean), rounded; the same every layer and on every device (all route
  identically, each holds a slice of every expert: the busiest device is the mean).
- Not modelled: VMEM bandwidth and bank conflicts, DMA engine concurrency beyond one FIFO,
  HBM refresh and page effects, the XLA embedding gather before the kernel and the host
  dispatch, clock throttling, misses of the scalar core, the cost of switched-off tiles
  (each `pl.when` that skips a tile is free), speculative drafting. The per-layer norm
  vectors (two DMAs a layer, issued a layer ahead) and the final norm are DMAs here as in
  the kernel.

Here: `Assumptions`, `tile_seconds` (each ring segment's tile cost), `active_experts`,
`latency_slots` (Little's law), `simulate` -> `mk.machine.Simulation` (with its bytes per
family), `replay_matmul` (a stream of plain matmuls: the synthetic case with a closed
form). Not here: the DMA engine and the compute lane, their records and the bubble
causes (`mk.machine`), each layer kind's twin (`mk.kinds`), design sweeps and the
published numbers (`mk.review`), drawing (`mk.plots.timeline`, `bubble_bars`,
`sweep_lines`).

Speed: runs of identical tiles are fast-forwarded once the ring's state (landed times and
the engine's clock, relative to the compute clock) repeats, which is exact for the step
time and the bytes; each cycle's HBM idle time is split over causes in the proportions of
the cycle it repeats (tests compare both against the tile-by-tile replay).
"""

from __future__ import annotations

import dataclasses
import math

from mk import feed_costs, measure, perf, quant
from mk.chips import CLOCK_ENDS, ChipSpec, chip as named_chip
from mk.config import (DTYPE_BITS, ModelConfig, check_formats, finite_number,
                       positive_int)
from mk.kernels.collectives import ICI_LATENCY_S
from mk.kernels.common import BlockSizes
from mk.kernels.mlp import expert_slots
from mk.kernels.plan import DecodePlan, model_stream, ring_slots
from mk.kernels.stream import TileStream
from mk.kinds.base import LAYER_PHASES
from mk.kinds.layers import KINDS, kind_at, layer_kinds
from mk.machine import Machine, Simulation
from mk.routing_trace import RoutingTrace


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The numbers of the machine model (module docstring says where each comes from)."""

    hbm_share: float = 1.0
    dma_latency_s: float = 0.5e-6
    vpu_flops_ratio: float = 1 / 64
    scalar_op_s: float = 2e-9
    compute: str = "bf16"
    tile_issue_s: float = 0.0  # the per-tile loop's issue time in seconds, or
    tile_bundles: int = 0  # its bundles per trip (`mk.bundles.TileCost`), at the clock
    # ((scheme, tile_rows, tile_cols, bundles), ...): a whole kernel's per-tile loop of the
    # packed tiles of a scheme and shape, at the clock (`mk.bundles.TileCost.assumptions`)
    packed_bundles: tuple[tuple[str, int, int, int], ...] = ()
    clock: str = "low"  # end of the chip's range (`mk.chips.CLOCK_ENDS`)
    ici_latency_s: float = ICI_LATENCY_S  # one message round of a collective
    source: str = "assumed"  # where dma_latency_s and hbm_share come from (`measured`)

    def __post_init__(self):
        for field in ("hbm_share", "vpu_flops_ratio"):
            finite_number(f"Assumptions.{field}", getattr(self, field), 0, 1, open_low=True)
        for field in ("dma_latency_s", "scalar_op_s", "tile_issue_s", "ici_latency_s"):
            finite_number(f"Assumptions.{field}", getattr(self, field))
        if isinstance(self.tile_bundles, bool) or not isinstance(self.tile_bundles, int) \
                or self.tile_bundles < 0:
            raise ValueError(f"Assumptions.tile_bundles={self.tile_bundles!r} must be an "
                             "integer >= 0")
        for item in self.packed_bundles:
            if not (isinstance(item, tuple) and len(item) == 4 and item[0] in quant.SCHEMES
                    and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                            for v in item[1:])):
                raise ValueError(f"Assumptions.packed_bundles entry {item!r} must be "
                                 f"(scheme of {quant.SCHEMES}, tile_rows, tile_cols, "
                                 "bundles), positive integers")
        if self.tile_bundles and self.tile_issue_s:
            raise ValueError(f"Assumptions: tile_bundles={self.tile_bundles} and "
                             f"tile_issue_s={self.tile_issue_s!r} both set; give the issue "
                             "time one way")
        if self.clock not in CLOCK_ENDS:
            raise ValueError(f"Assumptions.clock={self.clock!r} must be one of {CLOCK_ENDS}")
        if self.compute not in perf.COMPUTES:
            raise ValueError(f"Assumptions.compute={self.compute!r} must be one of "
                             f"{perf.COMPUTES}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"Assumptions.source={self.source!r} must say where the DMA "
                             "numbers come from")

    @property
    def recorded_loop(self) -> bool:
        """Whether a whole kernel's per-tile loop is given (`tile_bundles` or
        `tile_issue_s`): then it, not the tile cost table, is every plain tile's cost."""
        return bool(self.tile_bundles or self.tile_issue_s)

    def issue_s(self, spec: ChipSpec) -> float:
        """The given per-tile issue time on `spec`: `tile_bundles` at its `clock` end,
        else `tile_issue_s` (0 when neither is given)."""
        return (self.tile_bundles / spec.clock(self.clock) if self.tile_bundles
                else self.tile_issue_s)

    # -- A measured file (mk.measure) ----------------------------------------------------
    @classmethod
    def measured(cls, chip: ChipSpec | str, path=None, **others) -> Assumptions:
        """dma_latency_s and hbm_share from the measured file of `chip` (`path`, else
        data/measured/<chip>.json when it exists: `mk.measure.sim_fields`), with `source`
        saying which; without a file the defaults, source "assumed". `others` set the
        other fields."""
        return cls(**others, **measure.sim_fields(chip, path))


def tile_seconds(stream: TileStream, spec: ChipSpec, m: int, formats, dtype: str,
                 a: Assumptions) -> dict[str, float]:
    """{segment name: seconds} one weight tile of each segment of `stream` keeps the
    compute lane busy against m rows (module docstring): for a plain tile of the block's
    shape the recorded loop of `a` when given, for a packed tile the recorded loop of its
    scheme and shape (`Assumptions.packed_bundles`) when given, else the tile cost
    table's row for the segment's storage (its group's scheme of `formats`, its own
    scheme, else plain `dtype`) and its feed at `a.clock`, for its tile's elements."""
    schemes = quant.schemes_of(formats)
    own = (stream.block.tile_rows, stream.block.tile_cols)
    packed = {(q, (r, c)): bundles for q, r, c, bundles in a.packed_bundles}

    def seconds(s) -> float:
        if a.recorded_loop and (s.scheme, s.tile) == (None, own):
            return a.issue_s(spec)
        if (s.scheme, s.tile) in packed:
            return packed[s.scheme, s.tile] / spec.clock(a.clock)
        return feed_costs.tile_s(spec, feed_costs.weight_dtype(
            dtype, schemes.get(s.name, s.scheme)), m, math.prod(s.tile), a.clock, s.feed)

    return {s.name: seconds(s) for s in stream.segments + stream.tail}


def active_experts(config: ModelConfig, m: int, routing: str | RoutingTrace = "uniform") -> int:
    """Active expert slots of one MoE layer: the expected distinct experts M rows touch
    (`mk.perf.experts_touched`), rounded. The same on every device: each holds a slice of
    every expert and all route identically (`mk.kernels.plan`'s sharding)."""
    perf.check_routing(routing, config)
    slots = expert_slots(config.experts, config.experts_per_token, m)
    mean = perf.experts_touched(config.experts, config.experts_per_token, m, routing)
    return max(1, min(slots, round(mean)))


# -- The replay of the megakernel ----------------------------------------------------------
# The phases a layer kind acts in; the others are `_Kernel.phase`'s own.
_KIND_PHASES = {phase for kind in KINDS for phase in kind.phases}


class _Kernel:
    """`mk.megakernel.megakernel_kernel`, step by step, on a `Machine`: the ring and the
    step's frame here, each layer kind's part by its twin (`mk.kinds.base.Twin`)."""

    def __init__(self, config, stream: TileStream, machine: Machine, *, m, batch, rows,
                 context, spec, tp, formats, experts_on, prefetch, a: Assumptions,
                 vocab: int, collective: str = "recursive"):
        self.c, self.s, self.mc, self.a = config, stream, machine, a
        self.vocab = vocab  # the logits' columns (the shard's vocab, padded to tiles)
        self.m, self.batch, self.rows, self.context, self.tp = m, batch, rows, context, tp
        self.collective_algorithm = collective
        self.prefetch, self.experts_on = prefetch, experts_on
        self.fast = True  # fast-forward runs of identical tiles (tests compare both ways)
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
        by the MXU rule (`mk.perf.mxu_flops`): what the products that are not ring tiles
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
        """Issue layer `layer`'s norm vectors (two DMAs, issued at the previous layer's
        start); `tag` names the HBM gap they may end (the step's start)."""
        c = self.c
        return max(self.mc.dma(8 * c.hidden, layer, "norms", tag),
                   self.mc.dma(8 * c.head_dim, layer, "qk_norms", tag))

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
    spec = named_chip(chip) if isinstance(chip, str) else chip
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
    (`mk.kernels.plan.ring_slots`, Little's law over the stream's own tiles, in config.dtype
    or their scheme of `formats`, default the config's) with bandwidth x latency in
    flight, at the assumed share of one core's bandwidth."""
    spec = named_chip(chip) if isinstance(chip, str) else chip
    a = assumptions or Assumptions()
    formats = check_formats(config, config.formats if formats is None else formats)
    stream = model_stream(config, block, 1, formats)
    bw = spec.device_hbm_bw * a.hbm_share
    return ring_slots(stream, DTYPE_BITS[config.dtype] // 8, bw * a.dma_latency_s)


def simulate(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1, rows: int = 1,
             context: int = 0, block: BlockSizes | None = None, tp: int = 1,
             cross_layer_prefetch: bool = True,
             routing: str | RoutingTrace = "uniform", experts_active: int | None = None,
             assumptions: Assumptions | None = None, formats=None,
             collective: str | None = None) -> Simulation:
    """Replay one decode step of the megakernel (module docstring) on one device of `chip`:
    the `DecodePlan` of `DecodePlan.make(config, batch=, rows=, position=, tp=, block=,
    formats=, collective=)` (formats: the mk.quant schemes of the groups stored
    quantised; default the config's own, {} for none; collective: the collectives'
    algorithm, default the plan's choice).

    context: the cached positions each sequence reads (its rows sit at positions context ..
    context + T - 1); block defaults to the plan's for this chip (`DecodePlan.make`: the ring
    Little's law asks for at `mk.kernels.plan.ring_cover_s`);
    routing: `mk.perf.experts_touched`'s (a `mk.routing_trace.RoutingTrace` of this model,
    or an assumed routing); experts_active overrides it (active expert slots per MoE
    layer).
    """
    spec = _tpu(chip)
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config={config!r} must be a ModelConfig")
    positive_int("rows", rows)
    _check_context(config, context, rows)
    perf.check_routing(routing, config)  # a trace of another model, as perf.predict
    if assumptions is not None and not isinstance(assumptions, Assumptions):
        raise ValueError(f"assumptions is a {type(assumptions).__name__}; it must be a "
                         "mk.sim.Assumptions")
    plan = DecodePlan.make(config, batch=batch, rows=rows, position=context, tp=tp,
                           block=block, formats=formats, chip=spec, kernel=False,
                           collective=collective)
    a = assumptions or Assumptions()
    on = 0
    if plan.expert_slots:  # 0 without MoE layers
        on = experts_active if experts_active is not None else active_experts(
            config, plan.M, routing)
        limit = plan.expert_slots
        if not 1 <= on <= limit:
            raise ValueError(f"experts_active={on} must be in [1, {limit}] (the expert "
                             "slots of the stream)")
    bw = spec.device_hbm_bw * a.hbm_share
    machine = Machine(bw, a.dma_latency_s)
    kernel = _Kernel(plan.local, plan.stream, machine, m=plan.M, batch=batch, rows=rows,
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
    kernel = _Kernel(None, stream, machine, m=rows, batch=rows, rows=1, context=0,
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
