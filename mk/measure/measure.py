"""Measure your TPU: DMA latency against size, bandwidth against bytes in flight, one
megakernel step; the `Measured` record `data/measured/<chip>.json` holds, which the
simulator reads (`mk.cost.machine.Assumptions.measured`).

On a TPU the record's chip comes from the device kind and it is written to
`MEASURED/<chip>.json`; on a CPU the same code runs in TPU interpret mode, and its record
(mode "interpret", `INTERPRET_LABEL`) is refused under `MEASURED`; `example` makes up a
labelled record from a chosen latency and bandwidth share.

Here: `Sweep` (`SWEEPS`), `DmaPoint`, `StepPoint`, `Measured` (`latency_fit`,
`dma_latency_s`, `hbm_bw`, `hbm_share`, `to_dict`, `from_dict`), `chip_of`,
`median_seconds`, `seconds_per_copy`, `dma_sweep`, `time_step_series` (`STEP_SERIES`: the
megakernel, its device loop, XLA's step; benchmarks/tpu_steps.py; its plan `step_plan`),
`provenance`, `labelled`, `measure`, `example`, `path_for`, `write`, `load`, `sim_fields`.
Not here: the simulator (`mk.cost.sim`), drawing (the notebook, with `mk.plots`), the JSON
schema's prose (data/README.md). How each number is measured: docs/design/mk.measure.measure.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mk.kernels import backend as backends
from mk.model import decode_checks, reference, untrusted
from mk.step import megakernel
from mk.model.checkpoint import init_params
from mk.model.chips import DEVICE_KINDS, ChipSpec, all_chips, chip_of, spec_of  # noqa: F401
from mk.model.config import LANES, ModelConfig
from mk.kernels.dma_probe import CHUNK_ROWS, SIZE_UNIT_BYTES, chunk_rows, dma_probe
from mk.step.plan import DecodePlan, capacity as cache_capacity

SCHEMA = 3  # 2: min_extra_bytes; 3: libtpu and commit
MODES = ("hardware", "interpret", "example")
INTERPRET_LABEL = "interpret mode, not a TPU"
EXAMPLE_LABEL = "example: made-up numbers, not a measurement"
TPU_NAMES = tuple(s.name for s in all_chips("tpu"))
_CHECKOUT = Path(__file__).resolve().parents[2]
# Measured files go to $MK_MEASURED, else to data/measured of the checkout (of the working
# directory for an installed package): never inside the installed package.
MEASURED = Path(os.environ.get("MK_MEASURED") or (
    _CHECKOUT if (_CHECKOUT / "pyproject.toml").exists() else Path.cwd()) / "data" / "measured")
KIB = 1024


def _number(field: str, value, low: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > low):
        raise ValueError(f"{field}={value!r} must be a finite number > {low:g}")


def _integer(field: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field}={value!r} must be an integer >= {low}")


def _granules(field: str, value) -> None:
    """A copy's size: whole (8, 128) float32 tiles (`mk.kernels.dma_probe`)."""
    _integer(field, value, SIZE_UNIT_BYTES)
    if value % SIZE_UNIT_BYTES:
        raise ValueError(f"{field}={value} must be a multiple of {SIZE_UNIT_BYTES}")


def _counts(field: str, value) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) for n in value)
            and 1 <= value[0] < value[1]):
        raise ValueError(f"{field}={value!r} must be two integers 1 <= a < b")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What `dma_sweep` times: one copy in flight at each of `sizes` (latency against
    size), then `in_flight` copies of `chunk` bytes (bandwidth against bytes in flight);
    each point with `counts` copies, `repeats` times. `min_extra_bytes`: the larger count
    is raised, point by point, until the extra copies move at least this many bytes, so
    the time they add stands above the wall clock's noise (`counts_for`)."""

    sizes: tuple[int, ...]  # bytes per copy, whole 4 KiB
    chunk: int  # bytes per copy of the bandwidth sweep
    in_flight: tuple[int, ...]
    counts: tuple[int, int] = (16, 528)
    repeats: int = 5
    min_extra_bytes: int = 0

    def __post_init__(self):
        for field in ("sizes", "in_flight"):
            if not getattr(self, field):
                raise ValueError(f"Sweep.{field} is empty")
        for n in self.sizes:
            _granules("Sweep.sizes[...]", n)
        _granules("Sweep.chunk", self.chunk)
        for d in self.in_flight:
            _integer("Sweep.in_flight[...]", d, 1)
        _counts("Sweep.counts", self.counts)
        _integer("Sweep.repeats", self.repeats, 1)
        _integer("Sweep.min_extra_bytes", self.min_extra_bytes, 0)

    def counts_for(self, nbytes: int) -> tuple[int, int]:
        """The two counts a point of `nbytes` per copy is timed with."""
        low, high = self.counts
        return low, max(high, low + -(-self.min_extra_bytes // nbytes))

    def points(self) -> list[tuple[int, int]]:
        """(bytes, in_flight) of every point, latency points first, each once."""
        out = [(n, 1) for n in self.sizes]
        return out + [(self.chunk, d) for d in self.in_flight if (self.chunk, d) not in out]


SWEEPS = {
    # 4 KiB to 4 MiB one at a time; 256 KiB copies up to 64 in flight (16 MiB of VMEM).
    # A dispatched call costs about 1 ms on a v5e, give or take tens of us: 4 GiB of extra
    # copies (5 ms at its datasheet 819 GB/s) stand well above that. Measured there
    # (2026-12-06, 0f38c60) with 512 extra copies instead: 256 KiB copies 8 in flight
    # "moved" 6.7 TB/s, the noise of 164 us of copies under a 1 ms call.
    "full": Sweep(sizes=tuple(4 ** k * 4 * KIB for k in range(6)), chunk=256 * KIB,
                  in_flight=(1, 2, 4, 8, 16, 32, 64), min_extra_bytes=4 * KIB ** 3),
    # interpret mode: ~1-2 ms per copy (32 extra copies stand out of the load's noise) and
    # ~0.5 s of tracing per point
    "quick": Sweep(sizes=(4 * KIB, 16 * KIB, 64 * KIB), chunk=4 * KIB, in_flight=(1, 2, 4),
                   counts=(2, 34), repeats=3),
}


@dataclasses.dataclass(frozen=True)
class DmaPoint:
    """One timed probe: copies of `bytes`, `in_flight` outstanding, `seconds` per copy."""

    bytes: int
    in_flight: int
    seconds: float

    def __post_init__(self):
        _granules("bytes", self.bytes)
        _integer("in_flight", self.in_flight, 1)
        _number("seconds", self.seconds)

    @property
    def bytes_in_flight(self) -> int:
        return self.bytes * self.in_flight

    @property
    def bandwidth(self) -> float:
        """Bytes per second moved at this point's steady state."""
        return self.bytes / self.seconds


@dataclasses.dataclass(frozen=True)
class StepPoint:
    """One megakernel decode step of `model`, timed: wall clock of a blocking call."""

    model: str
    batch: int
    rows: int
    context: int  # cached positions each sequence reads (its rows come after them)
    seconds: float

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} must be a non-empty string")
        _integer("batch", self.batch, 1)
        _integer("rows", self.rows, 1)
        _integer("context", self.context, 0)
        _number("seconds", self.seconds)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What one run of `measure` found (or an `example`); the JSON of `to_dict`."""

    mode: str  # one of MODES
    label: str  # INTERPRET_LABEL, EXAMPLE_LABEL, or "measured on <device kind>"
    chip: str | None  # a TPU of mk/data/chips.csv; None in interpret mode
    device_kind: str  # jax's name of the device that ran the probes ("cpu" in interpret)
    when: str  # UTC, ISO 8601
    jax: str  # jax's version
    libtpu: str  # libtpu's version ("unknown" where it is not installed)
    commit: str  # the checkout's commit ($MK_COMMIT, else git's HEAD, else "unknown")
    counts: tuple[int, int]  # copies per call, the two timed (the larger: `min_extra_bytes`)
    repeats: int
    min_extra_bytes: int  # `Sweep.min_extra_bytes`: each point's counts are `counts_for`'s
    dma: tuple[DmaPoint, ...]
    step: StepPoint | None  # None when no step was timed

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        if self.mode == "interpret":
            if self.chip is not None:
                raise ValueError(f"chip={self.chip!r} must be null in mode='interpret': "
                                 "interpret-mode timings say nothing about a TPU")
            if self.label != INTERPRET_LABEL:
                raise ValueError(f"label={self.label!r} must be {INTERPRET_LABEL!r} in "
                                 "mode='interpret'")
        elif self.chip not in TPU_NAMES:
            raise ValueError(f"chip={self.chip!r} must be one of {TPU_NAMES} in "
                             f"mode={self.mode!r}")
        if self.mode == "example" and self.label != EXAMPLE_LABEL:
            raise ValueError(f"label={self.label!r} must be {EXAMPLE_LABEL!r} in "
                             "mode='example'")
        for field in ("label", "device_kind", "when", "jax", "libtpu", "commit"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"{field}={getattr(self, field)!r} must be a string")
        if not self.label:
            raise ValueError("label='' must say what the numbers are")
        _counts("counts", self.counts)
        _integer("repeats", self.repeats, 1)
        _integer("min_extra_bytes", self.min_extra_bytes, 0)
        if not self.dma or not all(isinstance(p, DmaPoint) for p in self.dma):
            raise ValueError(f"dma ({len(self.dma)} items) must be DmaPoints, at least one")
        if self.chip is not None:  # no copy outruns the datasheet: a faster one is noise
            limit = spec_of(self.chip).device_hbm_bw * (1 + 1e-9)
            for i, p in enumerate(self.dma):
                if p.bandwidth > limit:
                    raise ValueError(
                        f"dma[{i}]: {p.bytes} bytes, {p.in_flight} in flight, moved "
                        f"{p.bandwidth / 1e9:.0f} GB/s, over {self.chip}'s datasheet "
                        f"{limit / 1e9:.0f} GB/s per device: the time is the wall clock's "
                        "noise, not the copies' (raise Sweep.min_extra_bytes)")
        if self.step is not None and not isinstance(self.step, StepPoint):
            raise ValueError(f"step={self.step!r} must be a StepPoint or None")

    # -- What the simulator reads -----------------------------------------------------------
    def latency_points(self) -> list[DmaPoint]:
        """The points with one copy in flight, by size."""
        return sorted((p for p in self.dma if p.in_flight == 1), key=lambda p: p.bytes)

    def latency_fit(self) -> tuple[float, float]:
        """(intercept s, slope s per byte) of the least-squares line through seconds per
        copy against bytes, one copy in flight."""
        points = self.latency_points()
        if len({p.bytes for p in points}) < 2:
            raise ValueError(f"dma: {len(points)} point(s) with in_flight=1; the latency "
                             "needs them at >= 2 sizes")
        slope, intercept = np.polyfit([p.bytes for p in points], [p.seconds for p in points],
                                      1)
        return float(intercept), float(slope)

    @property
    def dma_latency_s(self) -> float:
        """The fit's intercept (`latency_fit`): a copy's time before its first byte moves."""
        intercept, _ = self.latency_fit()
        if not intercept > 0:
            raise ValueError(f"dma: the one-in-flight points give a latency of "
                             f"{intercept:.3g} s; it must be > 0 (too noisy: raise "
                             "Sweep.counts or repeats)")
        return intercept

    @property
    def hbm_bw(self) -> float:
        """The best bandwidth any point reached, bytes/s (one device)."""
        return max(p.bandwidth for p in self.dma)

    def hbm_share(self, spec: ChipSpec) -> float:
        """hbm_bw over the datasheet bandwidth of one device of `spec`."""
        share = self.hbm_bw / spec.device_hbm_bw
        if not 0 < share <= 1 + 1e-9:  # an example at the datasheet rounds to 1 + eps
            raise ValueError(f"dma: {self.hbm_bw / 1e9:.1f} GB/s is {share:.2f} x {spec.name}'s "
                             f"datasheet {spec.device_hbm_bw / 1e9:.0f} GB/s "
                             "per device; the share must be in (0, 1]")
        return min(share, 1.0)

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["counts"] = list(self.counts)
        return {"schema": SCHEMA, **out}

    @classmethod
    def from_dict(cls, data, where: str = "record") -> Measured:
        """The record of `to_dict`'s JSON; ValueError naming `where` and the field."""
        try:
            values = _fields(data, cls, "", extra=("schema",))
            if values.pop("schema") != SCHEMA:
                raise ValueError(f"schema={data['schema']!r} must be {SCHEMA}")
            if not isinstance(values["dma"], list):
                raise ValueError(f"dma={values['dma']!r} must be a list")
            values["dma"] = tuple(_point(DmaPoint, p, f"dma[{i}].")
                                  for i, p in enumerate(values["dma"]))
            if values["step"] is not None:
                values["step"] = _point(StepPoint, values["step"], "step.")
            if not isinstance(values["counts"], list):
                raise ValueError(f"counts={values['counts']!r} must be a list")
            values["counts"] = tuple(values["counts"])
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def _fields(data, kind, prefix: str, extra=()) -> dict:
    """The fields of dataclass `kind` from a JSON object: each present, no other."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'the record'}={data!r} must be a JSON "
                         "object")
    names = [f.name for f in dataclasses.fields(kind)] + list(extra)
    for name in names:
        if name not in data:
            raise ValueError(f"{prefix}{name} is missing")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]} is not a field (fields: {names})")
    return dict(data)


def _point(kind, data, prefix: str):
    values = _fields(data, kind, prefix)
    try:
        return kind(**values)
    except ValueError as err:
        raise ValueError(f"{prefix}{err}") from None


# -- Measuring ----------------------------------------------------------------------------
def median_seconds(calls: dict, repeats: int) -> dict:
    """{key: median wall seconds of calls[key]()} (each blocking), the keys interleaved
    so that a change of machine load touches all of them alike; one warm-up call each."""
    times = {key: [] for key in calls}
    for call in calls.values():
        jax.block_until_ready(call())  # compile, first touch
    for _ in range(repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def seconds_per_copy(nbytes: int, in_flight: int, sweep: Sweep) -> float:
    """Steady seconds per copy of `nbytes` with `in_flight` outstanding (module
    docstring); run inside `mk.kernels.backend.use`. Checks the data landed."""
    rows = chunk_rows(nbytes)
    src = jnp.arange(in_flight * rows * LANES, dtype=jnp.float32).reshape(in_flight, rows, -1)
    probe = jax.jit(dma_probe)
    c0, c1 = sweep.counts_for(nbytes)
    calls = {c: (lambda c=c: probe(src, jnp.array([c], jnp.int32))) for c in (c0, c1)}
    last = np.asarray(calls[c1]())
    if not np.array_equal(last, np.asarray(src[(c1 - 1) % in_flight, :CHUNK_ROWS])):
        raise RuntimeError(f"the probe ({nbytes} bytes, {in_flight} in flight) returned "
                           "data that is not its last chunk's: the DMAs did not land")
    t = median_seconds(calls, sweep.repeats)
    seconds = (t[c1] - t[c0]) / (c1 - c0)
    if not seconds > 0:
        raise RuntimeError(f"{c1} copies of {nbytes} bytes timed no slower than {c0} "
                           f"({t[c1]:.3g} s vs {t[c0]:.3g} s): timing noise is larger than "
                           "the copies; raise Sweep.counts or repeats")
    return seconds


def dma_sweep(sweep: Sweep, backend: str = "auto") -> tuple[DmaPoint, ...]:
    """Every point of `sweep` (`Sweep.points`), timed on `backend`."""
    with backends.use(backend):
        return tuple(DmaPoint(n, d, seconds_per_copy(n, d, sweep)) for n, d in sweep.points())


STEP_SERIES = ("megakernel", "megakernel_loop", "xla")  # what `time_step_series` times


def time_step_series(config: ModelConfig, *, batch: int = 1, rows: int = 1,
                     context: int = 256, series=STEP_SERIES, loop_steps: int = 32,
                     repeats: int = 5, seed: int = 0, backend: str = "auto",
                     block=None) -> dict:
    """Seconds per decode step of `config` (random weights of `seed`) on `backend`, for
    each of `series`: every sequence reads a full cache of `context` positions before its
    `rows` new ones, as `mk.cost.sim.simulate` replays a plan at `position=context`; the kernel's
    `block` is the default one unless given (`step_plan`).

    - "megakernel": one dispatched megakernel step (host dispatch included), its cache
      donated (`mk.step.megakernel.step_in_place`: no copy of the cache, as in serving);
    - "megakernel_loop": a device-side loop of `loop_steps` steps over its step count:
      greedy steps (`generate`'s `steps_per_call`) at T = 1; at T > 1 verification steps,
      each fed the last one's T predictions (`mk.step.megakernel.greedy_steps`: a timing
      loop of T-row steps, every row kept);
    - "xla": XLA's step (`mk.model.reference.forward` jitted), one dispatched step.
    XLA's step runs first, on the params; the megakernel's layout is then prepared with the
    params donated, so a model near the chip's size needs one copy of its weights. The
    tokens are random (`seed`), one per row: a MoE layer's B x T rows route apart as a
    batch of users' would (`mk.cost.perf`'s distinct experts), where equal tokens would send
    every row to the same top-k experts and time a B = 1 step's expert reads."""
    unknown = sorted(set(series) - set(STEP_SERIES))
    if unknown or not series:
        raise ValueError(f"series={tuple(series)!r} must be a non-empty subset of "
                         f"{STEP_SERIES}")
    plan = step_plan(config, batch=batch, rows=rows, context=context,
                     loop_steps=loop_steps, block=block)
    config, capacity = plan.config, plan.context
    params = init_params(config, seed)
    cache = reference.init_cache(config, batch, capacity)
    tokens, positions = decode_checks.validate_step(
        config, cache, np.random.default_rng(seed).integers(0, config.vocab, (batch, rows)),
        np.full((batch,), context, np.int32))
    seconds = {}
    with backends.use(backend):
        if "xla" in series:
            seconds |= median_seconds({"xla": lambda: reference.forward(
                config, params, cache, tokens, positions)}, repeats)
        weights = megakernel.prepare(plan, params, donate=True)
        held = [cache]  # both donate the cache: each call gets the last one's
        if "megakernel" in series:
            def step():
                out = megakernel.step_in_place(plan, weights, held[0], tokens, positions)
                held[0] = out[2]
                return out
            seconds |= median_seconds({"megakernel": step}, repeats)
        if "megakernel_loop" in series:

            def loop():
                out, held[0] = megakernel.device_loop(plan, weights, held[0],
                                                      tokens, positions, loop_steps)
                return out
            loop_seconds = median_seconds({"loop": loop}, repeats)["loop"]
            seconds["megakernel_loop"] = loop_seconds / loop_steps
    return {name: seconds[name] for name in series}


def step_plan(config: ModelConfig, *, batch: int = 1, rows: int = 1, context: int = 256,
              loop_steps: int = 32, block=None) -> DecodePlan:
    """The plan `time_step_series` runs, its one step and its device loop alike: a cache
    holding `context` positions and the loop's steps of `rows` rows after them (whole KV
    tiles of `block`), `block` or the default one (no chip given: `generate`'s)."""
    _integer("loop_steps", loop_steps, 1)
    end, tile = context + rows * loop_steps, block and block.kv_tile
    capacity = cache_capacity(end) if block is None else -(-end // tile) * tile
    config = dataclasses.replace(config, max_context=capacity)
    return DecodePlan.make(config, batch=batch, rows=rows, context=capacity, block=block)


def provenance() -> dict:
    """What a record measured on this machine names: the first device's chip (None off a
    TPU) and kind, the jax and libtpu versions, the commit ($MK_COMMIT, else git's HEAD,
    else "unknown") and the time (UTC)."""
    kind = jax.devices()[0].device_kind
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "unknown"
    return dict(chip=chip_of(kind) if jax.devices()[0].platform == "tpu" else None,
                device_kind=kind, jax=jax.__version__, libtpu=libtpu,
                commit=os.environ.get("MK_COMMIT") or _git_head() or "unknown", when=_now())


def labelled(made: dict, *, interpret: bool, json_path, verb: str = "measured") -> dict:
    """A benchmark's `made` (`provenance`) with its record's label: interpret mode's, which
    needs `json_path`, a path neither named for a TPU nor under MEASURED, else "<verb> on"
    the TPU; ValueError naming what is missing otherwise (for argparse's error)."""
    if interpret:
        if json_path is None or Path(json_path).stem.split("-")[0] in TPU_NAMES or Path(
                json_path).resolve().is_relative_to(MEASURED.resolve()):
            raise ValueError("--interpret needs --json, a path not named for a TPU and not "
                             f"under {MEASURED}")
        return made | dict(label=INTERPRET_LABEL)
    if made["chip"] is None:
        raise ValueError(f"no TPU here ({made['device_kind']}); on a TPU set MK_TPU=1, else "
                         "--interpret tries the script")
    return made | dict(label=f"{verb} on {made['device_kind']}")


def provenance_apart() -> dict:
    """`provenance()` asked of a fresh Python process, so the caller never opens the chip:
    a process that touches the TPU holds it, and the scripts that run each row or notebook
    in a process of their own (benchmarks/tpu_models.py, tpu_notebooks.py) leave it free."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]),
                    os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", "import json, mk.measure.measure as m; "
                           "print(json.dumps(m.provenance()))"],
                          capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.splitlines()[-1])


def _git_head():
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=20, cwd=_CHECKOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def measure(backend: str = "auto", *, sweep: Sweep | None = None,
            config: ModelConfig | None = None, batch: int = 1, rows: int = 1,
            context: int = 256) -> Measured:
    """The DMA sweep (default `SWEEPS["full"]` on a TPU, `SWEEPS["quick"]` in interpret
    mode) and, with a `config`, one megakernel step, on `backend`: a `Measured` of mode
    "hardware" (its chip from the device kind) or "interpret"."""
    mode = backends.resolve(backend)
    sweep = sweep or SWEEPS["full" if mode == "hardware" else "quick"]
    where = provenance()
    dma = dma_sweep(sweep, mode)
    step = None if config is None else StepPoint(  # one dispatched step
        config.name, batch, rows, context, time_step_series(
            config, batch=batch, rows=rows, context=context, series=("megakernel",),
            repeats=sweep.repeats, backend=mode)["megakernel"])
    return Measured(mode=mode, label=INTERPRET_LABEL if mode == "interpret" else
                    f"measured on {where['device_kind']}",
                    chip=where["chip"] if mode == "hardware" else None,
                    device_kind=where["device_kind"], when=where["when"], jax=where["jax"],
                    libtpu=where["libtpu"], commit=where["commit"],
                    counts=sweep.counts, repeats=sweep.repeats,
                    min_extra_bytes=sweep.min_extra_bytes, dma=dma, step=step)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def example(chip: str | ChipSpec, *, dma_latency_s: float, hbm_share: float = 1.0,
            sweep: Sweep = SWEEPS["full"]) -> Measured:
    """A made-up record of mode "example" for `chip`: every point of `sweep` as the
    simulator's engine would time it with this latency and share of the datasheet
    bandwidth (one copy: latency + bytes / bandwidth; d in flight: the larger of
    bytes / bandwidth and the one-copy time / d). Not a measurement: it shows what a
    measured file changes."""
    spec = spec_of(chip)
    _number("dma_latency_s", dma_latency_s)
    if not 0 < hbm_share <= 1:
        raise ValueError(f"hbm_share={hbm_share!r} must be in (0, 1]")
    bw = spec.device_hbm_bw * hbm_share
    dma = tuple(DmaPoint(n, d, max(n / bw, (dma_latency_s + n / bw) / d))
                for n, d in sweep.points())
    return Measured(mode="example", label=EXAMPLE_LABEL, chip=spec.name, device_kind="",
                    when=_now(), jax=jax.__version__, libtpu="", commit="",
                    counts=sweep.counts,
                    repeats=sweep.repeats, min_extra_bytes=sweep.min_extra_bytes, dma=dma,
                    step=None)


# -- Files --------------------------------------------------------------------------------
def path_for(chip: str) -> Path:
    """Where a TPU's measured file lives: MEASURED/<chip>.json."""
    if chip not in TPU_NAMES:
        raise ValueError(f"chip={chip!r} must be one of {TPU_NAMES}")
    return MEASURED / f"{chip}.json"


def write(record: Measured, path: str | os.PathLike | None = None) -> Path:
    """Write `record` as JSON to `path` (default `path_for(record.chip)`); returns the path.

    Only a hardware record may go under MEASURED, and only as its own chip's file; a
    record of another mode is never written under MEASURED nor to a file named for a TPU
    (ValueError): interpret-mode timings say nothing about a TPU."""
    if path is None:
        if record.mode != "hardware":
            raise ValueError(f"mode={record.mode!r}: only a record measured on a TPU is "
                             f"written to {MEASURED}; pass a path outside it to keep this "
                             f"one ({record.label})")
        path = path_for(record.chip)
    path = Path(path)
    inside = path.resolve().is_relative_to(MEASURED.resolve())
    if record.mode != "hardware" and (inside or path.stem in TPU_NAMES):
        raise ValueError(f"path={str(path)!r}: a record of mode={record.mode!r} "
                         f"({record.label}) is never written under {MEASURED} or to a file "
                         f"named for a TPU {TPU_NAMES}")
    if record.mode == "hardware" and inside and path.name != f"{record.chip}.json":
        raise ValueError(f"path={str(path)!r}: a record measured on {record.chip} goes to "
                         f"{path_for(record.chip)}, not to another chip's file")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_dict(), indent=1) + "\n", encoding="utf-8")
    return path


def load(path: str | os.PathLike) -> Measured:
    """The record in `path`; ValueError naming the file and the field when malformed."""
    data = untrusted.load_json(path, "measured record")  # a regular file, bounded
    return Measured.from_dict(data, str(path))


def sim_fields(chip: str | ChipSpec, path: str | os.PathLike | None = None) -> dict:
    """What `mk.cost.sim.Assumptions.measured` sets from a file for `chip`: {dma_latency_s,
    hbm_share, source} from `path`, else from `path_for(chip)` when it exists; {} (the
    assumed defaults) when `path` is None and there is no file. An interpret-mode record
    or another chip's is refused (ValueError)."""
    spec = spec_of(chip)
    if path is None:
        path = path_for(spec.name)
        if not path.exists():
            return {}
    record = load(path)
    if record.mode == "interpret":
        raise ValueError(f"{path}: mode='interpret' ({record.label}): its times are the "
                         "interpreter's, not a TPU's; the simulator takes only a TPU's "
                         "measurement or a labelled example")
    if record.chip != spec.name:
        raise ValueError(f"{path}: chip={record.chip!r} is not the simulated chip "
                         f"{spec.name!r}")
    what = "measured on " + record.device_kind if record.mode == "hardware" else EXAMPLE_LABEL
    return dict(dma_latency_s=record.dma_latency_s, hbm_share=record.hbm_share(spec),
                source=f"{what} ({path})")
