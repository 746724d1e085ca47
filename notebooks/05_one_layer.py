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
# # 05 · One fused layer: every op of a decoder layer in one kernel, one ring
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/05_one_layer.ipynb)
#
# Stages 01-04 built the pieces. This notebook puts a whole decoder layer into one
# `pallas_call` and answers:
#
# - What does the weight stream of one layer look like, tile by tile?
# - Why does one ring for all the layer's matrices beat one kernel per op?
# - Is the fused layer exactly the reference layer, and does it fit and compile on a TPU?
#
# **You will** run a whole decoder layer as one kernel on one ring and find a planted bug
# in its residual stream. **You will be able to** read `layer_body` phase by phase and say
# what fusing buys at a matrix edge. **Prerequisites:** 01 (the ring), 02-04 (the stage
# kernels this layer calls).

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
layer: int = -1  # which layer; -1 is the last (an MoE layer in tiny-moe)
slots: int = 3  # weight ring slots
solutions: bool = False  # True checks the worked solution in place of your fix (headless runs)

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
from mk.course import course, teach
from mk.model import ops, reference
from mk import plots
from mk.measure import tpu
from mk.step import one_layer as one_layer_module
from mk.kernels.common import vmem_budget
from mk.step.one_layer import one_layer, one_layer_buffers
from mk.step.plan import default_block
from mk.kernels.stream import TileStream
from mk.kinds.layers import kinds_at, layer_matrices
from mk.model.weights import abstract_params

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode, spec = run.config, mk.kernels.backend.resolve(run.backend), mk.chip(run.chip)
layer = layer % config.layers
kinds = kinds_at(config, layer)  # its token mixer and its MLP (`mk.kinds`)
kind = kinds[1].name
M = run.batch * run.rows
print(f"{config.name} layer {layer} ({kind}): B={run.batch} T={run.rows} S={run.context}; "
      f"kernels run on: {mode}")

# %% [markdown]
# ## The idea: one stream per layer
#
# The layer's matrices are one `TileStream`: wq, wk, wv, wo, then gate, up, down (or the
# expert slots, repeated once per slot and switched on only for the experts the router
# picked). The ring rule of stage 01 runs across all of them, so while attention walks the
# KV cache the first tiles of wo are already in VMEM, and while wo computes the MLP's
# tiles are in flight. The schedule is data; here it is, tile by tile:

# %%
block = default_block(config, 128, slots=slots)  # KV tiles of 128 positions
stream = TileStream.build(block, layer_matrices(kinds, M))
plots.show(plots.tile_stream(stream, title=f"{config.name} layer {layer}: {stream.total} "
                                           f"tiles of {block.tile_rows}x{block.tile_cols}"))

# %% [markdown]
# The same stream in time, slot by slot (`teach.ring_schedule` at the chip's modelled tile
# times): at each matrix edge the next matrix's tiles are already in flight, in their own
# colour, while the last tiles of the previous one compute. (Drawn for a dense layer: an
# MoE layer's expert slots are switched on at run time.)

# %%
if kind == "dense" and spec.kind == "tpu":
    times = teach.tile_times(spec, block, jnp.dtype(config.dtype).itemsize, M)
    plots.show(plots.ring_gantt(
        {f"{n} slots": teach.ring_schedule(stream, slots=n, **times) for n in sorted({2, slots})},
        title=f"{config.name} layer {layer}: every tile in its slot on {spec.name} (modelled)"))

# %% [markdown]
# One kernel per op would end the stream at every matrix edge: the next kernel's first
# DMA is issued only after the previous kernel finished, so each edge costs the previous
# ring's drain and one DMA latency with HBM idle (inside one jitted program there is no
# host launch between the kernels, but they still run one after the other). Fused, the only waits left are data
# dependencies (attention needs q, k, v; the experts need the router).

# %% [markdown]
# ## The reference and the kernel

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
keys = jax.random.split(jax.random.key(run.seed), 3)
x = jax.random.normal(keys[0], (run.batch, run.rows, config.hidden))
cache_shape = (config.layers, run.batch, config.kv_heads, run.context, config.head_dim)
k_cache = jax.random.normal(keys[1], cache_shape).astype(config.dtype)
v_cache = jax.random.normal(keys[2], cache_shape).astype(config.dtype)
# Non-zero positions; with T >= 2 sequence 0's new rows straddle the KV tile edge at 128.
positions = jnp.asarray(course.hard_positions(run.batch, run.rows, run.context, block.kv_tile))
print("positions", positions.tolist(), "rows per sequence", run.rows)
want_x, want_k, want_v, x_attn = reference.decoder_layer(config, params, layer, x, k_cache[layer],
                                                    v_cache[layer], positions)

# %% [markdown]
# The layer's body, as the megakernel calls it once per layer: the prologue of 02,
# `attend` of 03, wo, then the MLP block of 04 (dense or MoE), all on one ring:

# %%
plots.show_source(one_layer_module.layer_body)

# %% [markdown]
# Every stage is a call on the same `ring` object, so the tile counter g runs on from wq
# to w_down without a break; `all_reduce` is None on one device (10 passes the in-kernel
# collective). The kernel, in interpret mode with the race detector on:

# %%
start = time.perf_counter()
with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
    got_x, got_k, got_v = jax.block_until_ready(
        one_layer(config, params, x, k_cache, v_cache, positions, layer=layer, block=block))
seconds, races = time.perf_counter() - start, mk.kernels.backend.races_found()
error = float(jnp.abs(got_x - want_x).max())
print(f"max |kernel - reference| of the layer output: {error:.2e} "
      f"(largest value {float(jnp.abs(want_x).max()):.2f}); races: {mk.kernels.backend.races_text(races)}")
print(f"wall {seconds:.2f} s on {mode}" + (" (a CPU simulation, not TPU time)"
                                          if mode == "interpret" else ""))

# %% [markdown]
# ## Exercise: a wrong residual
#
# `layer_body` adds each block's output to the residual stream with `residual(x, out)`.
# Below, a version with a mistake is planted in the kernel (`course.planted("wrong_residual")`).
# **Predict** before you run: the megakernel's debug path taps the stream after each
# layer's attention ("attn") and MLP ("mlp"); which tap of layer 0 will `first_divergence`
# name? **Fix** a copy: `my_residual` must make the fused layer match the reference.

# %%
plots.show_source(course.SEAMS["wrong_residual"][2])
with course.planted("wrong_residual"), mk.kernels.backend.use(run.backend):
    bad_x = one_layer(config, params, x, k_cache, v_cache, positions, layer=layer, block=block)[0]
try:
    course.check_close("layer output", bad_x, want_x, rtol=2e-2, atol=3e-2)
except course.ExerciseFailed as caught:
    print("the check catches it:", caught)

# %% [markdown]
# Write your fix in the next cell; its check fails until you do. `solutions = True`
# (parameters cell) checks the worked solution instead; `course.reveal("05-residual")`
# answers the prediction (in Jupyter or Colab, run `mk.step.megakernel.first_divergence` inside
# `course.planted("wrong_residual")` to see it).

# %%
def my_residual(x, block_out):
    """The residual stream after a block, x and block_out both [M, D] f32: what should
    `residual` return?"""
    ...


checked = course.attempt("05-residual", my_residual, solutions)
with course.replaced("wrong_residual", checked), mk.kernels.backend.use(run.backend):
    fixed_x = one_layer(config, params, x, k_cache, v_cache, positions, layer=layer,
                        block=block)[0]
course.check_close("layer output with the fixed residual", fixed_x, want_x, rtol=2e-2,
                   atol=3e-2)
print("the residual passes")

# %% [markdown]
# ## VMEM budget

# %%
if spec.kind == "tpu":
    budget = vmem_budget("one_layer", one_layer_buffers(config, kinds, run.batch, run.rows,
                                                        block), spec)
    display(plots.table(budget.rows()[:8]))
    print(f"total {budget.total_bytes / 2**20:.2f} MiB of {budget.limit_bytes / 2**20:.0f} MiB")

# %% [markdown]
# ## Compiled for a real TPU at real shapes
#
# One layer of qwen3-8b (dense) and of qwen3-30b-a3b (MoE: 128 experts, top-8), batch 8,
# 4096 cached positions, KV tiles of 256.

# %%
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
reports = {}
for name in ("qwen3-8b", "qwen3-30b-a3b"):
    real = mk.preset(name).first_layers(2)
    real_block = default_block(real, 4096, slots=slots)
    shapes = abstract_params(real)
    cache = jax.ShapeDtypeStruct((2, 8, real.kv_heads, 4096, real.head_dim), real.dtype)
    reports[name] = tpu.compile_for_chip(
        lambda p, a, k, v, pos: one_layer(real, p, a, k, v, pos, layer=1, block=real_block),
        [shapes, jax.ShapeDtypeStruct((8, 1, real.hidden), jnp.float32), cache, cache,
         jax.ShapeDtypeStruct((8,), jnp.int32)], compile_chip, name=f"{name} layer",
        vmem=vmem_budget("one_layer", one_layer_buffers(real, kinds_at(real, 1), 8, 1,
                                                        real_block), mk.chip(compile_chip)))
    print(reports[name].summary())

# %% [markdown]
# ## Bytes and the roofline
#
# The layer's weights (for MoE, the experts this batch touched) plus the KV tiles read.

# %%
itemsize = jnp.dtype(config.dtype).itemsize
attention_bytes = config.hidden * (2 * config.q_width + 2 * config.kv_width) * itemsize
if kind == "dense":
    mlp_bytes = 3 * config.hidden * config.ffn * itemsize
else:  # the experts the router picks for this batch (the reference's routing)
    h = ops.rms_norm(x_attn, params["mlp_norm"][layer], config.rms_eps,
                     width=config.norm_width).reshape(M, -1)
    _, experts = ops.route(h, params["router"][config.mlp_index(layer)[1]],
                           config.experts_per_token, config.norm_topk)
    touched = len(np.unique(np.asarray(experts)))
    mlp_bytes = touched * config.expert_params * itemsize
    print(f"{touched} of {config.experts} experts touched by {M} rows")
kv_bytes = int(sum((p + run.rows - 1) // block.kv_tile + 1 for p in positions.tolist())
               * block.kv_tile * 2 * config.kv_width * itemsize)
total = attention_bytes + mlp_bytes + kv_bytes
print(f"weights {(attention_bytes + mlp_bytes) / 1e6:.3f} MB + KV {kv_bytes / 1e6:.3f} MB: "
      f"HBM floor {total / spec.hbm_bw * 1e6:.2f} µs on {spec.name} (datasheet peak)")

# %% [markdown]
# In an MoE layer the stream holds every expert slot, but only the slots of the experts this
# batch picked are loaded; the others are skipped in order (grey marks), so the tiles behind
# them are issued at once (modelled, every slot's tiles issued as if routing were done):

# %%
if kind == "moe" and spec.kind == "tpu":
    times = teach.tile_times(spec, block, jnp.dtype(config.dtype).itemsize, M)
    plots.show(plots.ring_gantt({f"{slots} slots": teach.ring_schedule(
        stream, slots=slots, active=teach.first_copies(touched), **times)},
        title=f"{config.name} layer {layer}: {touched} live expert slots of "
              f"{stream.segment('we_gate').copies} on {spec.name} (modelled)"))

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the fused layer's time is its bytes over HBM bandwidth plus the waits the
# stream cannot hide: the router before the experts, and the latency of the first tiles
# of the layer. The megakernel (next stage) removes the last one by running the same
# stream across layers: the next layer's wq tiles load while this layer's MLP computes.
#
# **Takeaway:** a whole layer is one DMA schedule, and the fused kernel is exactly the
# reference layer up to bf16 rounding.

# %% [markdown]
# ## Questions
#
# 1. The layer's stream is wq, wk, wv, wo, gate, up, down. While attention walks the KV
#    cache, which weight tiles are in VMEM? <details><summary>Answer</summary>wo's first
#    `slots` tiles: the ring issued them when wv's last tiles were consumed.</details>
# 2. An MoE layer has 8 expert slots but the batch picks 3 experts. What happens to the 5
#    other slots' tiles? <details><summary>Answer</summary>They are skipped: neither loaded
#    nor computed, but "consumed" in order so the tiles behind them are issued
#    (`Ring.skip`).</details>
# 3. Why does the plant above change the layer output but not the KV cache?
#    <details><summary>Answer</summary>The cache rows come from the layer's input x
#    (normed and projected) before any residual add.</details>

# %% [markdown]
# ## Checks

# %%
course.check_close("layer output", got_x, want_x, rtol=2e-2, atol=3e-2)
course.check_close("v cache", got_v[layer], want_v, rtol=0, atol=0)
course.check_close("k cache", got_k[layer], want_k, rtol=1e-2, atol=1e-2)
course.check_race_free("fused layer", races)
assert all(r.ok for r in reports.values()), {n: r.error for n, r in reports.items()}
print("checks passed")
