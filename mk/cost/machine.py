"""The simulator's machine: one device as a FIFO DMA engine beside an in-order compute
lane (`Machine`), the numbers it runs at (`Assumptions`) and its records: `Event` (a run
of one lane's intervals), `Bubble` (a run of HBM-idle time with its cause, one of
`CAUSES`) and `Simulation` (one simulated step: its events, bubbles, bytes and the views
on them, which `mk.cost.sim.simulate` returns).

`mk.cost.sim` replays the megakernel's schedule on it: each DMA the kernel issues is
`Machine.dma` (it starts at max(issue + latency, the end of the transfer before it)),
each compute phase `Machine.compute`, each wait `Machine.wait`; `Machine.shift`
fast-forwards repetitions of a run of identical tiles exactly.

Not here: what is issued and computed when (`mk.cost.sim`'s replay and the layer kinds'
twins, `mk.kinds`). Where each assumed number comes from and what each bubble cause
means: docs/design/mk.cost.sim.md and docs/design/mk.cost.machine.md.
"""

from __future__ import annotations

import dataclasses

from mk.measure import measure
from mk.cost import perf
from mk.model import quant
from mk.model.chips import RATE_ENDS, ChipSpec
from mk.model.config import finite_number
from mk.model.errors import shown
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan
from mk.step.step_bytes import family_of

CAUSES = ("step start", "layer boundary", "routing", "attention", "lm_head", "collective",
          "compute", "vector", "ring empty", "step end", "skipped mixer")


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The numbers of the machine model (docs/design/mk.cost.sim.md says where each comes
    from)."""

    hbm_share: float = 1.0
    dma_latency_s: float = 0.5e-6
    vpu_flops_ratio: float = 1 / 64
    scalar_op_s: float = 2e-9
    compute: str = "bf16"
    tile_issue_s: float = 0.0  # the per-tile loop's issue time in seconds, or
    tile_bundles: int = 0  # its bundles per trip (`mk.cost.bundles.TileCost`), at the rate
    # ((scheme, tile_rows, tile_cols, bundles), ...): a whole kernel's per-tile loop of the
    # packed tiles of a scheme and shape, at the rate (`mk.cost.bundles.TileCost.assumptions`)
    packed_bundles: tuple[tuple[str, int, int, int], ...] = ()
    rate_end: str = "slow"  # end of the chip's bundle rate (`mk.model.chips.RATE_ENDS`)
    # One message round of a collective; None: the chip's (`mk.kernels.collectives.round_s`)
    ici_latency_s: float | None = None
    # The attention loop as a chip ran it (`mk.cost.calibration`; 0: the tile cost model alone):
    kv_bytes_per_s: float = 0.0  # KV bytes a second, once the loop is not waiting on DMA
    sequence_s: float = 0.0  # each sequence's fixed cost in each attention layer
    source: str = "assumed"  # where the measured fields come from (`measured`)

    def __post_init__(self):
        for field in ("hbm_share", "vpu_flops_ratio"):
            finite_number(f"Assumptions.{field}", getattr(self, field), 0, 1, open_low=True)
        for field in ("dma_latency_s", "scalar_op_s", "tile_issue_s", "ici_latency_s",
                      "kv_bytes_per_s", "sequence_s"):
            if field != "ici_latency_s" or self.ici_latency_s is not None:
                finite_number(f"Assumptions.{field}", getattr(self, field))
        if isinstance(self.tile_bundles, bool) or not isinstance(self.tile_bundles, int) \
                or self.tile_bundles < 0:
            raise ValueError(f"Assumptions.tile_bundles={self.tile_bundles!r} must be an "
                             "integer >= 0")
        if not isinstance(self.packed_bundles, tuple):  # a tuple: Assumptions are hashed
            raise ValueError(f"Assumptions.packed_bundles={shown(self.packed_bundles)} must "
                             "be a tuple of (scheme, tile_rows, tile_cols, bundles)")
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
        if self.rate_end not in RATE_ENDS:
            raise ValueError(f"Assumptions.rate_end={self.rate_end!r} must be one of "
                             f"{RATE_ENDS}")
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

    def issue_s(self, spec: ChipSpec, m: int) -> float:
        """The given per-tile issue time on `spec` against m rows: `tile_bundles` at its
        bundle rate's `rate_end` (`mk.model.chips.ChipSpec.bundle_rate`), else
        `tile_issue_s` (0 when neither is given)."""
        return (self.tile_bundles / spec.bundle_rate(self.rate_end, m) if self.tile_bundles
                else self.tile_issue_s)

    # -- A measured file (mk.measure.measure) ----------------------------------------------------
    @classmethod
    def measured(cls, chip: ChipSpec | str, path=None, **others) -> Assumptions:
        """dma_latency_s and hbm_share from the measured file of `chip` (`path`, else
        data/measured/<chip>.json when it exists: `mk.measure.measure.sim_fields`), with `source`
        saying which; without a file the defaults, source "assumed". `others` set the
        other fields."""
        return cls(**others, **measure.sim_fields(chip, path))


@dataclasses.dataclass(frozen=True)
class Event:
    """A run of consecutive intervals of one lane with the same layer and `what`."""

    lane: str  # "dma" or "compute"
    start_s: float
    end_s: float
    layer: int | None  # None for the lm_head and what follows it
    what: str  # a matrix ("wq", "we_gate[3]", "lm_head"), "k_tile", "attention", ...
    busy_s: float  # time the lane was busy within [start_s, end_s]
    count: int  # intervals merged
    bytes: float = 0.0  # DMA bytes


@dataclasses.dataclass(frozen=True)
class Bubble:
    """A run of HBM-idle gaps with one cause in one layer."""

    start_s: float
    end_s: float
    cause: str
    layer: int | None
    idle_s: float  # HBM idle time within [start_s, end_s]


_PHASE_CAUSE = {"attention": "attention", "k_tile": "attention", "v_tile": "attention",
                "k_write_back": "attention", "v_write_back": "attention",
                "lm_head": "lm_head", "argmax": "lm_head", "final_norm": "lm_head",
                "collective": "collective", "router": "routing", "selected": "routing"}
_VECTOR = ("norm", "qk_norm_rope", "swiglu", "combine", "residual")


def _cause(what: str) -> str:
    if what in _PHASE_CAUSE:
        return _PHASE_CAUSE[what]
    return "vector" if what in _VECTOR else "compute"


def _layer(layer, layers: int):
    """A run's layer, None past the model's `layers`."""
    return layer if layer is not None and layer < layers else None


_WHOLE_GAP = ("step start", "layer boundary", "routing", "attention",  # DMA issue tags
              "skipped mixer")


class Machine:
    """A FIFO DMA engine and an in-order compute lane. Intervals are merged into runs of
    one (layer, what) as they happen. An HBM-idle gap is classified once the compute lane
    has passed its end: by the compute phase running during it, "ring empty" where the
    lane was waiting, or whole by the tag of the transfer that ends it (module
    docstring). Memory grows with the runs, not with the tiles."""

    def __init__(self, bw: float, latency: float):
        self.bw, self.latency = bw, latency
        self.now = 0.0  # the compute lane's clock
        self.dma_free = 0.0  # when the engine has moved everything issued so far
        self.dma_bytes = 0.0
        self.weight_bytes = 0.0
        self.events = {"dma": [], "compute": []}  # finished runs
        self.run = {"dma": None, "compute": None}  # [layer, what, start, end, busy, n, bytes]
        self.recent = []  # compute intervals (start, end, what) that pending gaps may need
        self.pending = []  # HBM-idle gaps (start, end, layer) not yet classified
        self.bubbles = []  # [start, end, cause, layer, idle]
        self.gap_log = []  # (bubble record, idle) since the caller last cleared it

    def _extend(self, lane, layer, what, start, end, nbytes=0.0):
        run = self.run[lane]
        if run is not None and run[0] == layer and run[1] == what:
            run[3] = end
            run[4] += end - start
            run[5] += 1
            run[6] += nbytes
            return
        if run is not None:
            self.events[lane].append(tuple(run))
        self.run[lane] = [layer, what, start, end, end - start, 1, nbytes]

    def _bubble(self, start, end, cause, layer):
        if end <= start:
            return
        for last in self.bubbles[-1:-4:-1]:  # alternating causes extend their own record
            if last[2] == cause and last[3] == layer:
                last[1] = end
                last[4] += end - start
                self.gap_log.append((last, end - start))
                return
        self.bubbles.append([start, end, cause, layer, end - start])
        self.gap_log.append((self.bubbles[-1], end - start))

    def _resolve(self, until: float, idle: str = "ring empty") -> None:
        """Classify the pending gaps that end by `until` (all of them at the step end)."""
        while self.pending and (self.pending[0][1] <= until or idle == "step end"):
            start, end, layer = self.pending.pop(0)
            t = start
            for a, b, what in self.recent:
                if b <= t or a >= end:
                    continue
                if a > t:
                    self._bubble(t, a, idle, layer)
                self._bubble(max(a, t), min(b, end), _cause(what), layer)
                t = min(b, end)
            self._bubble(t, end, idle, layer)
        first = self.pending[0][0] if self.pending else self.dma_free
        if self.recent and self.recent[0][1] <= first:
            self.recent = [r for r in self.recent if r[1] > first]

    issued: list | None = None  # a list (a test's): (what, bytes) of every `dma`, in
    #                              issue order; `shift` records none (fast-forward off)

    def dma(self, nbytes: float, layer: int, what: str, tag: str = "",
            weight: bool = True) -> float:
        """Issue a transfer now; returns when it has landed."""
        if self.issued is not None:
            self.issued.append((what, nbytes))
        start = max(self.now + self.latency, self.dma_free)
        if start > self.dma_free:
            if tag in _WHOLE_GAP:
                self._bubble(self.dma_free, start, tag, layer)
            else:
                self.pending.append((self.dma_free, start, layer))
        end = start + nbytes / self.bw
        self.dma_free = end
        self.dma_bytes += nbytes
        self.weight_bytes += nbytes if weight else 0.0
        self._extend("dma", layer, what, start, end, nbytes)
        return end

    def compute(self, seconds: float, layer: int, what: str) -> None:
        if seconds > 0:
            end = self.now + seconds
            self._extend("compute", layer, what, self.now, end)
            if self.pending or end > self.dma_free:
                self.recent.append((self.now, end, what))
            self.now = end
            if self.pending and self.pending[0][1] <= end:
                self._resolve(end)

    def wait(self, t: float) -> None:
        if t > self.now:
            self.now = t
            if self.pending and self.pending[0][1] <= t:
                self._resolve(t)

    def state(self) -> tuple:
        """dma_free relative to the compute clock (0.1 ps grid): with the ring's landed
        times, all the next tiles' timing depends on."""
        return (round((self.dma_free - self.now) * 1e13),)

    def shift(self, cycles: int, tiles: int, period: float, gaps: list, busy: float,
              nbytes: float) -> None:
        """Fast-forward `cycles` repetitions of the last `tiles` tiles, which advanced every
        clock by `period` and classified the `gaps` (bubble record, idle) pairs; each tile
        computes `busy` seconds and moves `nbytes`. The recurrence is shift-invariant, so
        this is the exact replay of those repetitions."""
        dt = cycles * period
        # HBM idle time one cycle opens: the engine moves `tiles` tiles per period
        created = period - tiles * nbytes / self.bw
        resolved = sum(idle for _, idle in gaps)
        if created > 1e-18 and resolved <= 0:  # nothing classified yet: by the lane's use
            cause = "compute" if period <= tiles * busy * (1 + 1e-9) else "ring empty"
            self.bubbles.append([self.now, self.now, cause, self.run["compute"][0], 0.0])
            gaps, resolved = [(self.bubbles[-1], created)], created
        self.now += dt
        self.dma_free += dt
        for record in {id(r): r for r, _ in gaps}.values():
            record[1] += dt
        for record, idle in gaps:  # the cycle's mix of causes, scaled to what it opened
            record[4] += cycles * idle * (created / resolved if resolved > 0 else 0.0)
        n = cycles * tiles
        for lane, seconds, moved in (("compute", busy, 0.0), ("dma", nbytes / self.bw, nbytes)):
            run = self.run[lane]
            run[3] += dt
            run[4] += n * seconds
            run[5] += n
            run[6] += n * moved
        self.dma_bytes += n * nbytes
        self.weight_bytes += n * nbytes
        self.recent = [(a + dt, b + dt, w) for a, b, w in self.recent]
        self.pending = [(a + dt, b + dt, layer) for a, b, layer in self.pending]

    def finish(self) -> float:
        """Close the runs; the step ends when both lanes are done."""
        step = max(self.now, self.dma_free)
        if step > self.dma_free:
            self.pending.append((self.dma_free, step, None))
        self._resolve(step, "step end")
        for lane, run in self.run.items():
            if run is not None:
                self.events[lane].append(tuple(run))
        return step

    # -- Its records
    def event_records(self, layers: int) -> tuple[Event, ...]:
        """The finished runs (`finish` first) as `Event`s in start order; a layer past
        `layers` (the lm_head's and what follows) is None."""
        out = [Event(lane, start, end, _layer(layer, layers), what, busy, n, nbytes)
               for lane, runs in self.events.items()
               for layer, what, start, end, busy, n, nbytes in runs]
        return tuple(sorted(out, key=lambda e: (e.start_s, e.lane)))

    def bubble_records(self, layers: int) -> tuple[Bubble, ...]:
        """The classified HBM-idle runs as `Bubble`s (layers as `event_records`)."""
        return tuple(Bubble(a, b, cause, _layer(layer, layers), idle)
                     for a, b, cause, layer, idle in self.bubbles)


# -- The result of a simulated step ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Simulation:
    """One simulated decode step on one device (the busiest, with expert parallelism)."""

    config_name: str
    chip_name: str
    batch: int
    rows: int
    context: int
    tp: int
    block: BlockSizes
    cross_layer_prefetch: bool
    experts_active: int  # per MoE layer on this device; 0 for a dense model
    hbm_bandwidth: float  # bytes/s of this device's DMA engine
    step_s: float
    dma_bytes: float
    weight_bytes: float  # of the DMA bytes: weight tiles, routers
    events: tuple[Event, ...]
    bubbles: tuple[Bubble, ...]
    assumptions: Assumptions
    plan: DecodePlan | None = None  # what was replayed (None for `replay_matmul`)

    def family_bytes(self) -> dict[str, float]:
        """DMA bytes per byte family (`mk.step.step_bytes.family_of`); the flags' local
        VMEM -> SMEM copy ("selected") is not HBM traffic and is left out."""
        out: dict[str, float] = {}
        for e in self.events:
            if e.lane == "dma" and e.what != "selected":
                family = family_of(e.what)
                out[family] = out.get(family, 0.0) + e.bytes
        return out

    @property
    def hbm_utilisation(self) -> float:
        """Bytes moved / (bandwidth x step time): the DMA engine's busy share."""
        return self.dma_bytes / self.hbm_bandwidth / self.step_s

    @property
    def hbm_floor_s(self) -> float:
        return self.dma_bytes / self.hbm_bandwidth

    @property
    def compute_s(self) -> float:
        """The compute lane's busy time (weight tiles at the tile cost table or the recorded
        loop, the other products at the MXU rule, vector work, collectives): the step's
        critical path where HBM never holds the lane up, so a step is at least
        max(hbm_floor_s, compute_s)."""
        return sum(e.busy_s for e in self.events if e.lane == "compute")

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s

    def layer_seconds(self) -> list[float]:
        """Each layer's time on the compute lane: from its first compute event's start to
        the next layer's (the last one to the lm_head's first), as a trace of the kernel's
        named scopes measures its layers (`mk.measure.profiling.layer_times`)."""
        starts: dict = {}
        for e in self.events:
            if e.lane == "compute":
                starts.setdefault(e.layer, e.start_s)
        layers = sorted(k for k in starts if k is not None)
        ends = [starts[k] for k in layers[1:]] + [starts.get(None, self.step_s)]
        return [end - starts[k] for k, end in zip(layers, ends)]

    def bubble_share(self) -> dict[str, float]:
        """{cause: seconds of HBM idle time}, largest first."""
        out: dict[str, float] = {}
        for b in self.bubbles:
            out[b.cause] = out.get(b.cause, 0.0) + b.idle_s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def tokens_per_s_per_user(self, accepted: float | None = None) -> float:
        """Tokens each sequence keeps per second, `accepted` (default T) per step: a
        number in (0, T], as `mk.cost.perf.predict` takes it (a step verifies T rows)."""
        if accepted is None:
            return self.rows / self.step_s
        return finite_number("accepted", accepted, 0, self.rows, open_low=True) / self.step_s

    def table(self, kind: str = "events") -> list[dict]:
        """The events or the bubbles as dicts (times in microseconds), for a table."""
        if kind not in ("events", "bubbles"):
            raise ValueError(f"kind={kind!r} must be 'events' or 'bubbles'")
        us = 1e6
        if kind == "bubbles":
            return [dict(start_us=b.start_s * us, end_us=b.end_s * us, cause=b.cause,
                         layer=b.layer, idle_us=b.idle_s * us) for b in self.bubbles]
        return [dict(lane=e.lane, start_us=e.start_s * us, end_us=e.end_s * us,
                     layer=e.layer, what=e.what, busy_us=e.busy_s * us, count=e.count,
                     MB=e.bytes / 1e6) for e in self.events]
