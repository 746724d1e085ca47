"""Profiles of decode steps: capture them, read them back, measure the bubbles.

Every kernel edge stops the HBM -> VMEM pipeline of a memory-bound step; this module
measures those stops in real profiles of three ways of running the same step: "xla"
(`mk.model.reference.decode_step`), "staged" (the stage kernels one pallas_call per op,
`staged_step`) and "megakernel" (`mk.step.megakernel.decode_step`).

Here: `capture` (N annotated steps into `PROFILES/<name>/plugins/profile/<run>/`;
`profiles_dir` says where PROFILES is), `timeline` (a trace's op events, per step),
`bubbles` (idle time per step), `scope_table` and `layer_times` (a kernel's phases and
layers, from a TPU trace's scopes), `trace_record`, `recorded_timeline` and
`load_trace_record` (a chip's median steps kept in data/measured), `staged_step`,
`variants`, `trace_viewer`. Not here: the figures (`mk.profile_plots`; this module needs
no plotly, so benchmarks/tpu_trace.py runs on a bare TPU machine), the simulator
(`mk.cost.sim`, drawn by `mk.sim_plots.timeline`), the compiler's static schedule
(`mk.cost.bundles.dump_schedule`), any TPU time: a CPU trace times CPU work. What a CPU and a
TPU trace show: docs/design/mk.measure.profiling.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mk.model import decode_checks, ops, quant, reference, untrusted
from mk.step import megakernel
from mk.model.config import ModelConfig
from mk.kinds.attention.attention_prologue import attention_prologue
from mk.kinds.attention.decode_attention import decode_attention
from mk.step.plan import DecodePlan
from mk.kernels.weight_streaming import stream_matmul
from mk.kinds.base import ROLES, Kind
from mk.kinds.layers import kind_at, layer_kinds

VARIANTS = ("xla", "staged", "megakernel")


def profiles_dir(environ=os.environ, package: Path = Path(__file__)) -> Path:
    """Where captures go: $MK_PROFILES when set; else, when mk is imported from a checkout
    (the package's parent holds pyproject.toml and the tracked profiles/README.md), the
    checkout's top-level profiles/ from any working directory (a notebook run by Jupyter
    or papermill runs in notebooks/); else ./profiles (an installed package: never inside
    site-packages)."""
    if environ.get("MK_PROFILES"):
        return Path(environ["MK_PROFILES"]).absolute()
    root = Path(package).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "profiles" / "README.md").is_file():
        return root / "profiles"
    return Path("profiles").absolute()


PROFILES = profiles_dir()
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HLO_TEXT = re.compile(r"^%?([^\s=]+) = ")  # a TPU op event's name: its whole HLO text


# -- Capture ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Capture:
    """Where one capture landed: `logdir/name/plugins/profile/run/<host>.xplane.pb`."""

    name: str
    run: str
    path: Path  # the .xplane.pb
    steps: int


def capture(fn, *args, steps: int = 3, warmup: int = 1,
            logdir: str | os.PathLike = PROFILES, name: str = "capture") -> Capture:
    """Run `fn(*args)` `warmup` times, then `steps` times under `jax.profiler.trace`, each
    step inside `StepTraceAnnotation(name, step_num=i)` and waited for, so a step's ops fall
    inside its annotation. The run directory gets a fresh name (the profiler's timestamp,
    suffixed if taken): a capture never overwrites an earlier one. The Python tracer is off
    (it would trace the interpreter of interpret-mode kernels and swamp the file)."""
    for field, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{field}={value!r} must be an integer >= {low}")
    if not _NAME.match(name):
        raise ValueError(f"name={name!r} must be a folder name: a letter or digit, then "
                         "letters, digits, '_', '.', '-'")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    root = Path(logdir) / name
    root.mkdir(parents=True, exist_ok=True)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory(dir=root, prefix=".staging-") as staging:
        with jax.profiler.trace(staging, profiler_options=options):
            for i in range(steps):
                with jax.profiler.StepTraceAnnotation(name, step_num=i):
                    jax.block_until_ready(fn(*args))
        made, = (Path(staging) / "plugins" / "profile").iterdir()
        runs = root / "plugins" / "profile"
        runs.mkdir(parents=True, exist_ok=True)
        run, k = made.name, 1
        while True:  # mkdir claims a name atomically: concurrent captures cannot collide
            try:
                (runs / run).mkdir()
                break
            except FileExistsError:
                run, k = f"{made.name}-{k}", k + 1
        for f in made.iterdir():
            shutil.move(str(f), str(runs / run / f.name))
    path, = (runs / run).glob("*.xplane.pb")
    return Capture(name, run, path, steps)


# -- Timeline -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One op execution. Times in ns on the trace's clock."""

    name: str  # the HLO op: its name, not its text (a TPU event carries its whole text)
    module: str  # the XLA program it belongs to
    run_id: int  # one execution of that program
    line: str  # thread (CPU) or device line (TPU)
    start_ns: float
    duration_ns: float
    step: int  # index of the annotated step holding its start, -1 if none

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.duration_ns


@dataclasses.dataclass(frozen=True)
class Step:
    number: int
    start_ns: float
    end_ns: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The op events of one plane and the annotated steps (from the host plane); on a TPU
    traced with `mk.cost.bundles.PHASE_FLAG` in LIBTPU_INIT_ARGS, also the kernels' named
    scopes (`scopes`: events on the device's "XLA TraceMe" line, nested inside their
    kernel's op; not ops: a bubble is measured on ops alone)."""

    plane: str
    steps: tuple[Step, ...]
    ops: tuple[OpEvent, ...]
    scopes: tuple[OpEvent, ...] = ()

    def rows(self, step: int | None = None) -> list[dict]:
        """One dict per op event (name, module, line, step, start/duration in µs)."""
        return [dict(name=o.name, module=o.module, line=o.line, step=o.step,
                     start_us=round(o.start_ns / 1e3, 3),
                     duration_us=round(o.duration_ns / 1e3, 3))
                for o in self.ops if step is None or o.step == step]


_DEVICE_LINES = {"XLA Ops": "ops", "XLA TraceMe": "scopes"}


def _step_of(start: float, steps) -> int:
    for i, s in enumerate(steps):
        if s.start_ns <= start < s.end_ns:
            return i
    return -1


def timeline(xplane_path: str | os.PathLike, *, plane: str = "auto") -> Timeline:
    """Parse a trace with `jax.profiler.ProfileData` into op events per annotated step.

    plane="auto" takes `/device:TPU:0` when the trace has it (its "XLA Ops" line, and
    "XLA TraceMe" as `scopes`), else `/host:CPU` (every event carrying an `hlo_op` stat,
    on any thread). Steps are the `StepTraceAnnotation`s of the host plane (events with a
    `step_num` stat). A TPU's op event is named by its instruction's whole HLO text; an op
    keeps its name ("copy.8"). The device path was read from a TPU v5e's traces
    (data/measured/v5e-trace.json). A path that is no regular file (a named pipe would
    block the reader) or no XSpace is refused naming it."""
    untrusted.check_regular(xplane_path, "profile")
    try:
        data = jax.profiler.ProfileData.from_file(str(xplane_path))
    except RuntimeError as err:  # "Failed to parse XSpace from array"
        raise ValueError(f"profile {os.fspath(xplane_path)!r} is not an XSpace trace "
                         f"(jax.profiler: {err})") from None
    planes = {p.name: p for p in data.planes}
    if plane == "auto":
        plane = "/device:TPU:0" if "/device:TPU:0" in planes else "/host:CPU"
    if plane not in planes or "/host:CPU" not in planes:
        raise ValueError(f"plane={plane!r} is not in {xplane_path} (planes: {sorted(planes)})")
    steps = []
    for line in planes["/host:CPU"].lines:
        for e in line.events:
            stats = dict(e.stats)
            if "step_num" in stats:
                steps.append(Step(int(stats["step_num"]), e.start_ns,
                                  e.start_ns + e.duration_ns))
    steps.sort(key=lambda s: s.start_ns)
    found: dict = {"ops": [], "scopes": []}
    device = plane.startswith("/device:")
    lines = {line.name: line for line in planes[plane].lines}
    # A device op may not name its program: the "XLA Modules" event holding it does.
    modules = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name, i) for i, e in
                     enumerate(lines["XLA Modules"].events)) if "XLA Modules" in lines else []
    for line in planes[plane].lines:
        if device and line.name not in _DEVICE_LINES:
            continue
        for e in line.events:
            stats = dict(e.stats)
            if not device and "hlo_op" not in stats:
                continue
            module, run_id = str(stats.get("hlo_module", "")), int(stats.get("run_id", -1))
            if device and not module:
                module, run_id = next(((name, i) for a, z, name, i in modules
                                       if a <= e.start_ns < z), ("", -1))
            short = _HLO_TEXT.match(e.name)
            found[_DEVICE_LINES.get(line.name, "ops")].append(OpEvent(
                short[1] if short else e.name, module, run_id, line.name, e.start_ns,
                e.duration_ns, _step_of(e.start_ns, steps)))
    ops, scopes = (tuple(sorted(found[k], key=lambda o: o.start_ns)) for k in ("ops", "scopes"))
    return Timeline(plane, tuple(steps), ops, scopes)


# -- Bubbles --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepBubbles:
    """The bubbles of one step; times in ns. See `bubbles` for the definitions."""

    step: int
    wall_ns: float  # the step annotation: host start to host end
    span_ns: float  # first op start to last op end
    busy_ns: float  # length of the union of all op events (any line)
    idle_ns: float  # span - busy: gaps inside the step where no op runs on any line
    host_ns: float  # wall - span: before the first op and after the last
    ops: int  # op events
    launches: int  # programs executed (distinct (module, run_id)), nested ones excepted
    idle: tuple[tuple[float, float], ...]  # the gaps, as (start, end)
    op_share: dict  # op name -> its self time / the summed self time of every op

    @property
    def bubble_share(self) -> float:
        """Share of the step's wall time with no op running: (idle + host) / wall."""
        return (self.idle_ns + self.host_ns) / self.wall_ns if self.wall_ns else 0.0

    @property
    def idle_share(self) -> float:
        """Share of the op span with no op running: idle / span."""
        return self.idle_ns / self.span_ns if self.span_ns else 0.0


def union(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def self_times(events) -> dict:
    """Op name -> self time: an event's duration minus the time of events nested in it on
    the same line (a while loop's body ops are not counted twice)."""
    out: dict = defaultdict(float)
    by_line = defaultdict(list)
    for e in events:
        by_line[e.line].append(e)
    for line_events in by_line.values():
        stack: list[list] = []  # [event, time of children]
        for e in sorted(line_events, key=lambda e: (e.start_ns, -e.duration_ns)):
            while stack and e.start_ns >= stack[-1][0].end_ns:
                done, child = stack.pop()
                out[done.name] += done.duration_ns - child
            if stack:  # nested in the top event: clip to it
                stack[-1][1] += min(e.end_ns, stack[-1][0].end_ns) - e.start_ns
            stack.append([e, 0.0])
        for done, child in stack:
            out[done.name] += done.duration_ns - child
    return dict(out)


def _launches(events) -> int:
    spans = defaultdict(lambda: [float("inf"), float("-inf")])
    for e in events:
        span = spans[(e.module, e.run_id)]
        span[0], span[1] = min(span[0], e.start_ns), max(span[1], e.end_ns)
    spans = sorted(spans.values(), key=lambda s: (s[0], -s[1]))
    top, reach = 0, float("-inf")
    for start, end in spans:
        if end > reach or start >= reach:  # not inside an earlier program's run
            top += 1
        reach = max(reach, end)
    return top


def bubbles(tl: Timeline) -> list[StepBubbles]:
    """The bubbles of every annotated step of `tl`.

    Definitions (per step; an op belongs to the step whose annotation holds its start):
    - wall: the step annotation, from the host starting the step to the step's result
      being ready (the capture waits for it inside the annotation);
    - span: first op start to last op end; busy: the length of the union of every op
      event on every line (two threads working at once count once, a nested op counts
      inside its parent); idle = span - busy: the gaps inside the step where no op runs
      anywhere (on a TPU: the chip waits);
    - host = wall - span: the host gap at the step's edges (dispatch before the first op,
      the result's return after the last), which a device-side loop of steps removes;
    - bubble share = (idle + host) / wall; idle share = idle / span;
    - ops: op events; launches: programs executed, (module, run_id) pairs not nested in
      another program's run (interpret mode runs small programs inside a kernel's
      callbacks); op share: self time per op name over the summed self time.
    """
    out = []
    for i, step in enumerate(tl.steps):
        events = [o for o in tl.ops if o.step == i]
        if not events:
            out.append(StepBubbles(step.number, step.end_ns - step.start_ns, 0.0, 0.0, 0.0,
                                   step.end_ns - step.start_ns, 0, 0, (), {}))
            continue
        busy = union((o.start_ns, min(o.end_ns, step.end_ns)) for o in events)
        first, last = busy[0][0], busy[-1][1]
        gaps = tuple((a[1], b[0]) for a, b in zip(busy, busy[1:]))
        busy_ns = sum(b - a for a, b in busy)
        selfs = self_times(events)
        total = sum(selfs.values()) or 1.0
        out.append(StepBubbles(
            step.number, step.end_ns - step.start_ns, last - first, busy_ns,
            last - first - busy_ns, (step.end_ns - step.start_ns) - (last - first),
            len(events), _launches(events), gaps,
            {k: v / total for k, v in sorted(selfs.items(), key=lambda kv: -kv[1])}))
    return out


def summary(per_step: list[StepBubbles], label: str = "") -> dict:
    """One row per capture: the shares and wall time of its median step (by wall time, the
    lower one of an even count; `median_step` is its index), so one step the OS preempted
    does not decide; ops and launches per step as means."""
    n = len(per_step)
    if not n:
        raise ValueError("no steps: the capture holds no StepTraceAnnotation")
    median = sorted(range(n), key=lambda i: per_step[i].wall_ns)[(n - 1) // 2]
    s = per_step[median]
    return dict(variant=label, steps=n, median_step=median, wall_ms=round(s.wall_ns / 1e6, 3),
                ops_per_step=round(sum(s.ops for s in per_step) / n, 1),
                launches_per_step=round(sum(s.launches for s in per_step) / n, 1),
                idle_share=round(s.idle_share, 4),
                host_share=round(s.host_ns / s.wall_ns, 4) if s.wall_ns else 0.0,
                bubble_share=round(s.bubble_share, 4))


# -- Inside a kernel: its named scopes ------------------------------------------------------
def scope_table(tl: Timeline, step: int = 0) -> list[dict]:
    """Step `step`'s scope events by name, in the order each first runs: how many ran,
    their total and mean µs (a scope's whole duration, nested scopes included)."""
    rows: dict = {}
    for e in sorted((e for e in tl.scopes if e.step == step), key=lambda e: e.start_ns):
        row = rows.setdefault(e.name, dict(scope=e.name, count=0, total_us=0.0))
        row["count"] += 1
        row["total_us"] += e.duration_ns / 1e3
    return [r | dict(total_us=round(r["total_us"], 2),
                     mean_us=round(r["total_us"] / r["count"], 3)) for r in rows.values()]


def layer_times(tl: Timeline, step: int = 0, loop: str = "layers") -> list[float]:
    """The ns each layer took in step `step`'s `loop` scope (the megakernel's layer loop):
    a layer runs from its first phase's start (the scope that opens the loop, again) to
    the next layer's, the last one to the loop's end. [] when the trace has no scopes."""
    outer = [e for e in tl.scopes if e.step == step and e.name == loop]
    if not outer:
        return []
    if len(outer) > 1:
        raise ValueError(f"step {step} has {len(outer)} {loop!r} scopes; one kernel call "
                         "has one")
    body = sorted((e for e in tl.scopes if e.step == step and e is not outer[0]
                   and outer[0].start_ns <= e.start_ns < outer[0].end_ns),
                  key=lambda e: e.start_ns)
    starts = [e.start_ns for e in body if e.name == body[0].name] if body else []
    return [b - a for a, b in zip(starts, starts[1:] + [outer[0].end_ns])]


# -- A recorded trace ------------------------------------------------------------------------
def trace_record(timelines: dict[str, Timeline]) -> dict:
    """What data/ keeps of captures' timelines (benchmarks/tpu_trace.py on a TPU): per
    variant, its `summary` and its median step's op and scope events, times in ns from
    the step's start, names in tables. `recorded_timeline` gives them back as a
    `Timeline` of that one step."""
    variants = {}
    for name, tl in timelines.items():
        row = summary(bubbles(tl), name)
        step = tl.steps[row["median_step"]]
        kept = {k: [o for o in getattr(tl, k) if o.step == row["median_step"]]
                for k in ("ops", "scopes")}
        tables = {f: sorted({getattr(o, f) for o in kept["ops"] + kept["scopes"]})
                  for f in ("name", "module", "line")}
        index = {f: {v: i for i, v in enumerate(t)} for f, t in tables.items()}
        variants[name] = dict(
            summary=row, plane=tl.plane, wall_ns=round(step.end_ns - step.start_ns),
            names=tables["name"], modules=tables["module"], lines=tables["line"],
            **{k: [[index["name"][o.name], index["module"][o.module], o.run_id,
                    index["line"][o.line], round(o.start_ns - step.start_ns),
                    round(o.duration_ns)] for o in events] for k, events in kept.items()})
    return dict(variants=variants)


def recorded_timeline(record: dict, variant: str) -> Timeline:
    """The median step `trace_record` kept for `variant`, as a one-step `Timeline` (its
    step starts at 0); `bubbles` of it gives the recorded step's bubbles again."""
    v = record["variants"][variant]

    def events(kind):
        return tuple(OpEvent(v["names"][n], v["modules"][m], int(run), v["lines"][li],
                             float(start), float(duration), 0)
                     for n, m, run, li, start, duration in v.get(kind, ()))

    return Timeline(v["plane"], (Step(0, 0.0, float(v["wall_ns"])),), events("ops"),
                    events("scopes"))


def load_trace_record(path: str | os.PathLike) -> dict:
    """A record benchmarks/tpu_trace.py wrote, checked for what `recorded_timeline` reads:
    every variant of `VARIANTS`, each event's (ops and, where traced, scopes) indices
    inside its tables and its start inside the step (a record is untrusted data:
    bounded, never run)."""
    data = untrusted.load_json(path, "trace record")
    if not isinstance(data, dict) or not isinstance(data.get("variants"), dict):
        raise ValueError(f"{path}: a trace record is an object with 'variants'")
    for field in ("chip", "device_kind", "jax", "libtpu", "commit", "when", "model"):
        if field not in data:
            raise ValueError(f"{path}: field {field!r} is missing")
    for name in VARIANTS:
        v = data["variants"].get(name)
        if not isinstance(v, dict):
            raise ValueError(f"{path}: variant {name!r} is missing")
        for field in ("summary", "plane", "wall_ns", "names", "modules", "lines", "ops"):
            if field not in v:
                raise ValueError(f"{path}: variant {name!r} lacks field {field!r}")
        for field in ("names", "modules", "lines", "ops", "scopes"):
            if not isinstance(v.get(field, []), list):
                raise ValueError(f"{path}: variant {name!r}: {field} must be a list")
        sizes = [len(v["names"]), len(v["modules"]), None, len(v["lines"])]
        for event in v["ops"] + v.get("scopes", []):
            if (not isinstance(event, list) or len(event) != 6
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in event)
                    or any(n is not None and not 0 <= x < n for x, n in zip(event, sizes))
                    or not 0 <= event[4] < v["wall_ns"] or event[5] < 0):
                raise ValueError(f"{path}: variant {name!r}: event {str(event)[:80]} is not "
                                 "[name, module, run, line, start_ns, duration_ns] within "
                                 f"its tables ({sizes[0]} names, {sizes[1]} modules, "
                                 f"{sizes[3]} lines), starting inside its step")
    return data


# -- Variant (b): the stage kernels, one pallas_call per op ------------------------------
# Each op is its own jitted program (named after the op in the trace), called eagerly from
# a Python loop over layers: every op is a launch, and every launch primes and drains its
# own weight ring. Per-layer weights are passed in, so one compile serves every layer.
@functools.partial(jax.jit, static_argnames=("config",))
def prologue(config: ModelConfig, layer_params, x, positions):
    return attention_prologue(config, layer_params, x, positions, layer=0)


@jax.jit
def attention(q, k, v, k_cache, v_cache, positions, layer):
    B, T = q.shape[:2]
    o, k_cache, v_cache = decode_attention(q.reshape(B * T, -1), k.reshape(B * T, -1),
                                           v.reshape(B * T, -1), k_cache, v_cache, positions,
                                           layer=layer)
    return o.reshape(B, T, -1), k_cache, v_cache


@jax.jit
def output_projection(o, x, wo):
    B, T, _ = o.shape
    return x + stream_matmul(o.reshape(B * T, -1), wo).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("kind",))
def mlp(kind: Kind, x, mlp_norm, weights):
    B, T, D = x.shape
    h = ops.rms_norm(x, mlp_norm, kind.config.rms_eps,
                     width=kind.config.norm_width).reshape(B * T, D)
    return x + kind.stage(h, weights).reshape(x.shape)  # the MLP kind's stage kernel


@functools.partial(jax.jit, static_argnames=("config",))
def head(config: ModelConfig, x, final_norm, w):
    B, T, D = x.shape
    h = ops.rms_norm(x, final_norm, config.rms_eps, width=config.norm_width).reshape(B * T, D)
    return stream_matmul(h, w).reshape(B, T, -1)


@jax.jit
def embed(table, tokens):
    return table[tokens].astype(jnp.float32)


def staged_weights(config: ModelConfig, params) -> dict:
    """The weights of `staged_step`, laid out once: per layer ("layers"), the prologue's
    (the norm and the token mixer's weights but wo) with a leading axis of 1 (the stage
    wrapper indexes row 0) and the MLP's, its kind's (`kind`) by name; and "lm_head",
    a tied model's embedding transposed here, not in every step (a TPU trace showed that
    transpose as one more launch per step)."""
    kinds, layers = layer_kinds(config), []
    for layer in range(config.layers):
        (mixer, row), (kind, mlp_row) = (kind_at(kinds, role, layer) for role in ROLES)
        prologue = {n: params[n][row:row + 1] for n in mixer.weights() if n != "wo"}
        layers.append(dict(prologue={"attn_norm": params["attn_norm"][layer:layer + 1]}
                           | prologue, wo=params["wo"][row], mlp_norm=params["mlp_norm"][layer],
                           kind=kind, mlp={n: params[n][mlp_row]
                                           for n in kind.weights("ring", "dma")}))
    lm_head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return dict(layers=layers, lm_head=lm_head)


def staged_step(config: ModelConfig, params, weights: dict, cache: reference.KVCache,
                tokens, positions):
    """Variant (b): one decode step as one pallas_call per op (prologue, attention, output
    projection, MLP per layer, then the lm_head), each dispatched from this Python loop.
    `weights` is `staged_weights(config, params)`. Returns (logits [B, T, V] float32,
    cache), the contract of `mk.model.reference.decode_step`."""
    tokens, positions = decode_checks.validate_step(config, cache, tokens, positions)
    x = embed(params["embed"], tokens)
    k_cache, v_cache = cache
    for layer, w in enumerate(weights["layers"]):
        q, k, v = prologue(config, w["prologue"], x, positions)
        o, k_cache, v_cache = attention(q, k, v, k_cache, v_cache, positions,
                                        np.int32(layer))  # a host scalar: no launch
        x = output_projection(o, x, w["wo"])
        x = mlp(w["kind"], x, w["mlp_norm"], w["mlp"])
    return (head(config, x, params["final_norm"], weights["lm_head"]),
            reference.KVCache(k_cache, v_cache))


def variants(config: ModelConfig, params, cache: reference.KVCache, tokens, positions):
    """name -> a no-argument callable running one decode step that way (VARIANTS order);
    weights are laid out once, here, not in the step. Call the kernels inside
    `mk.kernels.backend.use(...)`."""
    B, T = jnp.shape(tokens)
    plan = DecodePlan.make(config, batch=B, rows=T, context=cache.capacity,
                           formats=quant.formats_of(params))
    weights = megakernel.prepare(plan, params)
    staged = staged_weights(config, params)
    return {
        "xla": lambda: reference.decode_step(config, params, cache, tokens, positions),
        "staged": lambda: staged_step(config, params, staged, cache, tokens, positions),
        "megakernel": lambda: megakernel.decode_step(plan, weights, cache, tokens,
                                                     positions),
    }


# -- XProf ----------------------------------------------------------------------------------
def trace_viewer(xplane_path: str | os.PathLike) -> dict:
    """The capture as XProf's trace viewer sees it (Chrome-trace JSON, parsed): proof that
    the file is in the layout XProf and TensorBoard open."""
    import json

    from xprof.convert import raw_to_tool_data

    untrusted.check_regular(xplane_path, "profile")  # a named pipe would block xprof
    with benign_stderr_dropped(XPROF_FALLBACK):
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(xplane_path)], "trace_viewer",
                                                       {})
    return json.loads(data)


# xprof 2.24.2 logs this at ERROR level (absl, C++) for every trace-viewer conversion, then
# converts by its legacy path: the result is complete, the line is noise on every page.
XPROF_FALLBACK = re.compile(r"No UnifiedProfileProcessor registered")


@contextlib.contextmanager
def benign_stderr_dropped(benign: re.Pattern):
    """Capture what C++ code writes to file descriptor 2 inside the block and write it back
    without the lines matching `benign`: every other line (a real error) still shows."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not benign.search(line):
                    sys.stderr.write(line)
