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
# # 01 · Weight streaming through a VMEM ring
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/01_weight_streaming.ipynb)
#
# Every decode step multiplies a handful of activation rows by every weight matrix. This
# notebook builds the piece every later kernel stands on, `y = x @ W` with `W` left in HBM
# and copied by hand into VMEM, and answers:
#
# - What does a Pallas TPU kernel look like when it moves its own weights with DMAs?
# - Why does a ring of N slots keep HBM busy where a single buffer cannot?
# - How much VMEM does a ring cost, and what does the TPU compiler say about it?

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
slots: int = 3  # ring slots of the last version
tile_k: int = 128  # K rows per weight tile
tile_n: int = 128  # N columns per weight tile

# %%
import time

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display

import mk
import mk.backend
import mk.run
from mk import plots, reference, tpu
from mk.kernels.common import BlockSizes, vmem_budget
from mk.kernels.weight_streaming import stream_matmul, stream_matmul_buffers

run = mk.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
mode = mk.backend.resolve(run.backend)
spec = mk.chip(run.chip)
print(f"{run.config.name}: M = B*T = {run.batch * run.rows} rows; kernels run on: {mode}")

# %% [markdown]
# ## The idea
#
# `W` [K, N] is cut into tiles of `tile_k` x `tile_n`, consumed column panel by column
# panel. Tile g lives in ring slot g mod `slots`; the rule is **when tile g has been
# consumed, issue tile g + slots into the slot it freed**. With one slot the DMA engine
# and the MXU take turns; with two, tile g+1 loads while g computes; with more, the extra
# tiles in flight absorb DMA latency and jitter. Per tile of b bytes:
#
# $$t_\text{1 slot} = n\,(t_\text{dma} + t_\text{mxu}), \qquad
#   t_{\ge 2\text{ slots}} \approx t_\text{dma}^{(1)} + n\,\max(t_\text{dma}, t_\text{mxu}),
#   \qquad t_\text{dma} = \ell + b / \text{BW}.$$
#
# Decode has $t_\text{mxu} \ll t_\text{dma}$ (few rows), so the ring's job is to keep a DMA
# in flight at every instant.

# %% [markdown]
# ## The reference
#
# Layer 0's query projection `wq` [D, N*H] of the run's model, times random activations.
# `mk.reference.matmul` rounds x to the weight dtype and accumulates in float32, as the
# MXU does.

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    run.config, run.seed)
w = params["wq"][0]
x = jax.random.normal(jax.random.key(run.seed), (run.batch * run.rows, w.shape[0]))
want = reference.matmul(x, w)
print(f"x {x.shape} @ wq {w.shape} {w.dtype} -> {want.shape}")

# %% [markdown]
# ## VMEM budget
#
# Before anything runs: every VMEM buffer of the kernel with its padded size (minor dim to
# 128 lanes, second minor to 8 rows of 32-bit / 16 of 16-bit). `vmem_budget` raises, naming
# the biggest buffers, when the total passes the chip's VMEM per core (try `slots=5000`).

# %%
block = BlockSizes(slots=slots, tile_k=tile_k, tile_n=tile_n)
if spec.kind == "tpu":
    budget = vmem_budget("stream_matmul", stream_matmul_buffers(
        x.shape[0], w.shape[0], w.shape[1], w.dtype, block), spec)
    display(plots.table(budget.rows()))
    print(f"total {budget.total_bytes / 2**20:.3f} MiB of {budget.limit_bytes / 2**20:.0f} MiB")
else:
    print(f"{spec.name} is a GPU: no VMEM budget")

# %% [markdown]
# ## The kernel, three versions
#
# The same kernel with 1, 2 and `slots` slots. In interpret mode the race detector
# watches every DMA and every read of a slot.

# %%
results = {}
for n in sorted({1, 2, slots}):
    block = BlockSizes(slots=n, tile_k=tile_k, tile_n=tile_n)
    start = time.perf_counter()
    with mk.backend.use(run.backend, detect_races=(mode == "interpret")):
        got = jax.block_until_ready(stream_matmul(x, w, block=block))
    seconds = time.perf_counter() - start
    results[n] = (got, mk.backend.races_found(), seconds)
    print(f"slots={n}: max |kernel - reference| = {float(jnp.abs(got - want).max()):.2e}, "
          f"races found: {results[n][1]}, wall {seconds:.2f} s ({mode})")

# %% [markdown]
# On CPU the wall time above is the interpret-mode **simulation** (a few milliseconds per
# simulated DMA): it says nothing about a TPU. The bytes do:

# %%
weight_bytes = w.size * w.dtype.itemsize
tiles = (w.shape[0] // tile_k) * (w.shape[1] // tile_n)
print(f"{tiles} tiles of {tile_k * tile_n * w.dtype.itemsize / 1024:.0f} KiB, "
      f"{weight_bytes / 1e6:.3f} MB in all")
print(f"HBM floor on {spec.name}: {weight_bytes / spec.hbm_bw * 1e6:.2f} us "
      f"at {spec.hbm_bw / 1e12:.2f} TB/s (datasheet peak)")

# %% [markdown]
# ## Compiled for a real TPU, with no TPU here
#
# The same kernel at the shape of qwen3-8b's MLP (x [8, 4096] @ W [4096, 12288], bf16),
# 512 x 1024 tiles, compiled ahead of time by libtpu's Mosaic compiler for the chosen chip.

# %%
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
real = BlockSizes(slots=slots, tile_k=512, tile_n=1024)
report = tpu.compile_for_chip(
    lambda a, b: stream_matmul(a, b, block=real),
    [jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
     jax.ShapeDtypeStruct((4096, 12288), jnp.bfloat16)], compile_chip, name="stream_matmul",
    vmem=vmem_budget("stream_matmul", stream_matmul_buffers(8, 4096, 12288, "bfloat16", real),
                     mk.chip(compile_chip)))
print(report.summary())
real_bytes = 4096 * 12288 * 2
print(f"that matmul moves {real_bytes / 2**20:.0f} MiB: HBM floor "
      f"{real_bytes / mk.chip(compile_chip).hbm_bw * 1e6:.0f} us on {compile_chip}")

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the slot count shows in time: with one slot every tile pays the DMA issue
# latency and the MXU idles while it waits; with a ring the DMA engine always has the next
# tile queued. On a TPU runtime (`backend="auto"`), the wall times printed above are real
# and can be set against the HBM floor. The later stages put many matrices, and then every
# layer, into one stream, so the ring never drains at a matrix or layer edge.
#
# **Takeaway:** a decode kernel is a DMA schedule with some arithmetic attached; the ring
# rule "consume g, issue g + slots" is the whole schedule.

# %%
for n, (got, races, _) in results.items():
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3, err_msg=f"slots={n}")
    assert not races, f"the race detector flagged slots={n}"
assert report.ok, report.error
print("checks passed")
