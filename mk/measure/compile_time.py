"""Compile-time benchmark: the megakernel against XLA, for one model and one TPU chip.

In the package so that notebook 07 runs it from an installed wheel;
`benchmarks/compile_time.py` is its command line, its recorded run ships in
`mk/data/compile_time/`. Three series, each one decode step compiled ahead of time from
ShapeDtypeStructs (nothing runs): `xla_unrolled` (`mk.model.reference`'s step, a loop over
layers), `xla_scan` (the same as a `lax.scan`), `megakernel` (`mk.measure.tpu.compile_megakernel`).
A series is a callable `(config, chip, batch, rows, context) -> CompileReport`
(`from_builder` makes one); the output is `Record`s, a table of ratios and each series'
growth with layers (seconds per layer, log-log exponent), wall-clock and CPU seconds.

Not here: running anything, the persistent compilation cache (not enabled: every compile
is cold), plots (the notebook draws the JSON this writes). How the series are interleaved
and warmed up, and the command line: docs/design/mk.measure.compile_time.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mk.measure import tpu
from mk.model import reference
from mk.model.config import ModelConfig
from mk.model.presets import preset
from mk.step.plan import DecodePlan
from mk.kinds.base import ROLES
from mk.kinds.layers import layer_kinds, of_role
from mk.model.weights import abstract_params

# (config, batch, rows, context) -> (fn, args); args are pytrees of ShapeDtypeStructs.
Builder = Callable[[ModelConfig, int, int, int], tuple[Callable, list]]
# A series: (config, chip, batch, rows, context) -> the compile's report.
Compile = Callable[[ModelConfig, str, int, int, int], "tpu.CompileReport"]
BASELINE = "xla_unrolled"
# Parameters without a leading layer axis; every other tensor is stacked per layer.
UNSTACKED = ("embed", "final_norm", "lm_head")


@dataclasses.dataclass(frozen=True)
class Record:
    """One compile: a series at a layer count."""

    layers: int
    series: str
    compile_seconds: float  # tracing + lowering + XLA/Mosaic compile, wall clock
    ok: bool
    error: str = ""  # the compiler's (or builder's) message when not ok
    cpu_seconds: float = 0.0  # CPU time of this process (all threads) over the same span
    model: str = ""
    chip: str = ""
    hbm_bytes: int = 0  # arguments + outputs + XLA temporaries
    code_bytes: int = 0


# -- Models at any layer count ------------------------------------------------------------
def model_at(config: ModelConfig, layers: int) -> ModelConfig:
    """`config` with `layers` layers: its first layers, or more layers like its last one."""
    if layers <= config.layers:
        return config.first_layers(layers)
    return config.pick_layers([*range(config.layers)] + [config.layers - 1] * (
        layers - config.layers))


def step_shapes(config: ModelConfig, batch: int, rows: int, context: int) -> list:
    """[params, cache, tokens, positions] of one decode step, as ShapeDtypeStructs."""
    params = abstract_params(config)
    kv = jax.ShapeDtypeStruct((config.layers, batch, config.kv_heads, context,
                               config.head_dim), config.dtype)  # [L, B, K, S, H]
    return [params, reference.KVCache(kv, kv), jax.ShapeDtypeStruct((batch, rows), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32)]


# -- The XLA decode step written with lax.scan --------------------------------------------
def check_uniform(config: ModelConfig) -> None:
    """A scan needs one layer body: every layer of one kind per role (all dense or all
    MoE, ...)."""
    kinds = layer_kinds(config)
    mixed = [k.name for role in ROLES if len(of_role(kinds, role)) > 1
             for k in of_role(kinds, role)]
    if mixed:
        raise NotImplementedError(
            f"{config.name}: a lax.scan over layers needs every layer of one kind; "
            f"its layers mix the kinds {mixed}")


@functools.partial(jax.jit, static_argnames=("config",))
def forward_scan(config: ModelConfig, params, cache: reference.KVCache, tokens, positions):
    """`mk.model.reference.forward` (no taps) as a `lax.scan` over the stacked layers.

    The scan body is `reference.decoder_layer` on a one-layer slice of the stacked weights,
    so the math is the reference's own; the caches are scanned over their layer axis.
    """
    check_uniform(config)
    stacked = {name: w for name, w in params.items() if name not in UNSTACKED}

    def layer(x, xs):
        weights, k_cache, v_cache = xs
        one = {name: w[None] for name, w in weights.items()}  # a 1-layer model: layer 0
        x, k_cache, v_cache, _ = reference.decoder_layer(config, one, 0, x, k_cache, v_cache,
                                                         positions)
        return x, (k_cache, v_cache)

    x = params["embed"][tokens].astype(reference.F32)  # [B, T, D]
    x, (k, v) = lax.scan(layer, x, (stacked, cache.k, cache.v))
    return reference.lm_head(config, params, x), reference.KVCache(k, v)


# -- The three series ---------------------------------------------------------------------
def xla_unrolled(config: ModelConfig, batch: int, rows: int, context: int):
    """The reference decode step: a Python loop over layers."""
    return functools.partial(reference.forward, config), step_shapes(config, batch, rows,
                                                                      context)


def xla_scan(config: ModelConfig, batch: int, rows: int, context: int):
    """The reference decode step as a lax.scan over stacked layers."""
    check_uniform(config)
    return functools.partial(forward_scan, config), step_shapes(config, batch, rows, context)


def from_builder(build: Builder) -> Compile:
    """A series that compiles `fn(*args)` of `build(config, batch, rows, context)`."""
    def compile_series(config, chip, batch, rows, context):
        fn, args = build(config, batch, rows, context)
        return tpu.compile_for_chip(fn, args, chip,
                                       name=f"{build.__name__} L={config.layers}")
    return compile_series


XLA_SERIES = {"xla_unrolled": from_builder(xla_unrolled), "xla_scan": from_builder(xla_scan)}


def megakernel_series() -> tuple[Compile, str]:
    """(the megakernel series, ""): `mk.measure.tpu.compile_megakernel` of the chip's plan
    (`DecodePlan.make(config, chip=, batch=, rows=, context=)`), the project's one
    megakernel compile path (the "" keeps the shape of a series that could be skipped)."""
    def compile_series(config, chip, batch, rows, context):
        return tpu.compile_megakernel(DecodePlan.make(
            config, chip=chip, batch=batch, rows=rows, context=context))
    return compile_series, ""


# -- Measuring ------------------------------------------------------------------------------
def warm_up(chip: str, series: dict[str, Compile]) -> list[Record]:
    """Compile each series once on the tiny preset, so that no timed compile pays the
    one-time costs (libtpu start-up, the first Mosaic compile, first traces of each op)."""
    return [measure_one(name, compile_series, preset("tiny"), chip, batch=8, rows=1,
                        context=256) for name, compile_series in series.items()]


def measure_one(series: str, compile_series: Compile, config: ModelConfig, chip: str,
                batch: int, rows: int, context: int) -> Record:
    """Compile one series at `config.layers`; a refusal or an exception becomes a record."""
    tag = dict(layers=config.layers, series=series, model=config.name, chip=chip)
    jax.clear_caches()  # every compile traces from scratch, whatever ran before it
    cpu = time.process_time()
    try:
        report = compile_series(config, chip, batch, rows, context)
    except Exception as err:  # a builder or compiler refusal is a result, not a crash
        return Record(compile_seconds=0.0, ok=False, error=f"{type(err).__name__}: {err}",
                      **tag)
    return Record(compile_seconds=report.compile_seconds, ok=report.ok, error=report.error,
                  cpu_seconds=time.process_time() - cpu,
                  hbm_bytes=report.argument_bytes + report.output_bytes + report.temp_bytes,
                  code_bytes=report.code_bytes, **tag)


def measure(config: ModelConfig, chip: str, layers, *, batch: int = 8, rows: int = 1,
            context: int = 4096, megakernel: Compile | None = None,
            on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Every series at every layer count, interleaved (all series at 4 layers, then 8...),
    after `warm_up`.

    `megakernel` adds that series; `from_builder` makes one from a (fn, args) builder.
    """
    series = dict(XLA_SERIES, **({"megakernel": megakernel} if megakernel else {}))
    warm_up(chip, series)
    records = []
    for n in layers:
        model = model_at(config, n)
        for name, compile_series in series.items():
            record = measure_one(name, compile_series, model, chip, batch, rows, context)
            records.append(record)
            if on_record:
                on_record(record)
    return records


# -- Summaries ------------------------------------------------------------------------------
def ratios(records: list[Record], key: str = "compile_seconds") -> dict[int, dict]:
    """layers -> {series: its seconds / xla_unrolled's}, where both compiled.

    `key` picks the seconds: "compile_seconds" (wall clock) or "cpu_seconds".
    """
    ok = {(r.layers, r.series): getattr(r, key) for r in records if r.ok}
    out = {}
    for (n, series), seconds in ok.items():
        if series != BASELINE and (n, BASELINE) in ok:
            out.setdefault(n, {})[series] = seconds / ok[n, BASELINE]
    return out


def growth(records: list[Record], key: str = "compile_seconds") -> dict[str, dict]:
    """series -> {seconds_per_layer, intercept, exponent} fitted over its compiled points.

    seconds = intercept + seconds_per_layer * layers (least squares), and seconds ~
    layers**exponent (a line in log-log). Needs two distinct layer counts; the exponent
    needs three (a power through two points always fits exactly, so it says nothing) and
    is None with fewer.
    """
    out = {}
    for series in dict.fromkeys(r.series for r in records):
        points = [(r.layers, getattr(r, key)) for r in records
                  if r.series == series and r.ok]
        if len({n for n, _ in points}) < 2:
            continue
        n, s = np.array(points, dtype=float).T
        slope, intercept = np.polyfit(n, s, 1)
        exponent = (float(np.polyfit(np.log(n), np.log(s), 1)[0])
                    if len(set(n)) >= 3 else None)
        out[series] = dict(seconds_per_layer=float(slope), intercept=float(intercept),
                           exponent=exponent)
    return out


def format_table(records: list[Record], key: str = "compile_seconds") -> str:
    """Seconds (`key`) per layer count and series, the ratios to xla_unrolled, the growth."""
    series = list(dict.fromkeys(r.series for r in records))
    layers = sorted({r.layers for r in records})
    cell = {(r.layers, r.series): r for r in records}
    others = [s for s in series if s != BASELINE]
    unit = {"compile_seconds": "s", "cpu_seconds": "cpu s"}[key]
    head = ["layers"] + [f"{s} {unit}" for s in series] + [f"{s}/{BASELINE}" for s in others]
    rows, rat = [head], ratios(records, key)
    for n in layers:
        row = [str(n)]
        for s in series:
            r = cell.get((n, s))
            row.append("-" if r is None else f"{getattr(r, key):.2f}" if r.ok else "FAILED")
        row += [f"{rat[n][s]:.3f}" if s in rat.get(n, {}) else "-" for s in others]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("")
    for s, fit in growth(records, key).items():
        power = ("" if fit["exponent"] is None
                 else f", {unit} ~ layers^{fit['exponent']:.2f}")
        lines.append(f"{s}: {fit['seconds_per_layer']:.3f} {unit} per added layer "
                     f"(intercept {fit['intercept']:.2f} {unit}){power}")
    return "\n".join(lines)


def format_failures(records: list[Record]) -> str:
    """One line per compile that did not succeed, with the first line of its error."""
    return "\n".join(f"FAILED {r.series} at {r.layers} layers: "
                     f"{r.error.splitlines()[0] if r.error else ''}"
                     for r in records if not r.ok)


def main(argv=None) -> list[Record]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", default="v6e")
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--json", type=Path, help="write the records here (after each one); "
                        "a new file: an existing one (a committed recording) is refused")
    parser.add_argument("--no-megakernel", action="store_true",
                        help="skip the megakernel series even if mk.step.megakernel exists")
    args = parser.parse_args(argv)
    if args.json and args.json.exists():
        parser.error(f"--json {args.json} exists; it would be replaced by a partial recording "
                     "after the first record. Name a new file, then move it over the old one")

    config = preset(args.preset)
    megakernel, why = (None, "--no-megakernel") if args.no_megakernel \
        else megakernel_series()
    if megakernel is None:
        print(f"megakernel series skipped: {why}")
    print(f"{config.name} on {args.chip}: B={args.batch} T={args.rows} S={args.context}, "
          f"layers {args.layers}, jax {jax.__version__}")
    records = []

    def report(record: Record) -> None:
        records.append(record)
        status = f"{record.compile_seconds:8.2f} s" if record.ok else "  FAILED"
        print(f"  {record.series:>13} L={record.layers:<3} {status}  CPU "
              f"{record.cpu_seconds:8.2f} s  HBM {record.hbm_bytes / 2**30:6.2f} GiB  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(
                dict(model=config.name, chip=args.chip, batch=args.batch, rows=args.rows,
                     context=args.context, jax=jax.__version__, megakernel_skipped=why,
                     records=[dataclasses.asdict(r) for r in records]), indent=1))

    measure(config, args.chip, args.layers, batch=args.batch, rows=args.rows,
            context=args.context, megakernel=megakernel, on_record=report)
    for key in ("compile_seconds", "cpu_seconds"):
        print(f"\n{key} ({'wall clock' if key == 'compile_seconds' else 'process CPU time'}):")
        print(format_table(records, key))
    if not all(r.ok for r in records):
        print()
        print(format_failures(records))
    return records

