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
# # 14 · Capstone: make one decode step faster
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/14_capstone.ipynb)
#
# **The task.** Make one megakernel decode step faster on a Colab TPU v5e: qwen3-0.6b at
# B = 1, or qwen3-1.7b at B = 8 (`preset`, `batch`), each sequence reading a KV cache of
# 1024 positions. Your knobs are the ones a kernel author owns: the block
# (`mk.kernels.common.BlockSizes`, given to `DecodePlan.make(block=...)`): the weight
# ring's `slots`, the weight `tile`, the KV tile `kv_tile` and its ring `kv_slots`; and the
# device loop's length `loop_steps` (steps per host dispatch). The MXU feeds
# (`DecodePlan.make(feeds=...)`) are a knob of quantised weights only (notebook 12): these
# bf16 models have no packed group to feed.
#
# **The rules.** Your tokens must be the reference's: greedy decoding with your block
# against `mk.model.reference`, every token exact (on a chip a near-tie, `mk.measure.exactness`, is named
# and allowed; a wrong token fails). Your time must be measured on the chip, against the
# baseline the committed record holds (data/measured/v5e-steps.json: its commit and date
# are printed with it) and against the step's HBM floor, which no step can beat. The
# words for numbers (HBM floor, simulated, calibrated step, measured) are those of
# [notebook 00's ledger](00_decode_is_memory_bound.ipynb).
#
# This notebook answers:
#
# - What did the baseline measure on the chip, and how far is it from the HBM floor?
# - What does the simulator predict for your block, before you spend chip time?
# - With your block, are the tokens still the reference's, and is the step faster,
#   measured?
#
# On a CPU the kernels run in TPU interpret mode: the tokens are checked on a tiny model
# (`check_preset`) with your ring depths, your block is checked against the real model's
# shapes and VMEM, the simulator predicts its step, and nothing is timed: **timing needs a
# TPU**.
#
# **You will** tune one step's block and loop length against a measured baseline.
# **You will be able to** say what your change bought, measured, and what is left above
# the floor. **Prerequisites:** 00 (floors), 01 (Little's law), 06 (the megakernel),
# 11 (a design review), 13 (measuring a TPU).

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
preset: str = "qwen3-0.6b"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 1  # B, sequences decoded together
rows: int = 1  # T, query rows per sequence in one step (1 is plain decode)
context: int = 1024  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v5e"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
slots: int = 0  # weight ring slots; 0 for the baseline's (the block the record timed)
tile: int = 0  # square weight tile side for every weight; 0 for the baseline's tiles
kv_tile: int = 0  # cached positions per KV tile; 0 for the baseline's
kv_slots: int = 0  # KV tiles in flight in the VMEM ring; 0 for the baseline's
loop_steps: int = 32  # greedy steps per device loop (one host dispatch) when timing
repeats: int = 5  # device loops timed on a TPU; the median is kept
check_steps: int = 4  # greedy tokens checked against the reference
check_preset: str = "tiny"  # the model whose tokens are checked in interpret mode (a CPU)

# %% tags=["hide-input"]
import dataclasses

import jax
import numpy as np
from IPython.display import display

import mk
import mk.kernels.backend
import mk.course.run
from mk.cost import calibration, perf, sim
from mk.measure import exactness, measure
from mk.step import megakernel
from mk import plots
from mk.model import reference
from mk.kernels.common import KV_ALIGN, VmemBudget
from mk.step.plan import DecodePlan, capacity

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
if run.rows != 1 or run.checkpoint:
    raise NotImplementedError(f"rows={run.rows}, checkpoint={run.checkpoint!r}: the capstone "
                              "times the record's step, T = 1 on random weights")
for name, value in (("loop_steps", loop_steps), ("repeats", repeats),
                    ("check_steps", check_steps)):
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
mode = mk.kernels.backend.resolve(run.backend)
on_tpu = mode == "hardware"
spec = mk.chip(measure.chip_of(jax.devices()[0].device_kind) if on_tpu else run.chip)
config, where = run.config, f"measured on {spec.name}"
print(f"{config.name}, B={run.batch}, context {run.context}; kernels run on: {mode}; chip: "
      f"{spec.name}" + ("" if spec.name == run.chip else f" (not chip={run.chip!r})"))

# %% [markdown]
# ## Your block
#
# The baseline block is the one the record was timed with: `mk.measure.measure.step_plan`'s
# plan, the default tiling of `DecodePlan.make` with no chip given. Yours is
# that block with each knob you set; `DecodePlan.make` refuses a block that does not cut
# the model's matrices or its cache (naming the field), and its buffers must fit the
# chip's VMEM (`VmemBudget`), before anything is traced.

# %%
baseline = measure.step_plan(config, batch=run.batch, context=run.context).block
block = dataclasses.replace(
    baseline, slots=slots or baseline.slots, kv_tile=kv_tile or baseline.kv_tile,
    kv_slots=kv_slots or baseline.kv_slots,
    **(dict(tile_rows=tile, tile_cols=tile, tiles=()) if tile else {}))
plan = measure.step_plan(config, batch=run.batch, context=run.context,
                         loop_steps=loop_steps, block=block)  # your loop's plan
budget = VmemBudget("megakernel", tuple(plan.buffers.values()), spec.name,
                    spec.vmem_bytes).check()
display(plots.table([{"block": name, **dataclasses.asdict(b)}
                     for name, b in (("baseline", baseline), ("yours", block))]))
print(f"your plan: {plan.stream.total} weight tiles a step, VMEM "
      f"{budget.total_bytes / 2**20:.1f} of {budget.limit_bytes / 2**20:.0f} MiB")

# %% [markdown]
# ## The baseline and the floor
#
# The record's row for this step (`mk.cost.calibration.load_steps`, with its commit and date:
# `mk.cost.calibration.provenance`), its device-loop step, and the HBM floor of the step
# (`mk.cost.perf.predict`: its bytes over the chip's HBM bandwidth). The floor's share of the
# step is how close to the bytes' own time the kernel runs.

# %%
floor_ms = perf.predict(config, spec, batch=run.batch, rows=1,
                        context=run.context).hbm_floor_ms
path = calibration.steps_path(spec.name)
record = calibration.load_steps(path, spec.name) if path.exists() else {"rows": []}
row = next((r for r in record["rows"] if (r["model"], r["batch"], r["rows"], r["context"],
            r.get("layers")) == (config.name, run.batch, 1, run.context, None)
            and r.get(calibration.LOOP)), None)
base_ms = row and row[calibration.LOOP] * 1e3
made = row and calibration.provenance(record, row)
print(f"HBM floor: {floor_ms:.3f} ms a step on {spec.name}")
if row:
    print(f"baseline: {base_ms:.3f} ms a step, {where} at {made['commit'][:7]}, "
          f"{made['when'][:10]} ({path.name}); the floor is {floor_ms / base_ms:.0%} of it")
else:
    print(f"no recorded baseline of this step at {path}: the records live in data/measured"
          " of a checkout of mk (on Colab, copy the repository's file there); the default "
          "block is measured below instead")

# %% [markdown]
# ## Predicted: the simulator
#
# Iterate here before spending chip time. The simulated step replays your plan's tile
# schedule on a model of the chip (`mk.cost.sim.simulate`, its default latencies); the
# calibrated step does the same with the chip's measured inputs
# (`mk.cost.calibration.assumptions`, where the chip has records: the DMA probe and the
# attention loop's KV rate; `mk.cost.ledger.basis_table()` says how close it came to each
# recorded device loop). Both are simulations, not measurements. The last line gives the
# ring slots Little's law asks for at the chip's measured DMA latency
# (`mk.cost.sim.latency_slots`, notebook 01): the depth that covers one latency, where to
# start looking, not the answer.

# %%
measured_inputs = calibration.steps_path(spec.name).exists()
calibrated = calibration.assumptions(spec.name) if measured_inputs else None
predicted = {}
for name, b in (("baseline", baseline), ("yours", block)):
    step_plan = DecodePlan.make(config, chip=spec, batch=run.batch, position=run.context,
                                block=b, kernel=False)
    s = sim.simulate(step_plan)
    c = calibrated and sim.simulate(step_plan, assumptions=calibrated)
    predicted[name] = (s.step_s * 1e3, c and c.step_s * 1e3)
display(plots.table([{
    "block": name, "simulated step ms": f"{s_ms:.3f}",
    f"calibrated step ms ({spec.name}'s measured inputs)": f"{c_ms:.3f}" if c_ms else "-",
    "HBM floor ms": f"{floor_ms:.3f}"} for name, (s_ms, c_ms) in predicted.items()]))
if row and calibrated:
    print(f"the baseline's calibrated step is {predicted['baseline'][1] / base_ms - 1:+.1%} "
          f"off its measured step; Little's law asks for "
          f"{sim.latency_slots(config, spec, block, assumptions=calibrated)} ring slots of "
          f"your tiles at {calibrated.dma_latency_s * 1e6:.2f} µs")

# %% [markdown]
# ## Tokens exact
#
# Greedy decoding with your block against `mk.model.reference.generate`, from a prompt that ends
# just before a KV tile's edge so the checked steps cross it. On a TPU this is the model
# itself with your whole block; in interpret mode (a CPU) it is `check_preset` with its
# own tiles and your ring depths (`slots`, `kv_slots`): the real model's tiles are
# checked above only for their shapes and VMEM.

# %%
if on_tpu:
    checked, checked_block, S = plan.config, block, plan.context  # the cache of the timed loop
else:
    checked, S = mk.preset(check_preset), capacity(KV_ALIGN + check_steps)  # two KV tiles
    own = DecodePlan.make(checked, batch=run.batch, context=S).block
    checked_block = dataclasses.replace(own, slots=block.slots, kv_slots=block.kv_slots,
                                        kv_tile=KV_ALIGN)
prompt_len = max(1, min(checked_block.kv_tile, S - check_steps) - check_steps // 2)
if prompt_len + check_steps > S:
    raise ValueError(f"check_steps={check_steps} from a {prompt_len}-token prompt overrun "
                     f"the cache of {S} positions")
params = mk.init_params(checked, run.seed)
prompt = jax.random.randint(jax.random.key(run.seed), (run.batch, prompt_len), 0,
                            checked.vocab)
want = np.asarray(reference.generate(checked, params, prompt, check_steps, max_context=S))
got = np.asarray(megakernel.generate(checked, params, prompt, check_steps, backend=run.backend,
                                     block=checked_block, max_context=S))
equal = bool(np.array_equal(got, want))
verdict = None if equal else exactness.judge(checked, params, prompt, got)
print(f"{checked.name}, {check_steps} greedy steps from position {prompt_len} ({mode}): "
      + ("every token equals the reference's" if equal else str(verdict)))
del params  # the chip's memory goes to the timed step

# %% [markdown]
# ## Measured: your step on the chip
#
# On a TPU: the default block's device loop by `mk.measure.measure.time_step_series` (what the
# record holds, measured again on this chip now), and your block's the same way (a device
# loop of `loop_steps` greedy steps, the median of `repeats` loops, over its steps). In
# interpret mode the CPU's time says nothing about a TPU, so nothing is timed.

# %%
measured = {}
if on_tpu:
    measured["default block, now"] = measure.time_step_series(
        config, batch=run.batch, context=run.context, series=("megakernel_loop",),
        loop_steps=loop_steps, repeats=repeats, seed=run.seed,
        backend=run.backend)["megakernel_loop"] * 1e3
    measured["your block, now"] = measure.time_step_series(
        config, batch=run.batch, context=run.context, series=("megakernel_loop",),
        loop_steps=loop_steps, repeats=repeats, seed=run.seed, backend=run.backend,
        block=block)["megakernel_loop"] * 1e3
    steps = ([(f"baseline, recorded at {made['commit'][:7]}, {made['when'][:10]}", base_ms)]
             if row else []) + list(measured.items())
    display(plots.table([{"step": name, f"ms a step ({where})": f"{ms:.3f}",
                          "HBM floor ms": f"{floor_ms:.3f}",
                          "share of HBM floor": f"{floor_ms / ms:.0%}"} for name, ms in steps]))
    ref_ms = base_ms or measured["default block, now"]
    print(f"your step: {measured['your block, now']:.3f} ms, {where}, "
          f"{ref_ms / measured['your block, now']:.3f}x the baseline's speed")
else:
    print(f"timing needs a TPU: the kernels ran in {mode} mode on a CPU, whose time says "
          "nothing about a TPU. Open this notebook in Colab on a TPU v5e runtime.")

# %% [markdown]
# ## Takeaway
#
# A decode step's time is bounded below by its bytes: the HBM floor. The baseline's gap to
# it is the ring and the attention loop not keeping HBM busy; the knobs that move it
# change how many bytes are in flight (ring slots against the DMA latency, Little's law)
# and how much the host's dispatch weighs (loop length), never what the step computes,
# so the tokens stay the reference's. The simulator ranks blocks on a CPU; only the chip
# says what a block bought. This run:

# %%
yours_s, yours_c = predicted["yours"]
print(f"{config.name} B={run.batch}: HBM floor {floor_ms:.3f} ms; your block simulated "
      f"{yours_s:.3f} ms" + (f", calibrated {yours_c:.3f} ms" if yours_c else "")
      + (f"; measured on {spec.name} {measured['your block, now']:.3f} ms" if measured
         else "; not measured (no TPU)"))

# %% [markdown]
# ## Checks

# %%
assert equal or (on_tpu and verdict.ok), f"tokens are not the reference's: {verdict}"
assert all(s_ms >= floor_ms * (1 - 1e-6) for s_ms, _ in predicted.values()), "under the floor"
assert on_tpu == bool(measured), "timed without a TPU, or a TPU left untimed"
assert all(ms > 0 for ms in measured.values())
print("checks passed")
