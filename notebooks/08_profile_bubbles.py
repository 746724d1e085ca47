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
# # 08 · Profiling the memory pipeline: where the bubbles are
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/08_profile_bubbles.ipynb)
#
# A decode step is bound by the bytes it moves (notebook 00), so the HBM -> VMEM pipeline
# should never stop. Every kernel edge can stop it: a kernel's ring drains before it ends,
# the next one's ring fills after it starts, and the host may dispatch the next kernel
# late. This notebook profiles the same decode step three ways and answers:
#
# - How do I capture a profile, read it back, and open it in XProf or TensorBoard?
# - What is a bubble, exactly, and how big is it for (a) XLA's many ops, (b) the stage
#   kernels one `pallas_call` per op, (c) the megakernel, one call per step?
# - What does the simulator predict for the same step on a TPU, and for qwen3-8b on TPU7x?
# - What can the TPU compiler tell us about the megakernel without a TPU?
#
# **You will** capture three profiles, compute their bubbles, and count the compiled
# megakernel's bundles per named phase. **You will be able to** capture and read a profile
# on any backend, say what a CPU trace can and cannot show about a TPU, and find where in
# the kernel's code a phase begins. **Prerequisites:** 05 (`layer_body`), 06 (the
# megakernel), 07 (compiling for a TPU without one).

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
steps: int = 3  # profiled decode steps per variant (after one warm-up step)
predict_preset: str = "qwen3-8b"  # the simulator's second prediction
predict_chip: str = "tpu7x"  # a name from mk.model.chips.CHIP_NAMES: the second prediction's chip
predict_context: int = 4096  # S of the simulator's second prediction
schedule_dump: bool = True  # compile the megakernel for `chip` with the compiler's dumps (~10 s)
solutions: bool = False  # True checks the worked solution in place of your fix (headless runs)

# %%
import dataclasses
import tempfile

import jax
import jax.numpy as jnp
from IPython.display import display
from tqdm.auto import tqdm

import mk
import mk.kernels.backend
import mk.course.run
import mk.cost.sim
from mk.cost import bundles, calibration
from mk.course import course, scopes, teach
from mk.measure import measure, profiling
from mk import plots, profile_plots, sim_plots
from mk.model import reference
from mk.step import megakernel as megakernel_module
from mk.step import one_layer as one_layer_module
from mk.step.plan import DecodePlan

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode = run.config, mk.kernels.backend.resolve(run.backend)
on_tpu = mode == "hardware"
print(f"{config.name}: {config.layers} layers, B={run.batch} T={run.rows} S={run.context}; "
      f"kernels run on: {mode}; profiles go to {profiling.PROFILES}")

# %% [markdown]
# ## What a bubble is
#
# A profile is a list of op events (name, start, duration, line). Per decode step:
#
# - **wall**: the step's `StepTraceAnnotation`, from the host starting the step to its
#   result being ready;
# - **busy**: the length of the *union* of every op event on every line (two threads
#   working at once count once; an op nested in another counts inside its parent);
# - **idle** = (last op end - first op start) - busy: gaps inside the step where no op
#   runs anywhere; **host gap** = wall - (last op end - first op start): before the first
#   op and after the last;
# - **bubble share** = (idle + host gap) / wall.
#
# A capture's row below is its median step (by wall time): on a shared CPU the OS can
# preempt a step, and one such step should not decide.
#
# On a TPU, an op is a kernel on the chip. On this CPU, an XLA program's ops run on
# XLA's thread pool, and a `pallas_call` in interpret mode is a whole XLA program that
# *simulates* the kernel (thousands of small ops, its DMAs are host callbacks), so for (b)
# and (c) we also count **launches**: programs run per step.

# %% [markdown]
# ## Capturing the three variants
#
# `profiling.capture` runs one warm-up step, then `steps` steps under
# `jax.profiler.trace`, each one annotated, into `profiles/<name>/plugins/profile/<run>/`
# (the XProf/TensorBoard layout; a new run never overwrites an old one). Same weights,
# same cache, same token for all three.

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
prompt = jax.random.randint(jax.random.key(run.seed), (run.batch, 5), 0, config.vocab)
_, cache = reference.prefill(config, params, prompt, max_context=run.context)
tokens = prompt[:, -run.rows:]
positions = jnp.full((run.batch,), prompt.shape[1], jnp.int32)
step_fns = profiling.variants(config, params, cache, tokens, positions)
captures = {}
with mk.kernels.backend.use(run.backend):
    for name, fn in tqdm(step_fns.items(), desc="captures"):
        captures[name] = profiling.capture(fn, steps=steps, name=f"{config.name}-{name}")
        print(f"{name:>10}: {captures[name].path.relative_to(profiling.PROFILES.parent)}")

# %% [markdown]
# ## Bubbles per variant, measured on this machine

# %%
timelines = {name: profiling.timeline(c.path) for name, c in captures.items()}
per_step = {name: profiling.bubbles(tl) for name, tl in timelines.items()}
summary = [profiling.summary(per_step[name], name) for name in profiling.VARIANTS]
display(plots.table(summary))
where = "a TPU" if on_tpu else "this CPU (interpret mode for (b) and (c): a simulation)"
plots.show(profile_plots.share_bars(summary,
                                    title=f"Bubble share per variant, measured on {where}"))

# %% [markdown]
# How to read it on a CPU. (a) is real CPU work: the gaps between XLA:CPU's ops are what
# its thread pool really leaves idle, and the host gap is Python dispatch plus the result's
# return. (b) and (c) run the kernels in TPU interpret mode: their absolute times are the
# interpreter's, not a TPU's, and the few gaps between (b)'s launches are small next to
# the interpreted kernels. What carries over to a TPU is the *structure*: (b) launches
# `2 + 4 L` programs per step and each one primes and drains its own weight ring; (c)
# launches one and its ring never drains.

# %% [markdown]
# ## The timelines
#
# The median step of each variant: ops per line (the busiest lines), then the bubbles:
# idle (no op on any line, red) and host gap (orange). Hover for op names.

# %%
rows_by_name = {r["variant"]: r for r in summary}
for name in profiling.VARIANTS:
    row = rows_by_name[name]
    plots.show(profile_plots.gantt(timelines[name], per_step[name], row["median_step"], title=(
        f"({'abc'[profiling.VARIANTS.index(name)]}) {name}: {row['wall_ms']} ms per step, "
        f"{row['launches_per_step']:g} launches, {row['ops_per_step']:g} ops, bubble share "
        f"{row['bubble_share']:.1%} (measured, "
        f"{'XLA:CPU' if name == 'xla' and not on_tpu else mode})")))

# %% [markdown]
# Which ops take the time (self time: an op's duration minus the ops nested in it):

# %%
top_ops = []
for name in profiling.VARIANTS:
    shares = per_step[name][rows_by_name[name]["median_step"]].op_share
    top_ops += [dict(variant=name, op=op, share=f"{v:.1%}") for op, v in list(shares.items())[:3]]
display(plots.table(top_ops))

# %% [markdown]
# ## The simulator's prediction
#
# `mk.cost.sim` replays the megakernel's own tile schedule on a model of the chip (its
# docstring lists every assumption): a DMA lane and a compute lane, and HBM-idle bubbles
# with their causes. Same colours as above: busy blue, bubbles red. First the step
# measured above, on `chip`; then `predict_preset` on `predict_chip`. (The simulator models
# the megakernel only; `cross_layer_prefetch=False` is its closest stand-in for a kernel
# per layer, whose ring drains at each layer edge.)

# %%
predictions = []
for cfg, chip_name, ctx in ((config, run.chip, run.context),
                            (mk.preset(predict_preset), predict_chip, predict_context)):
    step = DecodePlan.make(cfg, chip=chip_name, batch=run.batch, rows=run.rows, position=ctx,
                           kernel=False)
    for prefetch in (True, False):
        sim = mk.cost.sim.simulate(step, cross_layer_prefetch=prefetch)
        idle = sum(b.idle_s for b in sim.bubbles)
        predictions.append(dict(model=cfg.name, chip=chip_name, context=ctx,
                                cross_layer_prefetch=prefetch,
                                step_us=round(sim.step_s * 1e6, 1),
                                bubble_share=f"{idle / sim.step_s:.1%}"))
        if prefetch:
            plots.show(sim_plots.timeline(sim, title=(
                f"{cfg.name} on {chip_name} (simulated): {sim.step_s * 1e6:.1f} µs, "
                f"HBM idle {idle / sim.step_s:.1%}")))
display(plots.table(predictions))

# %% [markdown]
# One kernel removes the edges, not every bubble: inside the megakernel, the HBM still
# waits whenever the ring is too shallow to cover a DMA's latency. The simulator's
# prediction for `predict_preset` on `predict_chip` as the ring deepens, against the plan's
# own default depth (printed below: Little's law for that chip, `default_block`):

# %%
cfg = mk.preset(predict_preset)
base = DecodePlan.make(cfg, chip=predict_chip, batch=run.batch, rows=run.rows,
                       position=predict_context, kernel=False).block
depth = []
for slots in sorted({2, 3, 4, 6, 8, base.slots}):
    sim = mk.cost.sim.simulate(DecodePlan.make(
        cfg, chip=predict_chip, batch=run.batch, rows=run.rows, position=predict_context,
        block=dataclasses.replace(base, slots=slots), kernel=False))
    idle = sum(b.idle_s for b in sim.bubbles)
    depth.append(dict(slots=slots, step_us=round(sim.step_s * 1e6, 1),
                      bubble_share=f"{idle / sim.step_s:.1%}",
                      largest_cause=next(iter(sim.bubble_share()), "")))
display(plots.table(depth))
on, off = (p["step_us"] for p in predictions[2:4])  # predict_preset, prefetch on / off
best = min(d["step_us"] for d in depth)
default = next(d["step_us"] for d in depth if d["slots"] == base.slots)
print(f"{predict_preset} on {predict_chip}: cross-layer prefetch saves {1 - on / off:.2%} "
      f"of the step; the best ring depth above saves {1 - best / default:.2%} against "
      f"the plan's default of {base.slots} slots")

# %% [markdown]
# The two savings side by side: a layer edge without prefetch costs one descriptor latency
# and one tile once per layer, while a ring shallower than Little's law asks (bandwidth x
# latency bytes in flight) pays a latency on every tile. Which one matters more here is a
# number of this run, not a rule:

# %%
deeper = "a deeper ring" if 1 - best / default > 1 - on / off else "cross-layer prefetch"
print(f"{predict_preset} on {predict_chip} (simulated): {deeper} saves more "
      f"({1 - best / default:.2%} for the best depth vs the default {base.slots} slots, "
      f"{1 - on / off:.2%} for "
      f"prefetch); a saving under 1 % means the default already covers that latency")

# %% [markdown]
# ## The same step on a real chip: a TPU v5e's trace
#
# Everything measured above ran where this notebook runs. `benchmarks/tpu_trace.py` ran the
# same three variants on a lent TPU v5e (qwen3-0.6b, B 1, the step at position 5 of a
# 1024-position cache, 5 steps each) and kept each capture's median step: the op events of
# the device plane's "XLA Ops" line, in data/measured/v5e-trace.json.
# `profiling.recorded_timeline` reads a step back and the same `bubbles` measure it. On
# the chip an op is a kernel on the TPU, so idle is the chip waiting and the host gap is
# dispatch: (b)'s idle is the chip waiting between its launches. (The record's (b) counts
# 2 + 4 L + 1 launches: at its commit a tied lm_head was transposed in every step, one
# `jit_transpose` more; `staged_weights` now lays it out once.)

# %%
chip_path = measure.MEASURED / "v5e-trace.json"
chip_trace = profiling.load_trace_record(chip_path) if chip_path.exists() else None
if chip_trace is None:
    print(f"no recorded chip trace: {chip_path.name} lives in data/measured of a checkout")
else:
    chip_made = (f"{chip_trace['device_kind']}, {chip_trace['when'][:10]}, "
                 f"commit {chip_trace['commit'][:7]}")
    chip_steps = {n: profiling.recorded_timeline(chip_trace, n) for n in profiling.VARIANTS}
    chip_bubbles = {n: profiling.bubbles(tl)[0] for n, tl in chip_steps.items()}
    display(plots.table([dict(
        variant=n, launches=b.launches, ops=b.ops, step_ms=round(b.wall_ns / 1e6, 3),
        on_chip_ms=round(b.span_ns / 1e6, 3), idle_on_chip=f"{b.idle_share:.1%}",
        host_gap_ms=round(b.host_ns / 1e6, 3)) for n, b in chip_bubbles.items()]))
    plots.show(profile_plots.share_bars(
        [profiling.summary([b], n) for n, b in chip_bubbles.items()],
        title=f"Bubble share per variant, measured on {chip_made}"))

# %% [markdown]
# The megakernel's step on the chip, op by op. One op holds the whole model
# (`mk_megakernel`); the others are XLA's around it: the embedding's gather, the logits'
# slice, and copies of the KV cache, because this step is called without donating its
# cache (XLA keeps the caller's cache and gives the kernel a copy to update). A serving
# loop donates it (`decode_step(..., donate=True)`, `generate`'s device loop) and those
# copies go (compiled for a v5e, tests/test_megakernel.py holds it):

# %%
if chip_trace is not None:
    mega = chip_steps["megakernel"]
    plots.show(profile_plots.gantt(mega, [chip_bubbles["megakernel"]], 0, measured_on=chip_made,
                                   title="(c) megakernel, one step on the TPU v5e"))
    display(plots.table([dict(op=o.name, us=round(o.duration_ns / 1e3, 1))
                         for o in sorted(mega.ops, key=lambda o: -o.duration_ns)[:6]]))

# %% [markdown]
# And the simulator's step for the same model, position and chip, beside the kernel's
# measured time: once with the datasheet's HBM, once with what the v5e measured
# (`mk.cost.calibration.assumptions`: its DMA probe and its attention loop's rate). A trace sees
# the kernel as one op, so the bubbles inside it are the simulator's alone:

# %%
if chip_trace is not None:
    kernel, = (o for o in mega.ops if o.name.startswith("mk_megakernel"))
    chip_sim = []
    for label, assumed in (("simulated (datasheet)", None),
                           ("simulated (calibrated on the v5e)", calibration.assumptions("v5e"))):
        sim = mk.cost.sim.simulate(DecodePlan.make(
            mk.preset(chip_trace["model"]), chip="v5e", batch=chip_trace["batch"],
            rows=chip_trace["rows"], position=chip_trace["position"], kernel=False),
            assumptions=assumed)
        chip_sim.append(dict(kernel=label, us=round(sim.step_s * 1e6, 1),
                             vs_measured=f"{sim.step_s * 1e9 / kernel.duration_ns - 1:+.1%}",
                             HBM_idle=f"{sum(b.idle_s for b in sim.bubbles) / sim.step_s:.2%}"))
    display(plots.table([dict(kernel=f"measured on {chip_made}", us=round(
        kernel.duration_ns / 1e3, 1), vs_measured="", HBM_idle="(one op: not seen)")] + chip_sim))
    plots.show(sim_plots.timeline(sim, title=f"{chip_trace['model']} on v5e (simulated, "
                                  f"calibrated): {sim.step_s * 1e6:.1f} µs"))

# %% [markdown]
# **Inside the kernel, on the chip.** The capture ran with libtpu's
# `bundles.PHASE_FLAG`, so the megakernel's `jax.named_scope`s (its `prime`, `layers`
# and `lm_head`, and `layer_body`'s phases, shown in code further down) are events of
# the device's trace: the chip's own time for every phase of every layer. Per layer
# (`profiling.layer_times`) beside the simulator's (`Simulation.layer_seconds`, the same
# boundaries: a layer's first phase to the next layer's):

# %%
if chip_trace is not None:
    display(plots.table(profiling.scope_table(mega)))
    chip_layers = [t / 1e3 for t in profiling.layer_times(mega)]
    sim_layers = [t * 1e6 for t in sim.layer_seconds()]
    plots.show(plots.lines(range(len(chip_layers)), {
        f"measured on {chip_made}": chip_layers, "simulated (calibrated)": sim_layers},
        title=f"{chip_trace['model']}: each layer's time in the megakernel",
        xaxis="layer (index)", yaxis="time per layer (µs)"))
    mid = slice(1, None)  # layer 0: the trace counts the ring's first wait in it, mk.cost.sim before it
    print(f"layers 1-{len(chip_layers) - 1}: {sum(chip_layers[mid]) / len(chip_layers[mid]):.1f} "
          f"µs measured, {sum(sim_layers[mid]) / len(sim_layers[mid]):.1f} µs simulated")

# %% [markdown]
# ## Opening the captures in XProf or TensorBoard
#
# The captures are in the standard layout, so XProf's own converter reads them (the trace
# viewer below is what the XProf UI draws).

# %%
trace = profiling.trace_viewer(captures["megakernel"].path)
print(f"XProf trace viewer: {len(trace['traceEvents'])} events in the megakernel capture")
logdir = os.path.relpath(profiling.PROFILES)  # where this notebook runs: no machine path
print(f"open them with:  xprof --logdir {logdir}   (http://localhost:8791), or TensorBoard's "
      "Profile tab (tensorboard --logdir, or %load_ext tensorboard then %tensorboard "
      "--logdir in Jupyter/Colab)")
if "google.colab" in sys.modules:  # Colab ships TensorBoard and its notebook magic
    ipython = get_ipython()  # noqa: F821
    ipython.run_line_magic("load_ext", "tensorboard")
    ipython.run_line_magic("tensorboard", f"--logdir {profiling.PROFILES}")

# %% [markdown]
# ## Inside the megakernel: phases
#
# A profile sees a `pallas_call` as one op. To see its phases on a TPU, wrap each phase in
# `jax.named_scope(...)` inside the kernel (Pallas lowers a scope to Mosaic's
# `trace_start`/`trace_stop`) and compile with libtpu's `bundles.PHASE_FLAG` in
# `LIBTPU_INIT_ARGS`: the scopes become trace
# markers in the kernel's code, and the device trace shows one event per phase. The
# megakernel's scopes, in its code:

# %%
teach.excerpt(megakernel_module.megakernel_kernel, [
    ('with jax.named_scope("prime")', "ring.prime()",
     "`prime`: the ring's first `slots` tiles issued before anything computes."),
    ('with jax.named_scope("layers")', "x = lax.fori_loop",
     "`layers`: the layer loop, compiled once, run L times: its bundles count once."),
    ('with jax.named_scope("lm_head")', 'ring.matmul("lm_head"',
     "`lm_head`: the final norm and the vocab projection, the stream's tail."),
])

# %% [markdown]
# Inside the loop, `layer_body` (05) runs the phases of `LAYER_PHASES` in order, each under
# a `jax.named_scope` of its name, and in each phase every layer kind's part (`mk.kinds`:
# attention, a linear mixer, the dense MLP or the experts). The simulator replays the same
# list with each kind's twin, so the kernel and the model cannot drift apart:

# %%
teach.excerpt(one_layer_module.layer_body, [
    ("for name in LAYER_PHASES:", "_when(on, lambda kind=kind, name=name: kind.run(k, name))",
     "Each phase its own scope: a kind runs its part in its own layers and, in a layer of "
     "another kind, skips its region of the weight stream."),
    ('if name == "attn_all_reduce"', "x = residual(x, s.mlp_out[...])",
     "The layer's own phases: the all-reduces, the residual adds and the MLP's norm."),
])

# %% [markdown]
# **What a TPU trace shows, and what this CPU trace shows.** On a TPU the device plane
# (`/device:TPU:0`) holds one event per kernel launch ("XLA Ops") and, with the flag
# above, one nested event per scope ("XLA TraceMe"): `prime`, then `layers` (and inside
# it, per layer, `prologue`, `attend`, `kv_prime`, `wo`, `mlp_norm`, `mlp`, `residual`),
# then `lm_head`, with their real durations (the v5e's, above); the gaps between launches
# are the chip's idle time. On this CPU there is no device plane: the capture holds
# host threads running XLA:CPU programs, and an interpret-mode `pallas_call` is one such
# program simulating the kernel, so its duration is the simulator's, its phases are
# invisible, and only the launch count and the host's gaps carry over. The v5e's recorded
# trace above is the device side; without a TPU of your own, the compiler's static
# schedule below is the closest view of it.
#
# Without a TPU, the compiler still shows its **static schedule**: compiled for `chip` with
# its dump flags, the kernel is a list of VLIW bundles, each issuing to some units (MXU,
# VALU, VLOAD, ...). Bundle counts are not cycles: a loop's body is listed once and DMA
# latency is unknown. With the markers on, bundles are counted per named scope (the
# innermost scope holding each bundle): the megakernel's `prime`, `layers` and `lm_head`,
# and `layer_body`'s phases inside `layers`.
#
# **Predict** before you run: which layer phase has the most bundles, and is it the one
# that moves the most bytes? <details><summary>Answer</summary>Bundles measure code, not
# time: a phase whose code holds many ring loops (the MLP's three matrices, the prologue's
# three projections, each with a steady and an edge loop) lists more bundles, whatever its
# bytes. Compare the table below with the simulator's share of the step.</details>

# %%
schedule = None
if schedule_dump and mk.chip(run.chip).kind == "tpu" and not run.checkpoint:
    with tempfile.TemporaryDirectory(prefix="mk08-") as dump:  # ~80 MB of listings
        schedule = bundles.read_schedule(bundles.dump_schedule(
            config, run.chip, dump, batch=run.batch, rows=run.rows, context=run.context))
    print(f"mk_megakernel on {run.chip}: {schedule.bundles} bundles ({schedule.empty} empty), "
          f"{schedule.in_loops} inside loops; {schedule.dmas} DMA issues, {schedule.waits} "
          f"DMA waits in the code")
    display(plots.table([dict(unit=u, share_of_issue_slots=f"{v:.1%}")
                         for u, v in schedule.utilisation.items()]))
    busiest = max(schedule.utilisation, key=schedule.utilisation.get)
    print(f"busiest unit per listed bundle: {busiest} "
          f"({schedule.utilisation[busiest]:.1%} of its issue slots)")
    if schedule.phases:  # a bundle counts for the innermost scope holding it
        display(plots.table([dict(phase=k, bundles=n) for k, n in schedule.phases.items()]))
    else:
        print("no bundle lies in a named scope: this kernel names no phases")

# %% [markdown]
# What the static view allows: how big the kernel's code is, how much of it sits inside
# loops (the layer loop is compiled once and runs L times), how many DMA issues and waits
# the ring compiles to, and which units the listed bundles keep busy (in the megakernel the
# scalar unit computes every tile's addresses, slots and predicates), and how the code
# splits between the named phases. It does not give time: loops are listed once and DMA
# latency is unknown. For time, a TPU profile.
#
# ## Exercise: add a scope and find its bundles
#
# A phase gets its own bundles (and, on a TPU, its own trace event) only inside a named
# scope. `scopes.norm_then_matmul` is a small kernel: an RMS norm of x, then x @ w in a
# scope named "matmul"; its norm is in no scope. `scopes.scoped_bundles` compiles it for
# `chip` in a child process with the same dump flags (a patch made here would not reach
# that process, so the kernel goes there as its source) and groups its bundles by scope;
# `scopes.check_scope(found, "norm")` fails on it. **Predict**: will the norm list more or
# fewer bundles than the matmul, and which units will its bundles use? Then **add** the
# scope: the next cell is a copy of the kernel; wrap its two norm lines in
# `with jax.named_scope("norm"):` and find the norm's bundles in the dump.

# %%
scoped = mk.chip(run.chip).kind == "tpu" and schedule_dump
plots.show_source(scopes.norm_then_matmul)
if scoped:
    given = scopes.scoped_bundles(scopes.norm_then_matmul, run.chip)
    print("bundles per scope of the given kernel:", {k: len(v) for k, v in given.items()})
    try:
        scopes.check_scope(given, "norm")
    except course.ExerciseFailed as caught:
        print("the check:", caught)

# %% [markdown]
# Add the scope in the next cell; its check fails until you do. `solutions = True`
# (parameters cell) checks the worked solution instead; `course.reveal("08-scope")`
# explains what the bundles show.

# %%
def my_kernel(x_ref, w_ref, o_ref):
    """scopes.norm_then_matmul, to edit: put its norm in a scope named "norm"."""
    x = x_ref[...]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    with jax.named_scope("matmul"):
        o_ref[...] = jnp.dot(x.astype(w_ref.dtype), w_ref[...],
                             preferred_element_type=jnp.float32)


if scoped:
    found = scopes.scoped_bundles(course.attempt("08-scope", my_kernel, solutions), run.chip)
    counts = {k: scopes.check_scope(found, k) for k in ("norm", "matmul")}
    print(f"bundles per scope: {counts}; the norm's first bundles, their ops:")
    display(plots.table([{"bundle": i, "ops": ", ".join(b.ops) or "(empty)"}
                         for i, b in enumerate(found["norm"][:8])]))

# %% [markdown]
# ## On a TPU runtime
#
# Run this notebook on a Colab TPU: `backend="auto"` picks the hardware, the same
# `capture` records the device plane (`/device:TPU:0`) and `timeline` reads its
# "XLA Ops" line, so the bubbles above become the chip's own: real kernel gaps and real
# pipeline drains. For the kernel's phases too, set `LIBTPU_INIT_ARGS` to
# `bundles.PHASE_FLAG` before jax starts (a fresh runtime; benchmarks/tpu_trace.py does).
#
# ## Takeaway
#
# One kernel per step leaves the host nothing to dispatch in the middle of a step and the
# ring nothing to drain at an edge. On this CPU the measurements show the launch structure
# (and real gaps between XLA:CPU's ops); the simulator shows what the pipeline does on a
# TPU. The numbers of this run:

# %%
shares = {r["variant"]: r["bubble_share"] for r in summary}
print(f"measured on {mode} ({config.name}, B={run.batch}, T={run.rows}): bubble share "
      + ", ".join(f"({'abc'[i]}) {v} {shares[v]:.1%}" for i, v in enumerate(profiling.VARIANTS)))
for p in predictions:
    print(f"predicted by mk.cost.sim for the megakernel: {p['model']} on {p['chip']}, "
          f"S={p['context']}, cross-layer prefetch {'on' if p['cross_layer_prefetch'] else 'off'}:"
          f" HBM idle {p['bubble_share']} of {p['step_us']} µs")

# %% [markdown]
# ## Questions
#
# 1. A CPU capture of the megakernel shows one 40 ms program per step. What does it say
#    about the step on a TPU? <details><summary>Answer</summary>Only that the step is
#    one launch: the 40 ms is the interpreter simulating the kernel; a TPU's time comes
#    from a TPU profile or, as a model, from `mk.cost.sim`.</details>
# 2. The `layers` scope lists N bundles. How many does a 36-layer step execute in it?
#    <details><summary>Answer</summary>Not 36 N: the loop body is listed once and runs 36
#    times, and the ring loops inside it run once per tile, so an executed count needs
#    every trip count. Bundles measure code size, not cycles.</details>
# 3. Why does the staged variant (b) launch 2 + 4 L programs per step?
#    <details><summary>Answer</summary>Per layer: the prologue, attention, the output
#    projection and the MLP; per step: the embedding and the lm_head.</details>

# %% [markdown]
# ## Checks

# %%
launches = {r["variant"]: r["launches_per_step"] for r in summary}
if launches["staged"] != 2 + 4 * config.layers or launches["megakernel"] != 1:
    raise AssertionError(f"launches per step {launches}: expected (b) 2 + 4L = "
                         f"{2 + 4 * config.layers} and (c) 1")
for name, steps_ in per_step.items():
    for s in steps_:
        if not (0 <= s.idle_ns <= s.span_ns <= s.wall_ns and 0 <= s.bubble_share <= 1):
            raise AssertionError(f"{name} step {s.step}: inconsistent bubbles {s}")
if len(per_step["xla"]) != steps or not trace["traceEvents"]:
    raise AssertionError("a capture lost its steps, or XProf could not read it")
if schedule is not None and not schedule.bundles > schedule.in_loops > 0:
    raise AssertionError(f"the static schedule is not what the dumps should give: {schedule}")
if schedule is not None and not {"prime", "layers", "lm_head"} <= set(schedule.phases):
    raise AssertionError(f"the megakernel's named phases are missing: {schedule.phases}")
print("checks passed")
