# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 13 · Measure your TPU: DMA latency, bytes in flight, one step
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/13_measure_your_tpu.ipynb)
#
# The simulator (`mk.cost.sim`) rests on two numbers no datasheet gives: how long a DMA takes
# from its issue to its first byte (0.5 µs, assumed), and what share of the datasheet
# bandwidth one TensorCore's DMAs reach (1.0, assumed). A ring hides the latency only with
# enough bytes in flight (Little's law, notebook 01), so both decide the simulated step.
# On a TPU runtime this notebook measures them and answers:
#
# - How long does one copy HBM -> VMEM take against its size, and what is the latency?
# - How many bytes must be in flight before the copies reach the chip's bandwidth?
# - How long does one megakernel step take, against the simulated step?
# - What does the simulator do with a measured file, `data/measured/<chip>.json`?
#
# **On a CPU it measures nothing about a TPU.** The same code runs in TPU interpret mode:
# every time below is then the interpreter's on this CPU, nothing is written under
# `data/measured`, and the simulator is shown a labelled example file instead.
#
# **You will** measure DMA latency and HBM bandwidth on a TPU runtime and feed them to
# the simulator. **You will be able to** size a ring from measured numbers.
# **Prerequisites:** 01 (Little's law).

# %% tags=["hide-input"]
# Colab bootstrap, the same in every notebook. On Colab without the mk-megakernel package,
# pip installs MK_SOURCE (this release's tag; set the environment variable MK_SOURCE to
# install another ref or a fork) with the `colab` extra (the profiler; nothing of Colab's
# own Jupyter packages moves), then asks for a restart. Anywhere, a folder named mk that
# is not the package stops here, saying so.
import importlib.metadata
import importlib.util
import os
import sys

MK_SOURCE = os.environ.get("MK_SOURCE", "git+https://github.com/mk-megakernel/mk@v0.1.0")
if "google.colab" in sys.modules:
    try:
        importlib.metadata.version("mk-megakernel")
    except importlib.metadata.PackageNotFoundError:
        # %pip install -q "mk-megakernel[colab] @ {MK_SOURCE}"
        # `from None`: with the PackageNotFoundError as its context, IPython 7.34 on Python
        # 3.13 shows "Internal Python error in the inspect module" instead of this message.
        raise SystemExit("mk installed: Runtime > Restart session, then run all cells "
                         "again.") from None
mk_spec = importlib.util.find_spec("mk")
if mk_spec is None or mk_spec.origin is None:
    raise ModuleNotFoundError(
        "the mk package is not installed: pip install 'mk-megakernel[notebooks,profile]'"
        + (f"; {list(mk_spec.submodule_search_locations)} is a folder named mk, not the "
           "package: rename it or work in another directory" if mk_spec else ""))

# %% tags=["parameters"]
preset: str = "tiny"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 1  # B, sequences decoded together
rows: int = 1  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v6e"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
sweep: str = "auto"  # "full" (4 KiB-4 MiB, up to 64 in flight), "quick"; "auto": full on a TPU
write_measured: bool = True  # on a TPU, write data/measured/<chip>.json (never on a CPU)
example_latency_us: float = 1.0  # on a CPU, the example file's DMA latency (made up)
sim_preset: str = "qwen3-8b"  # a full-size model whose simulated step the latency changes
exercise_write_as: str = ""  # the exercise: a chip name to write this run's record as

# %%
import dataclasses
import tempfile
from pathlib import Path

import jax
from IPython.display import display

import mk
import mk.kernels.backend
import mk.course.run
from mk.cost import ledger, sim
from mk.measure import measure
from mk import plots
from mk.kernels.dma_probe import dma_probe_kernel
from mk.step.plan import DecodePlan

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
mode = mk.kernels.backend.resolve(run.backend)
on_tpu = mode == "hardware"
kind = jax.devices()[0].device_kind
chip_name = measure.chip_of(kind) if on_tpu else run.chip
if sweep not in ("auto", *measure.SWEEPS):
    raise ValueError(f"sweep={sweep!r} must be 'auto' or one of {tuple(measure.SWEEPS)}")
probe_sweep = measure.SWEEPS[sweep if sweep != "auto" else "full" if on_tpu else "quick"]
spec = mk.chip(chip_name)
position = run.context - run.rows  # every sequence reads a full cache: the worst case
print(f"device: {kind}; kernels run on: {mode}; chip of the simulator: {chip_name}"
      + ("" if on_tpu or chip_name == run.chip else f" (not chip={run.chip!r})"))
if not on_tpu:
    print(f"NOT A TPU: every time below is {measure.INTERPRET_LABEL!r}, the interpreter's "
          "time on this CPU; it says nothing about a TPU")

# %% [markdown]
# ## The probe
#
# The ring of notebook 01 with the matmul taken out: `count` chunks of one size, chunk i
# into slot i mod `in_flight`, and waiting for chunk i issues chunk i + `in_flight`. With
# one copy in flight, each copy of $n$ bytes takes the latency $\ell$ and then its bytes:
#
# $$t_1(n) = \ell + n / B,$$
#
# so the intercept of the line through $t_1$ against $n$ is $\ell$. With $d$ in flight
# the copies overlap and the time per copy falls to $\max(n / B,\; t_1(n) / d)$: the
# bandwidth $n / t_d$ reaches $B$ once the bytes in flight $d\,n$ cover $B\,\ell$
# (Little's law). The kernel, as `mk.kernels.dma_probe` holds it:

# %%
plots.show_source(dma_probe_kernel)

# %% [markdown]
# Each point is timed by the wall clock around a blocking call, at two counts
# (`Sweep.counts`), `repeats` times each (the median): the difference over the extra
# copies is the steady time per copy, without the call's fixed cost (dispatch, prologue).
# On a TPU that fixed cost is about 1 ms and wanders by tens of microseconds, so the
# extra copies must move gigabytes (`Sweep.min_extra_bytes`, `Sweep.counts_for`): with
# 512 extra 256 KiB copies, 164 us of work, a v5e's wall clock "measured" 6.7 TB/s on a
# chip of 819 GB/s. A point faster than the datasheet is refused as noise.
# The same code, `mk.measure.measure.measure`, times one megakernel step of `preset`.

# %%
record = measure.measure(run.backend, sweep=probe_sweep, config=run.config, batch=run.batch,
                         rows=run.rows, context=position)
print(f"{record.label}: {len(record.dma)} probe points, counts {record.counts}, "
      f"{record.repeats} repeats; {record.step.model} step timed")
display(plots.table([dict(KiB=p.bytes / 1024, in_flight=p.in_flight,
                          KiB_in_flight=p.bytes_in_flight / 1024,
                          us_per_copy=f"{p.seconds * 1e6:.4g}",
                          GB_per_s=f"{p.bandwidth / 1e9:.4g}") for p in record.dma]))

# %% [markdown]
# ## Latency against size
#
# One copy in flight, by size, with the fitted line $\ell + n / B$.

# %%
where = f"measured on {kind}" if on_tpu else "interpret mode on a CPU, not a TPU"
ones = record.latency_points()
latency, slope = record.latency_fit()
fig = plots.lines([p.bytes / 1024 for p in ones], {
    "µs per copy": [p.seconds * 1e6 for p in ones],
    "fit: latency + bytes / B": [(latency + slope * p.bytes) * 1e6 for p in ones]},
    title=f"One copy in flight ({where})", xaxis="copy size (KiB)",
    yaxis="time per copy (µs)")
fig.update_xaxes(type="log")
plots.show(fig)
print(f"latency (intercept): {latency * 1e6:.4g} µs ({where}); the simulator assumes "
      f"{sim.Assumptions().dma_latency_s * 1e6:.3g} µs")

# %% [markdown]
# ## Bandwidth against bytes in flight
#
# Copies of one size (`Sweep.chunk`), more and more of them outstanding. On a TPU the
# datasheet's bandwidth of one device and Little's law's bytes in flight
# ($B\,\ell$ with the latency above) are drawn too.

# %%
deep = sorted((p for p in record.dma if p.bytes == probe_sweep.chunk), key=lambda p: p.in_flight)
x = [p.bytes_in_flight / 1024 for p in deep]
series = {"GB/s reached": [p.bandwidth / 1e9 for p in deep]}
datasheet = spec.device_hbm_bw
if on_tpu:
    series[f"datasheet, one device of {spec.name}"] = [datasheet / 1e9] * len(deep)
fig = plots.lines(x, series, title=f"Bandwidth against bytes in flight ({where})",
                  xaxis="bytes in flight (KiB)", yaxis="bandwidth (GB/s)")
if on_tpu:
    fig.add_vline(x=datasheet * latency / 1024, line_dash="dot",
                  annotation_text="Little's law: B x latency")
fig.update_xaxes(type="log")
plots.show(fig)
print(f"best bandwidth: {record.hbm_bw / 1e9:.4g} GB/s ({where})"
      + (f" = {record.hbm_share(spec):.1%} of the datasheet's {datasheet / 1e9:.0f} GB/s"
         if on_tpu else ""))

# %% [markdown]
# ## The file
#
# On a TPU the record goes to `data/measured/<chip>.json` (its schema is in
# data/README.md). An interpret-mode record is never written there nor to any file named
# for a TPU: here it goes to a temporary file, labelled, and the refusal is shown.

# %%
folder = Path(tempfile.mkdtemp(prefix="mk13-"))
before = sorted(measure.MEASURED.glob("*.json"))  # what a TPU wrote there before this run
if on_tpu and write_measured:
    path = measure.write(record)
else:
    path = measure.write(record, folder / f"{record.chip or 'interpret'}.json")
print(f"written: {path}  (mode {record.mode!r}, label {record.label!r})")
if not on_tpu:
    try:
        measure.write(record)
    except ValueError as refused:
        print(f"refused, as it must be: {refused}")
assert measure.load(path) == record, "the record did not survive its JSON"

# %% [markdown]
# ## What the simulator does with it
#
# `sim.Assumptions.measured(chip, path)` takes `dma_latency_s` and `hbm_share` from a
# file (by default the chip's own `data/measured/<chip>.json` when it exists, else the
# assumed defaults) and says where they came from in `source`. On a TPU that is the
# file just written. On a CPU it is an **example** file, made up with a latency of
# `example_latency_us` (`mk.measure.measure.example`, labelled so): it shows what a measured
# file changes, and measures nothing.

# %%
if on_tpu:
    source = path if write_measured else None
else:
    source = measure.write(measure.example(spec, dma_latency_s=example_latency_us * 1e-6),
                           folder / f"example-{spec.name}.json")
assumed, taken = sim.Assumptions(), sim.Assumptions.measured(spec, source)
print(f"assumed: latency {assumed.dma_latency_s * 1e6:.3g} µs, share {assumed.hbm_share:.3g}"
      f" ({assumed.source})\nfrom the file: latency {taken.dma_latency_s * 1e6:.4g} µs, "
      f"share {taken.hbm_share:.3g} ({taken.source})")

# %%
models = {run.config.name: (run.config, position), sim_preset: (mk.preset(sim_preset), 4096)}
sims = []
for name, (cfg, ctx) in models.items():
    step_plan = DecodePlan.make(cfg, chip=spec, batch=run.batch, rows=run.rows, position=ctx,
                                kernel=False)
    for label, a in (("assumed", assumed), ("file", taken)):
        s = sim.simulate(step_plan, assumptions=a)
        sims.append(dict(model=name, context=ctx, numbers=label,
                          latency_us=f"{a.dma_latency_s * 1e6:.3g}",
                          simulated_step_us=f"{s.step_s * 1e6:.4g}",
                          HBM_busy=f"{s.hbm_utilisation:.1%}"))
display(plots.table(sims))
step = record.step
print(f"measured step of {step.model} (B={step.batch}, T={step.rows}, S={step.context}): "
      f"{step.seconds * 1e6:.4g} µs, {where}"
      + ("" if on_tpu else ": the interpreter's time, not comparable with the simulated step"))

# %% [markdown]
# How the simulated step of `sim_preset` moves with the latency, the default ring, the
# assumed and the file's latency marked:

# %%
cfg, ctx = models[sim_preset]
grid = sorted({0.25, 0.5, 1.0, 2.0, 4.0, round(taken.dma_latency_s * 1e6, 3)})
step_plan = DecodePlan.make(cfg, chip=spec, batch=run.batch, rows=run.rows, position=ctx,
                            kernel=False)
steps_us = [sim.simulate(step_plan, assumptions=dataclasses.replace(
    taken, dma_latency_s=us * 1e-6)).step_s * 1e6 for us in grid]
fig = plots.lines(grid, {f"{sim_preset} on {spec.name}": steps_us},
                  title="Simulated step against DMA latency (simulated)",
                  xaxis="DMA latency (µs)", yaxis="simulated step (µs)")
for us, text in ((assumed.dma_latency_s * 1e6, "assumed"),
                 (taken.dma_latency_s * 1e6, "measured" if on_tpu else "example")):
    fig.add_vline(x=us, line_dash="dot", annotation_text=text)
plots.show(fig)

# %% [markdown]
# **Exercise: a CPU's times as a TPU's.** Set `exercise_write_as = "v6e"` (on a TPU: any
# chip but this one's): the cell tries to write this run's record as that chip's measured
# file, and the last cell fails with the reason `mk.measure.measure.write` refused it.

# %%
exercise_error = None
if exercise_write_as:
    try:
        measure.write(record, measure.path_for(exercise_write_as))
    except ValueError as refused:
        exercise_error = refused
        print(f"refused: {refused}")

# %% [markdown]
# ## Measured against simulated on a real chip
#
# A lent TPU v5e ran this measurement with the notebook's defaults (its record is
# data/measured/v5e.json), and `benchmarks/tpu_steps.py` timed the megakernel's device
# loops there (data/measured/v5e-steps.json). The DMA probe alone leaves the simulator
# fast on the steps that read much KV: the attention loop takes KV slower than the DMA
# engine brings it. `mk.cost.calibration` reads that rate, and a per-sequence cost, from sweeps
# of those loops (context at B = 1, then B at one context); the table gives each row's
# "calibrated step" and its error against the chip:

# %%
display(ledger.steps_table("v5e"))

# %% [markdown]
# ## Takeaway
#
# The latency and the bandwidth share are the two numbers of the simulator that only a
# chip's DMA probe can give (the attention loop's rate needs timed steps, above); a ring deep enough for one latency may be too shallow for another. On a
# TPU this notebook measures both and the simulator takes them from
# `data/measured/<chip>.json` when asked (`sim.Assumptions.measured`); on a CPU it shows
# the mechanism with an example file and measures nothing about a TPU. The numbers of
# this run:

# %%
print(f"{where}: latency {latency * 1e6:.4g} µs, best bandwidth {record.hbm_bw / 1e9:.4g} "
      f"GB/s, one {step.model} step {step.seconds * 1e6:.4g} µs")
print(f"simulator with {taken.source}: " + "; ".join(
    f"{r['model']} {r['numbers']} {r['simulated_step_us']} µs" for r in sims))

# %% [markdown]
# ## Questions
#
# 1. Why does a CPU run write nothing under data/measured?
#    <details><summary>Answer</summary>Its times are the interpreter's on the CPU, not a TPU's: a simulator fed
#    with them would model a machine that does not exist.</details>


# %% [markdown]
# ## Checks

# %%
if exercise_error is not None:
    raise AssertionError(f"exercise: the record was refused as {exercise_write_as}'s file: "
                         f"{exercise_error}")
assert all(p.seconds > 0 for p in record.dma) and record.step.seconds > 0
assert record.mode == mode and (record.chip == chip_name if on_tpu else record.chip is None)
assert taken.source != "assumed" or source is None, "the file's numbers were not taken"
simulated = [float(r["simulated_step_us"]) for r in sims]
if taken.dma_latency_s > assumed.dma_latency_s and taken.hbm_share <= assumed.hbm_share:
    assert all(f >= a for a, f in zip(simulated[::2], simulated[1::2])), "a longer latency sped up"
assert all(b >= a * (1 - 1e-9) for a, b in zip(steps_us, steps_us[1:])), "latency sped a step up"
if not on_tpu:
    assert sorted(measure.MEASURED.glob("*.json")) == before, "a CPU wrote under data/measured"
print("checks passed")
