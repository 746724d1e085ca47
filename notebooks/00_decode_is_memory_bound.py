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
# - Why does HBM bandwidth, not the matrix unit, set the time of a decode step, and when
#   does the MXU's minimum of 128 or 256 rows per weight pass (notebook 00b) take over?
# - How far are the published megakernel numbers (TPU v7 and GB200) from the floors?
#
# It is arithmetic on datasheet peaks (`mk.model.chips`, `data/chips.csv`) and model shapes
# (`mk.model.config`) done by `mk.cost.perf` and `mk.cost.ledger`: no kernel runs and nothing is timed.
#
# **You will** compute a decode step's bytes and FLOPs and its floors. **You will be able
# to** say which floor bounds a run and how far a published number is from it.
# **Prerequisites:** 00b (the MXU rule); a matrix-vector product's bytes and FLOPs.

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
table_context: int = 4096  # S of the per-preset tables (capped at each preset's max_position)

# %%
import mk
import mk.course.run
from mk.cost import ledger, perf
from mk import plots
from mk.model.chips import all_chips
from mk.model.presets import PRESET_NAMES
from mk.model.quant import stored_bytes
from IPython.display import display

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
print(f"{run.config.name}: B={run.batch} T={run.rows} S={run.context} on {run.chip}")

# %% [markdown]
# ## The floors
#
# A step cannot finish before its bytes have crossed HBM (the **HBM floor**), nor before
# its matmuls have gone through the MXU. Counting FLOPs alone gives the FLOP floor; the MXU
# charges each weight pass at least its $R$ rows (notebook 00b), which gives the **MXU
# floor** that `mk.cost.sim` uses too:
#
# $$t_\text{step} \;\ge\; \max\!\Big(\frac{\text{bytes}}{\text{HBM bandwidth}},\;
#   \sum_\text{weights} \frac{2\max(M, R)\,K N}{\text{peak FLOP/s}}\Big)
#   \;\ge\; \frac{\text{FLOPs}}{\text{peak FLOP/s}}.$$
#
# With $M = B \cdot T$ activation rows, each weight element of $b$ bytes is read once and
# used in $2M$ FLOPs (one multiply-add per row), so the arithmetic intensity of the weights
# is $I = 2M / b$ FLOP/byte: $M$ for bf16 weights, $2M$ for fp8, $4M$ for fp4. By FLOPs the
# step is bound by HBM while $I$ is below the chip's ridge point, peak / bandwidth; by the
# MXU rule, while $2\max(M, R)/b$ is:

# %%
for c in all_chips():
    low = "int8" if "no fp8" in c.notes else "fp8"  # data/chips.csv: v5e/v6e/v5p have no fp8
    print(f"{c.name:6} {c.hbm_bw / 1e12:5.2f} TB/s  {c.bf16_flops / 1e12:6.0f} TFLOP/s bf16"
          f"  ridge {c.ridge_flop_per_byte:4.0f} FLOP/B bf16,"
          f" {perf.peak_flops(c, 'fp8') / c.hbm_bw:4.0f} {low}")

# %% [markdown]
# By FLOPs, a decode step with bf16 weights needs hundreds of rows before the matrix unit
# becomes the limit. By the MXU rule, a pass of fewer than $R$ rows already costs $R$ rows:
# bf16 weights stay HBM-bound (their ridge is above $R$ on every TPU here), 4-bit weights
# do not. For the run's own configuration:

# %%
est = perf.predict(run.config, run.chip, batch=run.batch, rows=run.rows, context=run.context)
print(f"{est.config_name} on one {est.chip_name} device: weights {est.weight_bytes / 1e6:.3f} MB"
      f" + KV {est.kv_bytes / 1e6:.3f} MB, {est.flops / 1e6:.3f} MFLOP,"
      f" intensity {est.intensity_flop_per_byte:.2f} FLOP/B")
mxu = perf.mxu_floor_ms(run.config, run.chip, batch=run.batch, rows=run.rows,
                        context=run.context)
print(f"HBM floor {est.hbm_floor_ms * 1e3:.3f} µs, MXU floor {mxu * 1e3:.3f} µs (FLOP floor "
      f"{est.compute_floor_ms * 1e3:.4f} µs): {'HBM' if est.hbm_floor_ms >= mxu else 'MXU'}"
      f"-bound, <= {run.rows / max(est.hbm_floor_ms, mxu) * 1e3:,.0f} tokens/s per sequence")

# %% [markdown]
# A floor is what a step cannot beat, not what it takes. A TPU v5e lent to the project ran
# the megakernel's steps (`benchmarks/tpu_steps.py`: device loops and one dispatched step,
# random weights), each beside its datasheet HBM floor and the share of that floor the chip
# reached: the rest is the DMA engine's own rate, the first tiles of a step, attention's KV
# loop and the host's dispatch (notebooks 06, 08 and 13 take them apart). qwen3-0.6b:

# %%
display(ledger.steps_table("v5e", model="qwen3-0.6b"))

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
    "preset": n, "S": e.context, "stored GB": f"{stored_bytes(mk.preset(n)) / 1e9:.3g}",
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
# cache, every device holding the kernel's tensor-parallel shard (`mk.step.plan`: split
# widths padded to whole tiles, norms on every device, the router too unless the plan
# splits it by experts). A cell reads "HBM floor
# in ms (chips), HBM floor / MXU floor": below 1 the MXU, not HBM, sets the step; "no TPn
# split" where the kernel cannot split the model over that many devices (more devices
# than query heads).

# %%
grid = []
for name, e in steps.items():
    row = {"preset": name}
    for c in all_chips():
        n = perf.min_chips(mk.preset(name), c, batch=run.batch, context=e.context)
        tp = n * c.cores_per_chip
        try:
            f = perf.predict(mk.preset(name), c, batch=run.batch, rows=run.rows,
                             context=e.context, tp=tp)
        except ValueError:  # a split the kernel cannot make (mk.step.shards.check_tp)
            row[c.name] = f"({n}) no TP{tp} split"
            continue
        m = perf.mxu_floor_ms(mk.preset(name), c, batch=run.batch, rows=run.rows,
                              context=e.context, tp=tp)
        row[c.name] = f"{f.hbm_floor_ms:.3g} ({n}), {f.hbm_floor_ms / m:.2f}x"
    grid.append(row)
display(plots.table(grid))

# %% [markdown]
# On the roofline (FLOPs against bytes), a decode step sits far left of every ridge point.
# The slider moves the batch; MoE presets gain little intensity from batching because extra
# tokens mostly touch extra experts. The roofline counts FLOPs: the MXU rule's $R$ rows per
# pass are what the grid above adds.

# %%
curves = {c.name: perf.roofline_curve(c) for c in all_chips()}
sweep = {f"B={b}": {n: perf.predict(mk.preset(n), run.chip, batch=b, rows=1,
                                    context=min(table_context, mk.preset(n).max_position - 1))
                    for n in PRESET_NAMES}
         for b in (1, 4, 16, 64)}
plots.show(plots.roofline(curves, sweep, title=f"Decode steps on the {run.chip} roofline "
                                               f"(T=1, S up to {table_context})"))

# %% [markdown]
# ## The ledger: the words for numbers, and the published runs against the floors
#
# Every step time the course states is one of these, and each word means one thing in
# every notebook. They are defined here, once (`mk.cost.ledger.TERMS`); notebooks 09 and 11
# link back to this table instead of restating it:

# %%
display(ledger.glossary())

# %% [markdown]
# `data/published.csv` holds the September 2026 release's numbers; `mk.cost.ledger` sets each
# run on a chip of `data/chips.csv` against its `-like` preset under one set of
# assumptions, the same in notebooks 09 and 11: $S$ = the row's own context (the cached
# positions the release's benchmark scripts ran at, the `S` column below), batch 1 where
# not stated, $T$ = 8 verification rows for a speculative run that keeps its
# mean acceptance length $\tau$, every device of the run sharing the step.

# %% [markdown]
# Each floor is a step time no run can beat, so $\tau / t_\text{floor}$ bounds tokens/s
# per user (times $B$ for aggregate rows). "Shared routing" is the strictest version: all
# tokens of a step use the same $X$ experts. This is a bound from floors with stated
# assumptions, not a fit.

# %%
# the MXU floor at the fastest feed the chip has for the weights (fp8: TPU7x feeds FP4 and
# FP8 weights at twice bf16); at the bf16 feed FP4 experts are overcharged (TERMS)
uniform = [r for r in ledger.entries(compute="fp8") if "hbm_floor" in r]
shared = [r for r in ledger.entries(routing="shared", compute="fp8") if "hbm_floor" in r]
label = [r["run"] for r in uniform]
display(plots.table([{
    "run": u["run"], "S": u["context"], "metric": u["metric"],
    "published tok/s": f"{u['published']:g}",
    "published step ms": f"{u['published_step_ms']:.2f}",
    "HBM floor ms": f"{u['hbm_floor_ms']:.3g}",
    "MXU floor ms": f"{u['mxu_floor_ms']:.3g}" if "mxu_floor_ms" in u else "- (GPU)",
    "bound tok/s": f"{ledger.floor_tokens(u):,.0f}",
    "bound, shared routing": f"{ledger.floor_tokens(s):,.0f}",
    "published / bound": f"{u['published'] / ledger.floor_tokens(u):.2f}"}
    for u, s in zip(uniform, shared)]))

# %%
skipped = [f"{r['model']} on {r['system']}" for r in ledger.entries()
           if "hbm_floor" not in r]
print(f"no chip row, no bound: {skipped}")
over = [u["run"] for u in uniform if u["published"] > ledger.floor_tokens(u)]
print(f"published above the uniform-routing bound: {over or 'none'}")
for u in uniform:
    which, floor_ms = ledger.larger_floor(u)
    gap_us = 1e3 * (u["published_step_ms"] - floor_ms) / mk.preset(u["preset"]).layers
    print(f"{u['run']:34} published step {u['published_step_ms']:5.2f} ms = "
          f"{u['published_step_ms'] / floor_ms:4.1f}x the larger floor "
          f"({which}); "
          f"{gap_us:4.0f} µs per layer above it")

# %%
plots.show(plots.published_vs_floor(label, [u["published"] for u in uniform], {
    "HBM floor bound (uniform routing)": [u["hbm_floor"] for u in uniform],
    "HBM floor bound (shared routing)": [s["hbm_floor"] for s in shared],
    "MXU floor bound (TPU rows)": [u.get("mxu_floor") for u in uniform]}))

# %% [markdown]
# The list above names the larger floor of each run at the fp8 feed. Charged at the bf16
# feed instead, the Kimi runs on TPU7x with many rows per step (the larger batches, the
# speculative runs) would look MXU-bound: their FP4 experts stream a quarter of bf16's
# bytes while the MXU rule charges 256 rows per weight pass, at half the fp8 rate. That is
# what a kernel feeding FP4 weights at bf16 would pay, not a floor (`mk.cost.ledger.TERMS`).
# A GPU has no MXU: its rows have the HBM floor alone.
#
# ### Per user or aggregate?
#
# The release's benchmark scripts plot aggregate throughput over the batch (as relayed in
# `data/published.csv`), and the no-speculation Kimi numbers rise with batch. Read as
# per-user numbers instead, each would have to fit under the per-user bound
# (the aggregate bound over $B$):

# %%
for u, s in zip(uniform, shared):
    if u["metric"] == "aggregate_as_published" and u["batch"] > 1:
        per_user = {k: ledger.floor_tokens(r) / r["batch"]
                    for k, r in (("uniform", u), ("shared", s))}
        verdict = "exceeds" if u["published"] > per_user["uniform"] else "fits under"
        print(f"{u['run']:34} {u['published']:4g} read per user {verdict} the per-user bound "
              f"{per_user['uniform']:,.0f} (uniform), {per_user['shared']:,.0f} "
              "(shared routing)")

# %% [markdown]
# Where the per-user reading exceeds the uniform-routing bound but not the shared-routing
# one, the floor alone cannot settle the unit: it rules the per-user reading out only if
# the batch's sequences route independently. The rise with batch remains the stronger hint.
#
# ## What this says about the megakernel
#
# Every published run above sits below both floor bounds, and the table's last column
# shows by how much. The printed per-layer gaps are time a step spends beyond its larger
# floor: candidates are the tensor-parallel collectives after attention and after the MLP
# of each layer, synchronisation between the stages of a layer, uneven expert load across
# devices, and HBM bandwidth below the datasheet peak. This notebook cannot tell them apart;
# the simulator and profiles of later notebooks try to. The floors are for presets of the
# released models (`kimi-k3`: the release's own Kimi K3 config, field by field, its latent
# MoE, SiTU and attention residuals included; `qwen3.5-27b`: Qwen3.5's gated DeltaNet, with
# the dimensions the release does not state taken from its public relatives or marked
# assumed in `mk.model.presets`); their weights are random, so only the bytes and shapes are
# theirs.
#
# **Takeaway.** At decode batch sizes the intensity of a step is a few FLOP per byte
# against ridge points of hundreds, so with bf16 weights the time of a step is set by the
# bytes it reads: weights, the experts it touches, and the KV cache. A decode megakernel
# wins by keeping HBM streaming all the time. With 4-bit weights the MXU's fixed cost per
# weight pass catches up, and how the kernel feeds the MXU matters as much.

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
# *Takeaway:* one sequence uses a fraction of a percent of the MXU's FLOPs, though the MXU
# is busy loading weights for up to $R$ / ridge of an HBM-bound step (notebook 00b);
# batching and verifying drafted rows (09) are the ways to spend the idle FLOPs.

# %% [markdown]
# ## Questions
#
# 1. Going from batch 1 to batch 8, what happens to the HBM floor of a dense model at a
#    short context, and why?
#    <details><summary>Answer</summary>It barely moves: the weights, read once per step whatever the batch,
#    dominate the bytes; only the KV bytes grow with B.</details>
# 2. Why can no published run beat the HBM floor of its own bytes?
#    <details><summary>Answer</summary>The floor is those bytes at the datasheet's peak bandwidth; only moving
#    fewer bytes (a smaller format, shared experts) makes a step shorter.</details>

# %% [markdown]
# ## Checks

# %%
everything = list(steps.values()) + [est]
assert all(0 < e.hbm_floor_ms and 0 < e.compute_floor_ms for e in everything), "bad floor"
assert all(e.step_ms == max(e.hbm_floor_ms, e.compute_floor_ms) for e in everything)
for c in all_chips("tpu"):
    for name in PRESET_NAMES:
        e = perf.predict(mk.preset(name), c, batch=1, rows=1, context=0)
        m = perf.mxu_floor_ms(mk.preset(name), c, batch=1, rows=1, context=0)
        assert m >= e.compute_floor_ms, f"{name}: the MXU floor is below the FLOP floor"
        # bf16 weights: HBM-bound at B=1 on every TPU; 4-bit experts (kimi-k3-like): MXU
        assert (m > e.hbm_floor_ms) == (mk.preset(name).expert_bits < 8), (name, c.name)
for u, s in zip(uniform, shared):
    # The strictest bound: nothing a real run does can beat it unless an assumption fails.
    assert u["published"] <= ledger.floor_tokens(s), f"{u['run']} beats a floor"
    tokens = u["tau"] or u["batch"]
    assert abs(u["published_step_ms"] - 1e3 * tokens / u["published"]) < 0.01, u["run"]
print("checks passed")
