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
# # 11b · Design review, the appendix: derivations, tables and sweeps
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/11b_design_review_appendix.ipynb)
#
# The review of notebook 11 (`11_design_review`) gives a verdict on one configuration;
# this appendix holds what a reviewer opens to check a line of it, for the same parameters:
#
# - How far is the course's kernel from the release's published runs, and how does that
#   move with the latency of a collective?
# - How many bytes and FLOPs does one step move, and what are its HBM floor, MXU floor,
#   tile floor and modelled step (the words of
#   [notebook 00's ledger](00_decode_is_memory_bound.ipynb))?
# - What does one weight tile cost to issue, by storage, for every recorded model and chip?
# - What does each design choice (ring depth, tile size, KV tile, batch, T, DMA latency)
#   buy, and what does one megakernel buy over XLA's own step of many fusions?
# - What are tokens/s per user against acceptance length, and how far is each published
#   number from each model?
#
# **Prerequisites:** notebook 11. **Nothing here runs on a TPU**: every time is modelled
# (`mk.cost.perf`) or simulated (`mk.cost.sim`) with the simulator's assumed inputs, which
# were too fast on the one chip measured (notebook 11's verdict prints by how much); the
# tile costs are libtpu's compiled bundles at the chip's bundle rate, a range shown at
# both ends, measured on the chip, derived or assumed as its row of `mk/data/chips.csv`
# says (docs/design/mk.model.chips.md, "The bundle rate, not a clock").

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
solutions: bool = False  # True checks the worked solution in place of yours (headless runs)
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
tp: int = 1  # tensor-parallel devices; the kernel reviewed is the shard of one device
dense_format: str = ""  # attention/MLP storage: int8, fp8, int4, fp4, none; "" keeps the preset's
expert_format: str = ""  # the experts' storage, the same names; "" keeps the preset's
slots: int = 0  # weight ring slots; 0 for the plan's ring for the chip (Little's law)
tile: int = 0  # square weight tile side for every weight; 0 for the plan's tiles
kv_tile: int = 0  # cached positions per KV tile; 0 for min(256, context)
kv_slots: int = 0  # KV tiles in the VMEM ring; 0 for the plan's (`kv_depth`)
simulate_published: bool = False  # simulate the published TPU runs too (some seconds)
xla_layers: int = 0  # layers of XLA's own step to compile and count; 0 for all of them
recorded_tile_costs: str = "tile_costs/single_core.json"  # benchmarks/tile_costs.py's, mk/data
published_tile_costs: str = "tile_costs/published.json"  # its --published run
collective_latencies_us: list[float] = []  # µs per collective message round; [] for the ledger's grid
before_commit: str = "fb8e92e"  # the recorded runs <name>_before_<commit>.json beside them

# %% tags=["hide-input"]
import json
from pathlib import Path

import mk
import mk.course.run
from IPython.display import display
from mk.cost import draft, feed_costs, ledger, perf, sim
from mk.course import course, review, reviewed
from mk import plots, sim_plots
from mk.measure import xla_step
from mk.model.chips import RATE_ENDS, spec_of
from mk.kernels import collectives
from mk.kernels.collectives import round_s
from mk.cost.published import published

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
this = reviewed.configure(run, tp=tp, dense_format=dense_format, expert_format=expert_format,
                          slots=slots, tile=tile, kv_tile=kv_tile, kv_slots=kv_slots)
config, spec, formats, block, plan = (
    this.config, this.spec, this.formats, this.block, this.plan)
position, step_args, step_plan = this.position, this.step_args, this.step_plan
if not 0 <= xla_layers <= config.layers:
    raise ValueError(f"xla_layers={xla_layers} must be in [0, layers={config.layers}]")
# The numbers of notebook 11's verdict that the sections below derive
est = perf.predict(config, spec, **step_args)
floor_args = {k: v for k, v in step_args.items() if k != "formats"}
mxu_ms = perf.mxu_floor_ms(config, spec, **floor_args)  # a labelled bound
tile_ms = {end: perf.tile_floor_ms(config, spec, formats=formats, rate_end=end,
                                   **{k: v for k, v in floor_args.items() if k != "context"})
           for end in RATE_ENDS}  # the compute floor: the tile cost table
modelled_ms = perf.modelled_step_ms(config, spec, formats=formats, **floor_args)
s = sim.simulate(step_plan())
need = sim.latency_slots(config, spec, block, formats=formats)
xla = xla_step.compile_step(config.first_layers(xla_layers) if xla_layers else config, spec,
                            batch=run.batch, rows=run.rows, context=run.context)

# %% [markdown]
# ## The course's kernel against the release
#
# The headline, from `mk.cost.ledger` (the published row, and the same run's kernel as this
# course compiles it, replayed by the simulator; "compiled-kernel step" and the other
# words are defined once in [notebook 00's ledger](00_decode_is_memory_bound.ipynb)):

# %%
published_costs_path = Path(mk.__file__).parent / "data" / published_tile_costs
published_costs = (json.loads(published_costs_path.read_text())
                   if published_costs_path.exists() else [])
headline_rows = ledger.entries(batches=(1,), simulate_tpu=True,  # the speculative runs, B=1
                               tile_costs=published_costs)
print(ledger.headline(headline_rows))

# %% [markdown]
# Those steps are the verification alone. The release's published step at tau 6 is two
# kernels, one after the other: its verify megakernel (T = 8 rows) and then its fused
# DSpark draft kernel, which reads the verify's logits and the hidden states tapped at five
# of its layers, projects them through an fc, runs 5 small layers over the 8 rows of the
# next block in one pass, its 163,840-column lm_head and a Markov bias token by token
# (`mk.cost.draft`, the release's code cited in docs/design/mk.cost.draft.md). The draft
# step simulated on the same machine (the tile cost table at each end of the bundle rate,
# the verify's collective model at TP32), beside each simulated verify step, their sum and
# the published step (all simulated but the last):

# %%
drafts = draft.draft_ends(draft.DSPARK, "tpu7x")
with_drafts = [x for r in headline_rows if r["preset"] == draft.DSPARK.target
               and r["system"] == "tpu7x" and r["tau"] and "simulated_ms" in r
               for x in draft.with_draft(r, drafts)]
display(plots.table([{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in x.items()}
                     for x in with_drafts]))
for end, d in drafts.items():
    print(f"draft step (simulated), {end} end of the bundle rate: {d.step_ms:.3f} ms, "
          f"{d.dma_bytes / 2**20:.0f} MiB a rank, HBM busy {d.hbm_utilisation:.0%}, "
          f"the largest bubble: {next(iter(d.bubble_share()), '-')}")

# %% [markdown]
# Every collective in that step pays the latency of its message rounds (two for each
# all-reduce with the kernel's "two_phase" algorithm at TP8 and TP32, [notebook
# 10](10_tensor_parallel.ipynb)). The release measured it on TPU7x: about 3.5-4.7 µs a round
# at B = 1, its collectives latency-bound; the simulator takes the middle, 4.1 µs
# (`mk.kernels.collectives.round_s`), and moves their bytes at the 134 GB/s it measured over
# a core's three links, not the datasheet's ICI. The release's headline runs (the speculative ones, and Kimi K3 at B=1 with
# its published 4.02 ms step) over a grid of it, each simulated again (the collectives
# block the compute lane, so the ring's timeline moves with them):

# %%
default_round_us = round_s(spec_of("tpu7x")) * 1e6  # the headline's: the chip's round
grid = {us: headline_rows if us == default_round_us else ledger.entries(
    batches=(1,), simulate_tpu=True, tile_costs=published_costs,
    assumptions=sim.Assumptions(ici_latency_s=us * 1e-6))
    for us in collective_latencies_us or ledger.COLLECTIVE_LATENCIES_US}
display(plots.table([{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in r.items()}
                     for r in ledger.latency_grid(grid)]))

# %% [markdown]
# What explains the gap, as far as the ledger can say: its Kimi K3 rows run the release's
# own config (`kimi-k3`: gated MLA, bounded KDA, the latent MoE, SiTU, attention
# residuals) through mk's kernel at TP32. Its FP4 experts stream packed in tiles of their
# own (3584 x 128: a device's 96 columns of an expert's gate, of its up, each padded to
# 128 lanes, not joined since two of them overfill a lane tile; down's 96 rows padded
# alike), 4/3 of their bytes, and the other weights in tiles of at most twice those
# bytes; at either end of TPU7x's bundle rate an FP4 tile's loop issues for several times
# its DMA (the recorded rows below). Each
# latent-MoE layer adds an all-gather of the latent and an all-reduce of its sum to the
# router's gather and the layer's two all-reduces. The release splits its experts
# otherwise: its router gives each expert to a group of ranks (`local_expert_count`,
# `expert_tensor_parallel` in its kimi/decode_megakernel.py), where mk splits every
# expert's columns over all 32. The release beating the modelled step says at least one of
# the model's assumptions (the tile costs of mk's own loop, every collective on the
# critical path) does not hold for it.

# %% [markdown]
# How much of that gap is the bundle rate: TPU7x's is not measured but derived from the
# release's own MXU push rate (20 ns a 256 x 256 bf16 tile, over the 18.1-18.6 bundles
# mk's compiled feed spends on one: docs/design/mk.model.chips.md). Before issue 61 mk
# took a TensorCore clock range instead, 1.03-4.40 GHz on TPU7x, and this appendix at
# commit 24b1e92 simulated the compiled kernel's tau = 6 step in 7.67 ms at the range's
# 4.40 GHz end with a 1 µs collective round (9.97 ms at the 4.1 µs one), under the
# release's 8.46 ms. The probe's own straight-line matmul would run at 4.3x the bf16 peak
# at that clock, so no loop runs at that rate. At the derived rate, the cell below says
# whether any simulated step of the release's Kimi K3 verification runs (T = 8) still
# reaches the published one, over every collective round simulated above (simulated
# steps, not measurements; the fast end is the most the release's figures allow).

# %%
tpu7x = spec_of("tpu7x")
by_round = {default_round_us: headline_rows} | grid
kimi_steps = [(r[key], key, us, r) for us, rs in sorted(by_round.items()) for r in rs
              if r["preset"] == "kimi-k3" and r["system"] == "tpu7x" and r["tau"]
              for key in ("simulated_ms", *(f"compiled_{end}_ms" for end in RATE_ENDS))
              if key in r]
said = {"simulated_ms": "the plan's ring, slow end",
        **{f"compiled_{end}_ms": f"compiled-kernel step, {end} end" for end in RATE_ENDS}}
reached = [(ms, key, us, r) for ms, key, us, r in kimi_steps if ms <= r["published_step_ms"]]
if kimi_steps:
    ms, key, us, r = min(kimi_steps, key=lambda x: x[0] / x[3]["published_step_ms"])
    m = r["batch"] * r["rows"]
    print(f"TPU7x's bundle rate ({tpu7x.bundle_rate_source}): "
          + " to ".join(f"{tpu7x.bundle_rate(end, m) / 1e9:.2f}" for end in RATE_ENDS)
          + f" G bundles/s at M = {m}. Over collective rounds of "
          + ", ".join(f"{u:g}" for u in sorted(by_round)) + " µs, "
          + ("no simulated step of the Kimi K3 verification runs reaches the release's"
             if not reached else "simulated steps reaching the release's: " + "; ".join(
                 f"{x[3]['run']} {x[0]:.2f} ms ({said[x[1]]}, {x[2]:g} µs)" for x in reached))
          + f"; the closest: {r['run']}, {ms:.2f} ms ({said[key]}, a {us:g} µs round) "
            f"against its published {r['published_step_ms']:.2f} ms, "
            f"{ms / r['published_step_ms']:.2f}x it")

# %% [markdown]
# ## Bytes and FLOPs of one step
#
# `mk.cost.perf.predict`: every weight read once (the experts the batch touches under uniform
# routing), the KV cache read, plus the all-reduces of tensor parallelism; the MXU
# floor charges every weight pass the MXU's rows (`mk.cost.perf.mxu_floor_ms`, notebook 00b), a
# bound kept for reference; the tile floor is the weights at the tile cost table
# (`mk.cost.perf.tile_floor_ms`), the compute lane of the modelled step (at the slow end
# of the bundle rate).
# HBM floor, MXU floor, modelled and simulated step are the words of
# [notebook 00's ledger](00_decode_is_memory_bound.ipynb).

# %%
display(plots.table([
    {"term": "weights read (all devices)", "value": f"{est.weight_bytes / 1e9:.4g} GB"},
    {"term": "KV read + written", "value": f"{est.kv_bytes / 1e9:.4g} GB"},
    {"term": "FLOPs", "value": f"{est.flops / 1e9:.4g} GFLOP"},
    {"term": "HBM floor", "value": f"{est.hbm_floor_ms:.4g} ms"},
    *({"term": f"tile floor, {end} bundle rate", "value": f"{tile_ms[end]:.4g} ms"}
      for end in RATE_ENDS),
    {"term": "MXU floor (a bound)", "value": f"{mxu_ms:.4g} ms (FLOPs alone: "
                                             f"{est.compute_floor_ms:.3g} ms)"},
    {"term": "collectives", "value": f"{est.collective_ms:.4g} ms"},
    {"term": "modelled step", "value": f"{modelled_ms:.4g} ms"}]))

# %% [markdown]
# ## The tile cost table: one weight tile by storage, feed and M
#
# Without a compile of the whole kernel the simulator charges each weight tile from a
# table measured the same way on the stage-01 ring kernel (`mk.cost.feed_costs`, recorded by
# `benchmarks/tile_feed_costs.py`: one trip of `Ring.matmul`'s steady loop over one weight
# per chip, storage, feed and M, compiled by libtpu): bundles per weight x the tile's
# weights / the chip's bundle rate at M. A packed tile is smaller on the wire but pays
# its dequantisation here. Below, each storage this plan streams, at this step's M,
# against its tile's DMA at both ends of the bundle rate (simulation inputs, not TPU
# measurements). The feed
# floor columns (not the MXU floor of the step, below: that is FLOPs at the datasheet
# peak): the same ratio for the MXU alone taking the weights in its feed's dtype, one
# straight-line matmul with nothing else to do (`mk.cost.feed_costs.feed_floor_over_dma`). No
# loop, however lean, is expected under it: a feed floor over 0.9 says this storage cannot
# stream at HBM rate on this chip at that end of the rate; a tile ratio over a feed floor
# under 0.9 says the loop can still get leaner.

# %%
rows_, cols_ = plan.block.tile_rows, plan.block.tile_cols


def table_row(dtype: str) -> dict:
    """One storage's tile at this step's M: the table's cost against the tile's DMA."""
    nbytes = (mk.model.quant.tile_bytes(dtype, rows_, cols_) if dtype in mk.model.quant.SCHEMES
              else rows_ * cols_ * mk.model.config.DTYPE_BITS[config.dtype] // 8)
    dma = nbytes / spec.device_hbm_bw * 1e9
    feed = {formats[g]: f for g, f in plan.feeds}.get(dtype, "bf16")  # the plan's feed
    ns = {e: feed_costs.tile_s(spec, dtype, plan.M, rows_ * cols_, e, feed) * 1e9
          for e in RATE_ENDS}
    per_mi = feed_costs.bundles_per_element(spec.name, dtype, plan.M, feed) * 2**20
    return {"storage": dtype, "feed": feed, "M bucket": feed_costs.bucket(plan.M),
            "bundles per Mi weights": f"{per_mi:.0f}", "DMA ns": f"{dma:.0f}",
            **{f"ns per tile, {e} rate": f"{ns[e]:.0f}" for e in RATE_ENDS},
            **{f"tile / DMA, {e} rate": f"{ns[e] / dma:.2f}" for e in RATE_ENDS},
            **{f"feed floor / DMA, {e} rate":
               f"{feed_costs.feed_floor_over_dma(spec, dtype, plan.M, e, feed)[1]:.2f}"
               for e in RATE_ENDS}}


display(plots.table([table_row(d) for d in sorted(
    {feed_costs.weight_dtype(config.dtype, q) for q in [None, *formats.values()]})]))

# %% [markdown]
# The same measurement for every single-core preset and chip, and for the tensor-parallel
# shard of every published TPU run (one device's kernel, compiled on the run's multi-chip
# topology), recorded by `benchmarks/tile_costs.py` (the plan's ring for the chip: Little's
# law at `ring_cover_s`, `RING_COVER_S` = 2 us and at tp > 1 one all-reduce more, fewer
# slots where VMEM is short; simulated at a 1 us DMA latency; single-core rows B=1, T=1,
# S=1024; published runs at the ledger's batch, rows and each row's context; compile
# seconds on the 2-core machine that recorded it, shared with other jobs). A ratio above 0.9 is a kernel whose TensorCore, not HBM, sets
# the pace of weight streaming. The issue time and its ratio are the recorded bundles at
# each end of today's bundle rate, for the plain tiles and, where the stream has them, for
# each other storage's tiles against their own DMA: a packed scheme's (smaller), or tiles
# of a shape of their own (qwen3-30b-a3b's experts, 2048 x 768 beside 2048 x 512:
# `BlockSizes.tiles`). The HBM busy share was simulated when the row was recorded, at the
# slow end of today's bundle rate.

# %%
data = Path(mk.__file__).parent / "data"  # recorded runs ship in the package


def issue_ns(row, end):
    """A recorded row's issue time per tile at `end` of its chip's bundle rate today, for
    the row's M = B x T activation rows."""
    m = row.get("batch", 1) * row.get("rows", 1)
    return ledger.tile_bundles(row) / spec_of(row["chip"]).bundle_rate(end, m) * 1e9



recorded_path, published_path = data / recorded_tile_costs, data / published_tile_costs
published_costs = (json.loads(published_path.read_text()) if published_path.exists()
                   else [])
if recorded_path.exists():
    display(plots.table([
        {"model": r["preset"], "chip": r["chip"], "TP": r.get("tp", 1),
         "B x T": f"{r.get('batch', 1)} x {r.get('rows', 1)}", "slots": r["slots"],
         "ring KiB": f"{r['ring_KiB']:.0f}", "VMEM MiB": f"{r['vmem_MiB']:.1f}",
         **({"bundles/tile": r["bundles_per_tile"],
             **{f"issue ns, {end} rate": f"{issue_ns(r, end):.0f}" for end in RATE_ENDS},
             "DMA ns": f"{r['dma_ns']:.0f}",
             **{f"issue/DMA, {end} rate": f"{issue_ns(r, end) / r['dma_ns']:.2f}"
                for end in RATE_ENDS},
             "other tiles' issue/DMA, slow / fast rate": "; ".join(
                 f"{q}: {p['tile_over_dma']:.1f} / {p['tile_over_dma_fast']:.1f}"
                 for q, p in r.get("packed", {}).items()),
             "HBM busy, slow rate": f"{r['hbm_busy']:.1%}",
             "compile s": f"{r['compile_s']:.1f}"}
            if "tile_ns" in r else dict.fromkeys(
                ["bundles/tile"] + [f"issue ns, {end} rate" for end in RATE_ENDS]
                + ["DMA ns"] + [f"issue/DMA, {end} rate" for end in RATE_ENDS]
                + ["other tiles' issue/DMA, slow / fast rate", "HBM busy, slow rate",
                   "compile s"], "")),
         "note": "" if r["fits"] else r["error"][:80] + (
             f"; measured on {r['measured_on']}" if "measured_on" in r else "")}
        for r in json.loads(recorded_path.read_text()) + published_costs]))
else:
    print(f"{recorded_path} is not here; benchmarks/tile_costs.py makes it")

# %% [markdown]
# Before and after the weights were laid out in stream order (issue 14): the same runs of
# the kernel at commit `before_commit`, whose one square tile had to divide both sides of
# every matrix (128 x 128, 32 KiB, on a tensor-parallel shard), against this checkout's,
# whose tile cuts each matrix plain or transposed (up to 2 MiB) and whose ring the plan
# sizes for the chip.

# %%
def recorded(path):
    return {(r["preset"], r["chip"], r.get("tp", 1), r.get("batch", 1), r.get("rows", 1)): r
            for r in (json.loads(path.read_text()) if path.exists() else [])}


after = recorded(recorded_path) | recorded(published_path)
before = {k: v for path in (recorded_path, published_path)
          for k, v in recorded(path.with_name(f"{path.stem}_before_{before_commit}.json"))
          .items()}


def then_now(key, field, form):
    old, new = before[key].get(field), after[key].get(field)
    return " -> ".join("-" if v is None else format(v, form) for v in (old, new))


display(plots.table([
    {"model": k[0], "chip": k[1], "TP": k[2], "B x T": f"{k[3]} x {k[4]}",
     "tile KiB": then_now(k, "tile_KiB", ".0f"), "slots": then_now(k, "slots", "d"),
     "bundles/tile": f"{before[k].get('bundles_per_tile', '-')} -> "
                     f"{after[k].get('bundles_per_tile', '-')}",
     "issue/DMA (as recorded)": then_now(k, "tile_over_dma", ".2f"),
     "HBM busy (as recorded)": then_now(k, "hbm_busy", ".1%"),
     "VMEM MiB": then_now(k, "vmem_MiB", ".1f"),
     "ring KiB": then_now(k, "ring_KiB", ".0f"), "compile s": then_now(k, "compile_s", ".1f")}
    for k in after if k in before]))

# %% [markdown]
# On a tensor-parallel shard the bar is the step against max(HBM floor, the compute lane's
# busy time), the lane's tiles, vector work and collectives (`Simulation.compute_s`): within
# 10 %, weight streaming does not wait on the all-reduces (each collective costs
# `mk.kernels.collectives.allreduce_s`: 1 us per message round, a model, not a measurement).
# These steps were simulated when the rows were recorded, at the slow end of today's
# bundle rate; the cell after the published runs below names the shards whose issue time per
# tile exceeds 0.9 x its DMA.

# %%
display(plots.table([
    {"model": r["preset"], "TP": r["tp"], "B x T": f"{r['batch']} x {r['rows']}",
     "simulated step ms, slow rate": f"{r['sim_step_ms']:.3f}",
     "HBM floor ms": f"{r['hbm_floor_ms']:.3f}",
     "compute lane ms, slow rate": f"{r['compute_ms']:.3f}",
     "over max(floor, lane)":
         f"{r['sim_step_ms'] / max(r['hbm_floor_ms'], r['compute_ms']) - 1:+.1%}",
     "bound": "compute lane" if r["compute_ms"] > r["hbm_floor_ms"] else "HBM"}
    for r in published_costs if "compute_ms" in r]))

# %% [markdown]
# ## Design sweeps
#
# Each row is one simulated step with one parameter changed. The ring depth that hides a
# DMA descriptor's latency follows Little's law: bandwidth x latency bytes in flight
# (`mk.cost.sim.latency_slots`); the plan's ring for a chip covers twice the latency
# (`RING_COVER_S`), and on a tensor-parallel shard one all-reduce more, so weight tiles
# keep streaming through the collective, but never more than a layer's period of tiles.
# Past that depth a deeper ring buys nothing and can cost a little, and past a layer's
# period a lot: the model has one first-in-first-out DMA engine, so every small DMA a
# layer issues queues behind every weight tile already in flight, and a ring deeper than
# a layer puts the next layer's tiles before this layer's KV tiles. That is why the kernel
# waits for no DMA it has just issued: each full layer's first KV tiles are issued a layer
# early, right after the previous full layer's attention; a linear layer's small weights,
# conv state and first state by the linear layer before it; and write-backs (KV rows,
# linear row states) are waited for a layer later, when their buffer comes round again.

# %% tags=["hide-input"]
common = dict(formats=formats, tp=tp, context=position)
sweeps = {
    "slots": review.sweep(config, spec, "slots", sorted({1, 2, 3, 4, 8, need, 2 * need}),
                          batch=run.batch, rows=run.rows, block=block, **common),
    "tile": review.sweep(config, spec, "tile", [128, 256, 512], batch=run.batch,
                         rows=run.rows, block=block, **common),
    "kv_tile": review.sweep(config, spec, "kv_tile", [k for k in (64, 128, 256, 512)
                                                      if run.context % k == 0],
                            batch=run.batch, rows=run.rows, block=block, **common),
    "batch": review.sweep(config, spec, "batch", [1, 2, 4, 8], rows=run.rows, block=block,
                          **common),
    "rows": review.sweep(config, spec, "rows", [1, 2, 4, 8], batch=run.batch, block=block,
                         **common),
    "dma_latency_s": review.sweep(config, spec, "dma_latency_s",
                                  [0.0, 0.25e-6, 0.5e-6, 1e-6], batch=run.batch,
                                  rows=run.rows, block=block, **common),
}
for name, rows_ in sweeps.items():
    display(plots.table([{name: r[name], "step ms": f"{r['step_ms']:.4g}" if r["step_ms"]
                          else "-", "HBM busy": f"{r['hbm_utilisation']:.1%}"
                          if r["hbm_utilisation"] else "-",
                          "largest bubble": r["largest_bubble"] or r["note"][:60]}
                         for r in rows_]))
plots.show(sim_plots.sweep_lines(sweeps["slots"], "slots", y="hbm_utilisation",
                             title=f"HBM busy share against ring slots (Little's law: {need})"))

# %% [markdown]
# ## What the megakernel buys on a TPU
#
# The alternative on a TPU is not a GPU's launch per op: it is XLA's own step, one compiled
# program that runs its fusions one after another. Each fusion is a kernel of its own: its
# weight stream starts when it starts (unless XLA scheduled an async copy ahead of it), and
# its result goes to HBM unless XLA keeps it in VMEM. Here is that program for this model on
# this chip (`mk.measure.xla_step`, libtpu's ahead-of-time compile of `mk.model.reference.forward`; the
# first `xla_layers` layers when set), counted from its HLO:

# %%
display(plots.table([
    {"": "layers compiled", "XLA step": xla.layers, "megakernel": xla.layers},
    {"": "kernels run in order", "XLA step": xla.fusions, "megakernel": 1},
    {"": "async copies XLA scheduled ahead", "XLA step": xla.async_copies,
     "megakernel": "every tile, slots ahead"},
    {"": "bytes the kernels read + write", "XLA step": f"{xla.fusion_bytes / 1e6:,.1f} MB",
     "megakernel": "weights and KV once"},
    {"": "results written to HBM", "XLA step": f"{xla.fusion_hbm_write_bytes / 1e6:,.3f} MB",
     "megakernel": "new KV rows, logits"}]))
boundary_us = (xla.fusions - 1) * s.assumptions.dma_latency_s * 1e6
print(f"{xla.fusions / xla.layers:.1f} fusions per layer compiled (embedding and lm_head "
      f"included). If each fusion boundary costs one DMA descriptor latency with HBM idle "
      f"({s.assumptions.dma_latency_s * 1e6:g} µs, the simulator's assumption), the boundaries alone cost {boundary_us:,.1f} µs against a "
      f"simulated megakernel step of {s.step_ms * 1e3 * xla.layers / config.layers:,.1f} µs "
      f"for the same {xla.layers} layers")

# %% [markdown]
# The counts are facts of the compiled program; the time per boundary is an assumption (no
# TPU has measured it here). The H100 launch gap of `mk.cost.perf.KERNEL_GAP_S` is not used on a
# TPU: XLA:TPU launches one program, not a kernel per op. What one kernel buys is the
# stream that never stops at an op boundary, plus activations that stay in VMEM; what it
# costs is everything XLA would have decided for us (tiling, prefetch, layouts), written
# by hand and checked against the reference.

# %% [markdown]
# ## Tokens per second against acceptance length
#
# With speculative decoding each step verifies T rows and keeps a mean of $\tau \le T$ of
# them per sequence: tokens/s per user $= \tau / t_\text{step}(T)$. The simulated step at
# T = `mk.cost.ledger.VERIFY_ROWS` (the published runs' verification width) against the
# modelled step.

# %% tags=["hide-input"]
verify = ledger.VERIFY_ROWS
sim_t = sim.simulate(step_plan(rows=verify))
modelled_t = perf.modelled_step_ms(config, spec, formats=formats,
                                   **(floor_args | {"rows": verify})) / 1e3
one = sim.simulate(step_plan(rows=1))
curve = [{"tau": t, "simulated step tok/s/user": f"{t / sim_t.step_s:,.0f}",
          "modelled step tok/s/user": f"{t / modelled_t:,.0f}"}
         for t in range(1, verify + 1)]
display(plots.table(curve))
accept = list(range(1, verify + 1))
plots.show(plots.lines(accept, {
    f"simulated step, T={verify}": [t / sim_t.step_s for t in accept],
    f"modelled step, T={verify}": [t / modelled_t for t in accept],
    "simulated step, no speculation": [1 / one.step_s] * verify},
    title=f"Tokens/s per user against acceptance length ({config.name}, {spec.name})",
    xaxis="mean accepted tokens per step tau (tokens)",
    yaxis="throughput (tokens/s per user)"))
print(f"no speculation (T=1): {1 / one.step_s:,.0f} tokens/s per user simulated; a T={verify} "
      f"step costs {sim_t.step_s / one.step_s:.2f} T=1 steps, so speculation pays from a mean "
      f"acceptance of {sim_t.step_s / one.step_s:.2f} tokens")

# %% [markdown]
# ## The published numbers, explained not fitted
#
# Each published run against the models of `mk.cost.ledger`, under the assumptions it names
# once for notebooks 00, 09 and 11 (batch 1 where unstated, T = 8 verification rows,
# each row's own context, every device in the tensor-parallel group): the modelled step,
# the simulated step for TPU rows (the default ring, and one sized by Little's law), the
# conventional step for GPU rows. The note says what the modelled run does not share with
# the published one. The "compiled-kernel step" is the simulated step of the run's own
# compiled shard: the ring it was compiled with and the per-tile issue time libtpu's
# bundles give it (the recorded `--published` rows above), against the HBM floor. The
# words are those of [notebook 00's ledger](00_decode_is_memory_bound.ipynb).

# %% tags=["hide-input"]
pub = ledger.entries(simulate_tpu=simulate_published, tile_costs=published_costs)


def pct(x):
    return "-" if x is None else f"{x:+.0%}"


display(plots.table([{
    "run": r["run"], "published": f"{r['published']:g}",
    "modelled step": f"{r['modelled']:,.0f} ({pct(r['modelled_error'])})"
    if "modelled" in r else "-",
    "bound by": r.get("bound", "-"),
    "simulated step (Little's-law ring)": f"{r['simulated']:,.0f} "
                                          f"({pct(r['simulated_error'])}), "
                                          f"{r['simulated_bound']}"
    if "simulated" in r else "-",
    **{f"compiled-kernel step (simulated), {end} bundle rate": "; ".join(
        ([f"{r[f'compiled_{end}']:,.0f} ({pct(r[f'compiled_{end}_error'])}), "
          f"{r[f'compiled_{end}_over_floor']:.2f}x the HBM floor, "
          f"{r[f'compiled_{end}_bound']}"] if f"compiled_{end}" in r else [])
        + ([r["compiled_note"]] if "compiled_note" in r else [])) or "-"
       for end in RATE_ENDS},
    "conventional step": f"{r['conventional']:,.0f} ({pct(r['conventional_error'])})"
    if "conventional" in r else "-",
    "note": r["note"]} for r in pub]))

# %% [markdown]
# Why they differ, row by row: how many times the published step is the modelled one (the
# time the floors and the collectives do not explain) and what bounds the simulated
# schedule with a ring deep enough to hide the descriptor latency.

# %%
for r in pub:
    if "modelled" in r and r.get("published_step_ms"):
        line = (f"{r['run']:34} published step {r['published_step_ms']:5.2f} ms = "
                f"{r['published_step_ms'] / r['modelled_ms']:.2f}x the modelled "
                f"{r['modelled_ms']:.2f} ms")
        if "simulated" in r:
            line += (f"; simulated {r['simulated_ms']:.2f} ms with {r['simulated_slots']} "
                     f"slots, HBM busy {r['simulated_utilisation']:.0%}, bound by "
                     f"{r['simulated_bound']}")
        if "compiled_slow" in r:
            line += (f"; the compiled kernel simulated {r['compiled_slow_ms']:.2f} ms at the "
                     f"bundle rate's slow end, {r['compiled_fast_ms']:.2f} ms at its fast end "
                     f"= {r['compiled_slow_over_floor']:.2f}x and "
                     f"{r['compiled_fast_over_floor']:.2f}x the HBM floor "
                     f"{r['hbm_floor_ms']:.2f} ms ({r['tile_slow_ns']:.0f} and "
                     f"{r['tile_fast_ns']:.0f} ns issue against {r['tile_dma_ns']:.0f} ns "
                     f"DMA per tile, {r['compiled_slots']} slots)")
        if "conventional" in r:
            line += (f"; conventional {r['conventional_ms']:.2f} ms, "
                     f"{r['conventional_gap_ms']:.2f} ms of it launch gaps")
        print(line)
faster = [r["run"] for r in pub if "modelled" in r and r["published"] > r["modelled"]]
print(f"published faster than the modelled step: {faster or 'none'}")
shown = [r for r in (pub if simulate_published else headline_rows) if "compiled_slow" in r]
if shown:
    plots.show(plots.published_vs_floor(
        [r["run"] for r in shown], [r["published"] for r in shown],
        {f"compiled-kernel step (simulated), {end} bundle rate": [r[f"compiled_{end}"]
                                                                  for r in shown]
         for end in RATE_ENDS} | {"HBM floor": [r["hbm_floor"] for r in shown]},
        title="Published tokens/s against the compiled-kernel step (simulated) at both "
              "ends of the bundle rate, and the HBM floor"))

# %% [markdown]
# Reading the numbers: a published run faster than its modelled step (listed above) breaks
# an assumption of the model for that run: the modelled step charges each weight the tile
# cost table's issue time (the Kimi runs are issue-bound: an FP4 expert tile's unpack in
# VMEM costs far more than its few bytes take to stream) and puts every collective on the
# critical path. A cheaper unpack, tiles with more weights a trip, or overlapping the
# collectives with the weight stream would each shorten it. Where the simulated schedule
# is bound by "compute" (the Kimi runs), the compute lane is the step's critical path, and
# every layer adds two all-reduces (a latent-MoE layer three collectives more). At TP32
# each expert's 96 columns a device of gate and of up pad to 128 lanes, as do down's 96
# rows (the note of each Kimi row says so): 4/3 of the expert bytes, and the whole shard
# fits one core's HBM and compiles whole. Whether the ring's bookkeeping matters depends on the
# bundle rate:
# the cell below says, at each end of the range, on which shards the compiled kernel's
# per-tile issue time stays under 0.9 x the tile's DMA time. Where it does, the distance
# to the published runs is in the compute lane's model (the MXU rate of FP4 weights, the
# collectives' latency) and in the expert layout; where it does not, the loop's own
# bundles set the pace too. The GPU rows are modelled as one kernel per op with an H100
# launch gap; their published numbers are slower still, which that gap alone does not
# explain.

# %%
measured_shards = [r for r in published_costs if "tile_ns" in r]
for end in RATE_ENDS:
    over = [f"{r['preset']} TP{r['tp']} B={r['batch']} T={r['rows']} "
            f"({issue_ns(r, end) / r['dma_ns']:.2f})" for r in measured_shards
            if issue_ns(r, end) > 0.9 * r["dma_ns"]]
    print(f"bundle rate's {end} end: the per-tile issue time stays under 0.9 x its DMA on "
          f"{len(measured_shards) - len(over)} of {len(measured_shards)} recorded shards"
          + (f"; it does NOT on {', '.join(over)} (issue / DMA): there the loop's "
             "bookkeeping, not HBM, sets the pace of weight streaming" if over else ""))

# %% [markdown]
# ## Exercise: one all-reduce, read back to its inputs
#
# Every collective line above (the step's collectives term, the latency grid's collective
# chain) is a sum of all-reduces, each priced by `mk.kernels.collectives.allreduce_s`.
# Derive one. An all-reduce of an `nbytes` message on each of `tp` devices runs as two
# phases, a reduce-scatter then an all-gather, each of `collectives.rounds(algorithm, tp)`
# message rounds (the algorithm: `collectives.choose_algorithm(tp, algorithm)`) of
# `collectives.round_s(spec, latency_s)` seconds. Meanwhile bytes move at one device's
# `collectives.ici_bandwidth(spec)` bytes/s: in the reduce-scatter each device sends the
# others the tp - 1 chunks of its message they own (1/tp of it each); in the all-gather,
# its own summed chunk to each of the tp - 1 others.
#
# **Predict**: Kimi K3's verification step (B = 1, T = 8 rows of float32 partial sums of
# its hidden width) all-reduces at TP32 on TPU7x, at the measured round and link: is that
# bound by its rounds or by its bytes? Then **write** `my_allreduce_s`;
# `course.check_allreduce_s` compares it with mk's own on six cases (that one, each
# algorithm, a bandwidth-bound message, a round given, an empty message, tp = 1) and fails
# on the first it gets wrong, saying what that case exercises. `solutions = True`
# (parameters cell) checks the worked solution instead; `course.reveal("11b-allreduce")`
# explains it.

# %%
def my_allreduce_s(nbytes, tp, spec, algorithm=None, latency_s=None):
    """Seconds of one all-reduce of `nbytes` per device over `tp` devices of chip `spec` (a
    `mk.model.chips.ChipSpec`) by `algorithm` (None: the one of fewer rounds), a message
    round taking `latency_s` seconds (None: the chip's), from `collectives.rounds`,
    `choose_algorithm`, `round_s` and `ici_bandwidth`."""
    ...


derivation = course.check_allreduce_s(course.attempt("11b-allreduce", my_allreduce_s,
                                                     solutions))
display(plots.table([{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()}
                     for r in derivation]))
kimi_round = derivation[0]
print(f"{kimi_round['case']}: {kimi_round['yours µs']:.2f} µs, "
      f"{kimi_round['rounds µs']:.2f} µs of it {kimi_round['rounds']} message rounds and "
      f"{kimi_round['bytes µs']:.2f} µs bytes: bound by its "
      f"{'rounds' if kimi_round['rounds µs'] > kimi_round['bytes µs'] else 'bytes'}")

# %% [markdown]
# **Takeaway.** The verdict's lines come from here: the floors say what the bytes cost,
# the tile tables what the compiled loop costs to issue, the sweeps what each design
# choice buys, and the published runs how far the models are from a real release, each
# a model or a simulation with the assumptions it names.

# %% [markdown]
# ## Checks

# %%
# Up to a layer's period of tiles a deeper ring may cost a little (the layer's KV loads
# queue behind more weight tiles in the one FIFO DMA engine), never more than 5% over the
# best shallower ring; the plan's ring is never deeper (`default_block`).
steps = [r["step_ms"] for r in sweeps["slots"]
         if r["step_ms"] and r["slots"] <= plan.stream.period]
assert all(b <= min(steps[:i + 1]) * 1.05 for i, b in enumerate(steps[1:])), "more slots, slower"
assert len(pub) == len(published())
assert modelled_ms >= max(est.hbm_floor_ms, mxu_ms) and xla.fusions > xla.layers
table = ledger.latency_grid(grid)
assert len(table) == len(grid) * sum("simulated_ms" in r for r in headline_rows)
for run_name in {r["run"] for r in table}:  # a longer round never makes a step shorter
    by_us = sorted((r["round (µs)"], r) for r in table if r["run"] == run_name)
    for key in ("collective chain (ms)", "simulated (ms)"):
        assert all(a[1][key] <= b[1][key] * (1 + 1e-12) for a, b in zip(by_us, by_us[1:]))
# the draft at the slower bundle rate is never the faster one, and it takes time
assert drafts["slow"].step_ms >= drafts["fast"].step_ms > 0, drafts
print("checks passed")
