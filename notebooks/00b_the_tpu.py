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
# # 00b · The TPU in one picture
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/00b_the_tpu.ipynb)
#
# Every kernel of this course moves weight tiles from HBM into VMEM and pushes a few rows
# through the matrix unit. Before writing one, this notebook draws the machine. It answers:
#
# - Where do a Pallas TPU kernel's arrays live (HBM, VMEM, SMEM, vector registers), which
#   units compute on them (MXU, VPU, scalar unit) and what moves them (DMA engines, ICI)?
# - How do the four TPU generations this project targets (v5e, v6e, v5p, TPU7x) differ?
# - Why does the MXU charge a one-row decode step as if it had 128 or 256 rows, and when
#   does that, not HBM, set the time of a step?
#
# Every number comes from `data/chips.csv` (`mk.model.chips`) and `mk.cost.perf`: nothing runs on a
# TPU here and nothing is timed.
#
# **You will** draw each TPU generation's memories and units from its datasheet row and
# apply the MXU rule. **You will be able to** say why a one-row step costs 128 or 256
# rows of MXU time and where HBM takes over. **Prerequisites:** none (the course starts
# here).

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

# %%
import mk
import mk.course.run
from IPython.display import display
from mk.cost import perf
from mk import plots
from mk.model.chips import all_chips

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
print(f"{run.config.name}: B={run.batch} T={run.rows} S={run.context} on {run.chip}")

# %% [markdown]
# ## One chip, as a kernel sees it
#
# A weight tile's path in every kernel of this course: HBM (the kernel's input refs stay
# there, `memory_space=pl.ANY`) -> a DMA engine (`pltpu.make_async_copy(src, dst,
# sem).start()`, later `.wait()` on its semaphore) -> a VMEM ring slot (`pltpu.VMEM`
# scratch) -> vector registers -> the MXU (`jnp.dot` in the kernel body). Small integers
# the control flow needs (positions, the experts a router chose, how many are active)
# live in SMEM and steer `pl.when` branches on the scalar unit. Norms, RoPE, softmax and
# SwiGLU run on the VPU. Chips talk over ICI (`pltpu.make_async_remote_copy`, notebook 10).
# The kernel decides every copy itself: nothing is cached for it.
#
# The run's chip first, then the other generations:

# %%
tpus = sorted(all_chips("tpu"), key=lambda c: c.name != run.chip)
for c in tpus:
    plots.show(plots.tpu_picture(c))

# %% [markdown]
# ## The four generations side by side
#
# Per chip as in `data/chips.csv`; "per core" divides by the JAX devices that share the
# chip's HBM. v5p and TPU7x both have two TensorCores per chip: TPU7x runs each as its own
# JAX device, v5p runs its two as one "megacore" device, so its "per core" numbers are the
# megacore's (the column counts devices, not TensorCores). "Fill VMEM" is how long one core's
# share of the HBM bandwidth takes to fill its VMEM once: the scale of one layer's
# weight tiles in flight.

# %%
display(plots.table([{
    "chip": c.name, "HBM GiB": f"{c.hbm_bytes / 2**30:.0f}",
    "HBM GB/s": f"{c.hbm_bw / 1e9:,.0f}", "JAX devices per chip": c.cores_per_chip,
    "VMEM MiB per core": f"{c.vmem_bytes / 2**20:.0f}", "MXU": f"{c.mxu_rows} x {c.mxu_rows}",
    "bf16 TFLOP/s per core": f"{c.bf16_flops / c.cores_per_chip / 1e12:,.0f}",
    "ICI GB/s": f"{c.ici_bw / 1e9:,.0f}",
    "fill VMEM µs": f"{c.vmem_bytes / c.device_hbm_bw * 1e6:.0f}",
    "ridge FLOP/B": f"{c.ridge_flop_per_byte:.0f}"} for c in tpus]))

# %% [markdown]
# ## The MXU loads weights
#
# The MXU is a grid of $R \times R$ multiply-accumulators ($R$ = 128 before v6e, 256 from
# v6e) that holds one weight block still while activation rows stream through it. Loading
# the block takes about as long as streaming $R$ rows, so a pass of $M < R$ rows over a
# $[K, N]$ weight costs what $R$ rows cost:
#
# $$t_\text{MXU} = \frac{2\,\max(M, R)\,K N}{\text{peak}}, \qquad
#   t_\text{HBM} = \frac{b\,K N}{\text{bandwidth}}$$
#
# for $b$ bytes per weight. A decode pass ($M < R$) is bound by HBM only while
# $b > 2R / \text{ridge}$: the weight must bring enough bytes to cover the MXU's $R$ rows.
# This is the rule `mk.cost.sim` charges for every weight tile; `mk.cost.perf.mxu_floor_ms` applies
# it to a whole step (the "MXU floor" of every notebook).

# %%
for c in tpus:
    need = 2 * c.mxu_rows / c.ridge_flop_per_byte
    kinds = {"bf16": 2, "fp8/int8": 1, "fp4": 0.5}
    print(f"{c.name:6} a one-row pass is HBM-bound above {need:.2f} bytes per weight: "
          + ", ".join(f"{k} {'HBM' if b > need else 'MXU'}" for k, b in kinds.items()))

# %% [markdown]
# So bf16 weights keep a decode step HBM-bound on all four chips, and 4-bit weights make it
# MXU-bound unless the MXU runs them at a higher rate (the printed thresholds say by how
# much). For the run's model at its B, T and S: the HBM floor (bytes / bandwidth), the FLOP
# floor (FLOPs / peak, which ignores the rule) and the MXU floor (the rule):

# %%
floors = []
for c in tpus:
    e = perf.predict(run.config, c, batch=run.batch, rows=run.rows, context=run.context)
    mxu = perf.mxu_floor_ms(run.config, c, batch=run.batch, rows=run.rows,
                            context=run.context)
    floors.append((c.name, e.hbm_floor_ms, e.compute_floor_ms, mxu))
display(plots.table([{
    "chip": n, "HBM floor µs": f"{h * 1e3:.3g}", "FLOP floor µs": f"{f * 1e3:.3g}",
    "MXU floor µs": f"{m * 1e3:.3g}", "bound": "HBM" if h >= m else "MXU",
    "MXU / FLOP floor": f"{m / f:.0f}x"} for n, h, f, m in floors]))

# %% [markdown]
# **Takeaway.** A decode kernel's job is to keep the DMA engines streaming weight tiles from
# HBM into VMEM while the MXU consumes the ones already there. The MXU's $R$-row minimum
# makes its busy time far larger than the FLOP count suggests (the last column), close to
# HBM's on TPU7x, and with 4-bit weights it becomes the limit. Notebook 00c writes
# a first Pallas kernel, one copy HBM -> VMEM -> HBM; notebook 01 writes that stream.

# %% [markdown]
# ## Questions
#
# 1. On a 256 x 256 MXU, a decode step multiplies 8 rows by a weight. How many rows does
#    the MXU charge for that pass?
#    <details><summary>Answer</summary>256: a weight loaded into the MXU serves up to its row count at the
#    same cost, so 8 rows cost what 256 do.</details>
# 2. Where does an array given `memory_space=pl.ANY` live, and who moves it?
#    <details><summary>Answer</summary>It stays in HBM; the kernel copies what it needs into VMEM with its own
#    DMAs (`pltpu.make_async_copy`).</details>

# %% [markdown]
# ## Checks

# %%
assert len(tpus) == 4 and tpus[0].name == run.chip
for c in tpus:
    fig = plots.tpu_picture(c)
    labels = " ".join(fig.data[0].text)
    for unit in ("HBM", "DMA", "VMEM", "SMEM", "vector registers", "MXU", "VPU", "ICI"):
        assert unit in labels, f"{c.name}'s picture has no {unit}"
    assert f"{c.mxu_rows} x {c.mxu_rows}" in labels and f"{c.vmem_bytes >> 20} MiB" in labels
for name, h, f, m in floors:
    assert m >= f > 0 and h > 0, f"{name}: the MXU floor is below the FLOP floor"
print("checks passed")
