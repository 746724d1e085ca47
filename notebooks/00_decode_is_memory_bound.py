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
# # 00 · Decode is memory-bound
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/00_decode_is_memory_bound.ipynb)
#
# One decode step pushes a few activation rows through every weight the model uses and reads
# every sequence's KV cache. This notebook answers:
#
# - How many bytes and FLOPs does one decode step of each preset move and compute?
# - Why does HBM bandwidth, not the matrix unit, set the time of a decode step?
# - How far are the published megakernel numbers (TPU v7 and GB200) from the HBM floor?
#
# It is arithmetic on datasheet peaks (`mk.chips`, `data/chips.csv`) and model shapes
# (`mk.config`) done by `mk.perf`: no kernel runs and nothing is timed.

# %%
# Colab bootstrap, the same in every notebook. On Colab without the mk-megakernel package,
# pip installs MK_SOURCE (this release's tag; set the environment variable MK_SOURCE to
# install another ref or a fork) with the notebook and profiler extras, then asks for a
# restart. Anywhere, a folder named mk that is not the package stops here, saying so.
import importlib.metadata
import importlib.util
import os
import sys

MK_SOURCE = os.environ.get("MK_SOURCE", "git+https://github.com/mk-megakernel/mk@v0.1.0")
if "google.colab" in sys.modules:
    try:
        importlib.metadata.version("mk-megakernel")
    except importlib.metadata.PackageNotFoundError:
        # %pip install -q "mk-megakernel[notebooks,profile] @ {MK_SOURCE}"
        raise SystemExit("mk installed: Runtime > Restart session, then run all cells again.")
mk_spec = importlib.util.find_spec("mk")
if mk_spec is None or mk_spec.origin is None:
    raise ModuleNotFoundError(
        "the mk package is not installed: pip install 'mk-megakernel[notebooks,profile]'"
        + (f"; {list(mk_spec.submodule_search_locations)} is a folder named mk, not the "
           "package: rename it or work in another directory" if mk_spec else ""))

# %% tags=["parameters"]
preset: str = "tiny"  # a name from mk.config.PRESET_NAMES
batch: int = 1  # B, sequences decoded together
rows: int = 1  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v6e"  # a name from mk.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
table_context: int = 4096  # S of the per-preset tables (capped at each preset's max_position)
published_context: int = 0  # S assumed for the published runs, which do not state it

# %%
import mk
import mk.run
from mk import perf, plots
from mk.chips import all_chips
from mk.config import PRESET_NAMES
from IPython.display import display

run = mk.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
print(f"{run.config.name}: B={run.batch} T={run.rows} S={run.context} on {run.chip}")

# %% [markdown]
# ## The two floors
#
# A step cannot finish before its bytes have crossed HBM, nor before its FLOPs have gone
# through the matrix unit:
#
# $$t_\text{step} \;\ge\; \max\!\Big(\frac{\text{bytes}}{\text{HBM bandwidth}},\;
#   \frac{\text{FLOPs}}{\text{peak FLOP/s}}\Big).$$
#
# With $M = B \cdot T$ activation rows, each weight element of $b$ bytes is read once and
# used in $2M$ FLOPs (one multiply-add per row), so the arithmetic intensity of the weights
# is $I = 2M / b$ FLOP/byte: $M$ for bf16 weights, $2M$ for fp8, $4M$ for fp4. The step is
# bound by HBM while $I$ is below the chip's ridge point, peak / bandwidth:

# %%
for c in all_chips():
    low = "int8" if "no fp8" in c.notes else "fp8"  # data/chips.csv: v5e/v6e/v5p have no fp8
    print(f"{c.name:6} {c.hbm_bw / 1e12:5.2f} TB/s  {c.bf16_flops / 1e12:6.0f} TFLOP/s bf16"
          f"  ridge {c.ridge_flop_per_byte:4.0f} FLOP/B bf16,"
          f" {perf.peak_flops(c, 'fp8') / c.hbm_bw:4.0f} {low}")

# %% [markdown]
# A decode step with bf16 weights needs hundreds of rows per step before the matrix unit,
# not HBM, becomes the limit. For the run's own configuration:

# %%
est = perf.predict(run.config, run.chip, batch=run.batch, rows=run.rows, context=run.context)
print(f"{est.config_name} on one {est.chip_name} device: weights {est.weight_bytes / 1e6:.3f} MB"
      f" + KV {est.kv_bytes / 1e6:.3f} MB, {est.flops / 1e6:.3f} MFLOP,"
      f" intensity {est.intensity_flop_per_byte:.2f} FLOP/B")
print(f"HBM floor {est.hbm_floor_ms * 1e3:.3f} us, compute floor "
      f"{est.compute_floor_ms * 1e3:.3f} us: {est.bound}-bound,"
      f" <= {est.tokens_per_s_per_user:,.0f} tokens/s per sequence")

# %% [markdown]
# ## Bytes and FLOPs of one step, per preset
#
# The same count for every preset, with $B$ and $T$ from the parameters and
# $S$ = `table_context` cached positions per sequence. Experts are counted as touched under
# uniform independent routing: $M$ tokens each choosing $X$ of $E$ experts touch
# $E\,(1 - (1 - X/E)^M)$ distinct experts on average (an assumption; real routing is
# correlated). "Stored" is every weight; "read" is what this step reads.

# %%
steps = {}
for name in PRESET_NAMES:
    c = mk.preset(name)
    s = min(table_context, c.max_position - run.rows)
    steps[name] = perf.predict(c, run.chip, batch=run.batch, rows=run.rows, context=s)
display(plots.table([{
    "preset": n, "S": e.context, "stored GB": f"{mk.preset(n).weight_bytes / 1e9:.3g}",
    "weights read GB": f"{e.weight_bytes / 1e9:.3g}",
    "experts GB": f"{e.expert_bytes / 1e9:.3g}", "KV GB": f"{e.kv_bytes / 1e9:.3g}",
    "GFLOP": f"{e.flops / 1e9:.3g}", "FLOP/B": f"{e.intensity_flop_per_byte:.3g}"}
    for n, e in steps.items()]))

# %%
plots.show(plots.bytes_breakdown(steps, title=f"Bytes of one decode step (B={run.batch}, "
                                               f"T={run.rows}, S up to {table_context})"))

# %% [markdown]
# ## The floor on each chip
#
# Each preset on the fewest chips (a power of two) whose HBM holds its weights and KV
# cache, all devices sharing the step evenly (perfect sharding, an assumption). A cell
# reads "HBM floor in ms (chips), HBM floor / compute floor".

# %%
grid = []
for name, e in steps.items():
    row = {"preset": name}
    for c in all_chips():
        n = perf.min_chips(mk.preset(name), c, batch=run.batch, context=e.context)
        f = perf.predict(mk.preset(name), c, batch=run.batch, rows=run.rows,
                         context=e.context, tp=n * c.cores_per_chip)
        row[c.name] = f"{f.hbm_floor_ms:.3g} ({n}), {f.hbm_floor_ms / f.compute_floor_ms:.0f}x"
    grid.append(row)
display(plots.table(grid))

# %% [markdown]
# On the roofline, a decode step sits far left of every ridge point. The slider moves the
# batch; MoE presets gain little intensity from batching because extra tokens mostly touch
# extra experts.

# %%
curves = {c.name: perf.roofline_curve(c) for c in all_chips()}
sweep = {f"B={b}": {n: perf.predict(mk.preset(n), run.chip, batch=b, rows=1,
                                    context=min(table_context, mk.preset(n).max_position - 1))
                    for n in PRESET_NAMES}
         for b in (1, 4, 16, 64)}
plots.show(plots.roofline(curves, sweep, title=f"Decode steps on the {run.chip} roofline "
                                               f"(T=1, S up to {table_context})"))

# %% [markdown]
# ## Published numbers against the HBM floor
#
# `data/published.csv` holds the September 2026 release's numbers. For each run on a chip
# of `data/chips.csv` we compute the floor step of its `-like` preset under the assumptions
# that make the step shortest: $S$ = `published_context`, batch 1 where not stated (per-user
# speed only falls with batch), $T = \lceil a \rceil$ verification rows for acceptance
# length $a$ (a step keeps at most $T$ tokens), all devices sharing the weights. Then
# tokens/s per user $\le a / t_\text{floor}$ and aggregate $\le B\,a / t_\text{floor}$.
# This is a bound from floors with stated assumptions, not a fit. "Shared routing" is the
# strictest version: all tokens of a step use the same $X$ experts.

# %%
pubs = [r for r in perf.published() if perf.published_bound(r) is not None]
uniform = [perf.published_bound(r, context=published_context) for r in pubs]
shared = [perf.published_bound(r, context=published_context, routing="shared") for r in pubs]
label = [f"{r.preset.split('-like')[0]} {r.system} "
         + (f"a={r.acceptance_length:g}" if r.acceptance_length else f"B={r.batch}")
         for r in pubs]
display(plots.table([{
    "run": lab, "metric": r.metric, "published tok/s": f"{r.tokens_per_s:g}",
    "published step ms": f"{r.step_ms:.2f}", "floor step ms": f"{u.step_ms:.3g}",
    "bound tok/s": f"{perf.bound_tokens_per_s(r, u):,.0f}",
    "bound, shared routing": f"{perf.bound_tokens_per_s(r, s):,.0f}",
    "published / bound": f"{r.tokens_per_s / perf.bound_tokens_per_s(r, u):.2f}"}
    for lab, r, u, s in zip(label, pubs, uniform, shared)]))

# %%
skipped = [f"{r.model} on {r.system}" for r in perf.published()
           if perf.published_bound(r) is None]
print(f"no chip row, no bound: {skipped}")
over = [lab for lab, r, u in zip(label, pubs, uniform)
        if r.tokens_per_s > perf.bound_tokens_per_s(r, u)]
print(f"published above the uniform-routing bound: {over or 'none'}")
for lab, r, u in zip(label, pubs, uniform):
    gap_us = 1e3 * (r.step_ms - u.step_ms) / mk.preset(r.preset).layers
    print(f"{lab:28} published step {r.step_ms:5.2f} ms = {r.step_ms / u.step_ms:4.1f}x "
          f"the floor; {gap_us:4.0f} us per layer above it")

# %%
plots.show(plots.published_vs_floor(label, [r.tokens_per_s for r in pubs], {
    "HBM-floor bound (uniform routing)": [perf.bound_tokens_per_s(r, u)
                                          for r, u in zip(pubs, uniform)],
    "HBM-floor bound (shared routing)": [perf.bound_tokens_per_s(r, s)
                                         for r, s in zip(pubs, shared)]}))

# %% [markdown]
# ### Per user or aggregate?
#
# The no-speculation Kimi numbers rise with batch, so they are most likely aggregate over the
# batch. Read as per-user numbers instead, each would have to fit under the per-user bound:

# %%
for lab, r, u, s in zip(label, pubs, uniform, shared):
    if r.metric == "aggregate_as_published" and r.batch > 1:
        verdict = "exceeds" if r.tokens_per_s > u.tokens_per_s_per_user else "fits under"
        print(f"{lab:22} {r.tokens_per_s:4g} read per user {verdict} the per-user bound "
              f"{u.tokens_per_s_per_user:,.0f} (uniform), {s.tokens_per_s_per_user:,.0f} "
              "(shared routing)")

# %% [markdown]
# Where the per-user reading exceeds the uniform-routing bound but not the shared-routing
# one, the floor alone cannot settle the unit: it rules the per-user reading out only if
# the batch's sequences route independently. The rise with batch remains the stronger hint.
#
# ## What this says about the megakernel
#
# Every published run above sits below its floor-based bound, and the table's last column
# shows by how much. The printed per-layer gaps are time a step spends beyond streaming its
# bytes: candidates are the tensor-parallel collectives after attention and after the MLP of
# each layer, synchronisation between the stages of a layer, uneven expert load across
# devices, and HBM bandwidth below the datasheet peak. This notebook cannot tell them apart;
# the simulator and profiles of later notebooks try to. The floor is for the `-like`
# presets, not the released models: Kimi K3's real attention and shared expert, and the
# Qwen model's linear-attention layers, change its bytes.
#
# **Takeaway.** At decode batch sizes the intensity of a step is a few FLOP per byte
# against ridge points of hundreds, so the time of a step is set by the bytes it reads:
# weights, the experts it touches, and the KV cache. A decode megakernel wins by keeping
# HBM streaming all the time, not by computing faster.

# %% [markdown]
# ## Worked problems
#
# **1.** qwen3-8b in bf16 on one v6e at B = 1, S = 4096: what is the HBM floor, and how
# many tokens/s per sequence can it allow? *Formula:* bytes / BW; tokens/s $\le 1 /
# t_\text{floor}$. **2.** How many rows M must a step carry before bf16 weights stop
# being HBM-bound on v6e? *Formula:* $I = M$ FLOP/B for bf16 weights against the ridge
# point peak / BW. *Answers* (computed):

# %%
q8 = perf.predict(mk.preset("qwen3-8b"), "v6e", batch=1, rows=1, context=4096)
v6e = mk.chip("v6e")
print(f"1. {q8.total_bytes / 1e9:.2f} GB / {v6e.hbm_bw / 1e12:.2f} TB/s = "
      f"{q8.hbm_floor_ms:.2f} ms -> <= {q8.tokens_per_s_per_user:,.0f} tokens/s per sequence")
print(f"2. ridge {v6e.ridge_flop_per_byte:.0f} FLOP/B: about {v6e.ridge_flop_per_byte:.0f} "
      "rows per step (for the weights alone; the KV cache never gains intensity)")

# %% [markdown]
# *Takeaway:* one sequence can never use more than a few percent of the matrix unit;
# batching and verifying drafted rows (09) are the ways to spend the idle FLOPs.
#
# ## Checks

# %%
everything = list(steps.values()) + uniform + shared + [est]
assert all(0 < e.hbm_floor_ms and 0 < e.compute_floor_ms for e in everything), "bad floor"
assert all(e.step_ms == max(e.hbm_floor_ms, e.compute_floor_ms) for e in everything)
for c in all_chips("tpu"):
    for name in PRESET_NAMES:
        e = perf.predict(mk.preset(name), c, batch=1, rows=1, context=0)
        assert e.hbm_floor_ms > e.compute_floor_ms, f"{name} at B=1 is not HBM-bound on {c.name}"
for lab, r, s in zip(label, pubs, shared):
    # The strictest bound: nothing a real run does can beat it unless an assumption fails.
    assert r.tokens_per_s <= perf.bound_tokens_per_s(r, s), f"{lab} beats its floor"
    tokens = r.acceptance_length or r.batch
    assert abs(r.step_ms - 1e3 * tokens / r.tokens_per_s) < 0.01, f"{lab}: step_ms is stale"
print("checks passed")
