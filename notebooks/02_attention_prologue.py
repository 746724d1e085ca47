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
# # 02 · The attention prologue: norm, Q/K/V, QK-norm, RoPE in one kernel
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/02_attention_prologue.ipynb)
#
# Before attention can look at the cache, each layer turns the residual stream into
# queries, keys and values. This notebook answers:
#
# - How do three weight matrices share one ring, so the K and V tiles load while Q computes?
# - How are QK-norm and rotate-half RoPE done on TPU vregs (a lane roll, not a gather)?
# - What does the prologue cost in bytes, and where is it on the roofline?
#
# **You will** run the attention prologue as one kernel on one ring and find RoPE
# switched off. **You will be able to** explain rotate-half RoPE as a lane roll and why
# position 0 hides it. **Prerequisites:** 01 (the ring).

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
rows: int = 2  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v6e"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
layer: int = 0  # which layer's weights the prologue reads
slots: int = 3  # weight ring slots
exercise_rope_off: bool = False  # the exercise: True runs the kernel with RoPE switched off

# %%
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display

import mk
import mk.kernels.backend
import mk.course.run
from mk.course import course
from mk import plots
from mk.model import reference
from mk.measure import tpu
from mk.kinds.attention.attention_prologue import (attention_prologue, attention_prologue_buffers,
                                           normalise_heads, prologue, rope_rows)
from mk.kernels.common import BlockSizes, vmem_budget
from mk.model.weights import abstract_params

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode, spec = run.config, mk.kernels.backend.resolve(run.backend), mk.chip(run.chip)
if not 0 <= layer < config.layers:
    raise ValueError(f"layer={layer} must be in [0, {config.layers})")
print(f"{config.name}: B={run.batch} T={run.rows} layer {layer}; kernels run on: {mode}")

# %% [markdown]
# ## The idea
#
# $h = \mathrm{RMSNorm}(x)$, then $q = hW_q$, $k = hW_k$, $v = hW_v$: three matrices, one
# stream. The ring does not stop between them: while the last tiles of $W_q$ compute, the
# first tiles of $W_k$ are already in flight. Then, per head, Qwen3's QK-norm (an RMSNorm
# over the head dim) and RoPE at the row's absolute position $p = \text{positions}[b] + t$:
#
# $$\mathrm{rope}(x) = x \cos(p\,\omega) + \mathrm{rotate\_half}(x)\sin(p\,\omega),\quad
#   \mathrm{rotate\_half}([x_1, x_2]) = [-x_2, x_1],\quad
#   \omega_i = \theta^{-2(i \bmod H/2)/H}.$$
#
# On a TPU `rotate_half` is `pltpu.roll(x, H/2)` (a lane rotation) times a sign vector.

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
x = jax.random.normal(jax.random.key(run.seed), (run.batch, run.rows, config.hidden))
# Sequence b starts at the last row of tile b: never 0, where RoPE is the identity and a
# RoPE bug would pass; with T >= 2 the rows straddle a tile edge.
positions = jnp.asarray(course.hard_positions(run.batch, run.rows, run.context))
want = reference.attention_inputs(config, params, layer, x, positions)
print("positions", positions.tolist(), "-> q", want[0].shape, "k", want[1].shape)

# %% [markdown]
# ## The kernel on the page
#
# `prologue` is the in-kernel body that the fused layer (05) and the megakernel (06) call
# with their own ring: RMSNorm into a VMEM scratch `h_vmem`, three `ring.matmul`s that
# continue one tile stream (stage 01's ring), then per head QK-norm and RoPE in place.

# %%
plots.show_source(prologue, normalise_heads, rope_rows)

# %% [markdown]
# `rope_rows` builds the angle table from iotas (no table in HBM), and `rotate_half` is
# `pltpu.roll` by H/2 lanes times a sign: -1 on the first half. `pos` comes from the
# per-sequence positions in SMEM (`row_positions`), one absolute position per row.
#
# **Exercise:** set `exercise_rope_off = True`: `mk.course.course.planted("rope_off")` replaces
# `rope_rows` by the identity. At position 0 that is correct (cos 0 = 1, sin 0 = 0), so a
# test at position 0 would pass; at this run's positions the check below fails.

# %%
block = BlockSizes(slots=slots, tile_rows=128, tile_cols=128)
start = time.perf_counter()
with (course.planted("rope_off" if exercise_rope_off else None),
      mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret"))):
    got = jax.block_until_ready(attention_prologue(config, params, x, positions, layer=layer,
                                                   block=block))
seconds, races = time.perf_counter() - start, mk.kernels.backend.races_found()
errors = {n: float(jnp.abs(g - w).max()) for n, g, w in zip("qkv", got, want)}
print(f"max |kernel - reference|: {errors}; races: {mk.kernels.backend.races_text(races)}")
print(f"wall {seconds:.2f} s on {mode}" + (" (a CPU simulation, not TPU time)"
                                          if mode == "interpret" else ""))

# %% [markdown]
# ## VMEM budget and bytes

# %%
M = run.batch * run.rows
if spec.kind == "tpu":
    budget = vmem_budget("attention_prologue", attention_prologue_buffers(config, M, block),
                         spec)
    display(plots.table(budget.rows()))
weight_bytes = config.hidden * (config.q_width + 2 * config.kv_width) * \
    jnp.dtype(config.dtype).itemsize
print(f"weights streamed: {weight_bytes / 1e6:.3f} MB -> HBM floor "
      f"{weight_bytes / spec.hbm_bw * 1e6:.3f} µs on {spec.name} (datasheet peak)")

# %% [markdown]
# ## Compiled for a real TPU at qwen3-8b's shape
#
# One layer of qwen3-8b (D=4096, 32 query heads, 8 kv heads, H=128), 8 rows, 512 x 1024
# tiles.

# %%
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
real = dataclasses.replace(mk.preset("qwen3-8b"), layers=1)
real_block = BlockSizes(slots=slots, tile_rows=512, tile_cols=1024)
shapes = abstract_params(real)
report = tpu.compile_for_chip(
    lambda p, a, pos: attention_prologue(real, p, a, pos, block=real_block),
    [shapes, jax.ShapeDtypeStruct((8, 1, real.hidden), jnp.float32),
     jax.ShapeDtypeStruct((8,), jnp.int32)], compile_chip, name="attention_prologue",
    vmem=vmem_budget("attention_prologue", attention_prologue_buffers(real, 8, real_block),
                     mk.chip(compile_chip)))
print(report.summary())
real_bytes = real.hidden * (real.q_width + 2 * real.kv_width) * 2
print(f"qwen3-8b prologue weights {real_bytes / 2**20:.0f} MiB: HBM floor "
      f"{real_bytes / mk.chip(compile_chip).hbm_bw * 1e6:.1f} µs per layer on {compile_chip}")

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the norm, QK-norm and RoPE are a few vector ops per head on data already in
# VMEM; the time is at best the 3 matrices' bytes over the bandwidth the DMA engine reaches
# (under the datasheet's: notebook 13 measures it), as long as the ring keeps a DMA in
# flight. In the fused layer (stage 05) this stream continues straight into the output
# projection and the MLP; notebook 06's table shows how far whole steps measured on a v5e
# sit above that floor.
#
# **Takeaway:** the prologue is bandwidth, not arithmetic; its only subtlety is the
# per-row RoPE position, built in the kernel from the per-sequence positions in SMEM.

# %% [markdown]
# ## Questions
#
# 1. Why does the default put sequence 0 at position 127 with T = 2?
#    <details><summary>Answer</summary>RoPE is the identity at position 0, so a bug there hides; rows 127 and
#    128 also straddle the KV tile edge at 128.</details>

# %%
for n, g, w in zip("qkv", got, want):
    course.check_close(n, g, w, rtol=1e-5, atol=1e-4)
course.check_race_free("prologue", races)
assert report.ok, report.error
print("checks passed")
