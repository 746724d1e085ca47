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
# # 06 · The decode megakernel: a whole decode step in one kernel
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/06_megakernel.ipynb)
#
# Every layer, the final norm, the lm_head and the greedy argmax in one `pallas_call`, with
# one weight ring that never stops at a layer edge. This notebook answers:
#
# - What is the tile schedule of a whole step, and where do the layer boundaries fall?
# - What does "cross-layer prefetch" mean, tile by tile?
# - Does the megakernel produce exactly the reference's tokens, and does a real model
#   compile for a real TPU?

# %% tags=["hide-input"]
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
steps: int = 6  # greedy tokens to generate
slots: int = 3  # weight ring slots

# %%
import time

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display

import mk
import mk.backend
import mk.megakernel as megakernel
import mk.run
from mk import plots, reference, tpu
from mk.kernels.plan import DecodePlan, default_block

run = mk.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode, spec = run.config, mk.backend.resolve(run.backend), mk.chip(run.chip)
block = default_block(config, 128, slots=slots)  # KV tiles of 128 positions
print(f"{config.name}: {config.layers} layers, B={run.batch} T={run.rows} S={run.context}; "
      f"kernels run on: {mode}")

# %% [markdown]
# ## The schedule is data
#
# One device's step is a `DecodePlan` (`mk.kernels.plan`): the shard, the tiles, every
# VMEM buffer by name and one `TileStream`, the layer's matrices repeated for every layer,
# then the lm_head. Tile g lives in ring slot g mod slots; consuming tile g issues tile
# g + slots. Below is the stream of a generation step (one row per sequence, M = B).

# %%
plan = DecodePlan.make(config, batch=run.batch, context=run.context, block=block)
stream = plan.stream
print(f"{stream.total} tiles of {block.tile_k}x{block.tile_n}: {stream.period} per layer, "
      f"{stream.total - config.layers * stream.period} of lm_head; ring of {block.slots} "
      f"slots")
plots.show(plots.tile_stream(stream, title=f"{config.name}: one decode step's weight tiles"))

# %% [markdown]
# ## Cross-layer prefetch
#
# The last tiles of layer 0 and the first of layer 1. When layer 0's last tile is
# consumed, the next `slots - 1` tiles (layer 1's wq) are already in flight: the DMA
# engine never waits for the layer edge. (In an MoE layer the expert tiles are the one
# exception: they wait for the router.)

# %%
edge = stream.period
table = stream.table(np.dtype(config.dtype).itemsize)
display(plots.table([{**r, "in flight when g=" + str(edge - 1) + " is consumed":
                      "yes" if edge - 1 < r["g"] < edge - 1 + block.slots else ""}
                     for r in table[edge - 3:edge + block.slots]]))

# %% [markdown]
# ## The megakernel on the page
#
# `mk.megakernel.megakernel_kernel`, from the module: the refs arrive as named pytrees
# (weights left in HBM, scratch in VMEM and SMEM), one `Ring` over the whole step's
# `TileStream`, `ring.prime()` once, then a `lax.fori_loop` over the layers whose body is
# stage 05's layer body, then the lm_head and the argmax. Nothing between layers drains
# the ring: that is cross-layer prefetch.

# %%
plots.show_source(megakernel.megakernel_kernel)

# %% [markdown]
# ## The reference and the megakernel
#
# The prompt is prefilled by the XLA reference; every following token is one megakernel
# call (decode step) in `mk.megakernel.generate`.

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
prompt = jax.random.randint(jax.random.key(run.seed), (run.batch, 5), 0, config.vocab)
want = reference.generate(config, params, prompt, steps)
start = time.perf_counter()
got = megakernel.generate(config, params, prompt, steps, backend=run.backend, block=block,
                          progress=True)
seconds = time.perf_counter() - start
print("reference  :", want.tolist())
print("megakernel :", got.tolist())
print(f"{steps - 1} megakernel steps in {seconds:.1f} s on {mode}" +
      (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# ## Verifying T rows in one weight pass
#
# Speculative decoding checks `rows` drafted tokens per sequence in one step: the same
# kernel with T = `rows` query rows, causal among themselves, one pass over the weights.

# %%
_, cache = reference.prefill(config, params, prompt, max_context=run.context)
drafted, positions = want[:, :run.rows], jnp.full((run.batch,), prompt.shape[1], jnp.int32)
want_rows = reference.greedy(reference.decode_step(config, params, cache, drafted,
                                                   positions)[0])
with mk.backend.use(run.backend):
    got_rows, _, _ = megakernel.decode_step(config, megakernel.prepare(config, params, block),
                                            cache, drafted, positions, block=block)
print(f"T={run.rows}: reference {want_rows.tolist()}, megakernel {got_rows.tolist()}")

# %% [markdown]
# ## When tokens differ: the staged debug path
#
# `first_divergence` runs one step through the reference and through the megakernel with
# taps on the residual stream after every layer's attention and MLP blocks, compares them
# in execution order up to `stop_after=(layer, op)`, and names the first op whose error
# exceeds 1% of the activations' scale. Healthy, every op agrees to bf16 rounding; with a
# planted bug (one weight of layer 0's attention output projection changed in the
# megakernel's copy only) it points at that op.

# %%
debug_tokens, debug_positions = want[:, :1], jnp.full((run.batch,), prompt.shape[1], jnp.int32)
first, report_ = megakernel.first_divergence(config, params, cache, debug_tokens,
                                             debug_positions, block=block, backend=run.backend)
display(plots.table(report_))
weights = megakernel.prepare(config, params, block)
planted = weights | {"wo": weights["wo"].at[0, 0, 0].add(1.0)}
planted_first, _ = megakernel.first_divergence(config, params, cache, debug_tokens,
                                               debug_positions, block=block,
                                               backend=run.backend, weights=planted)
print(f"healthy: first divergence {first}; planted bug in wo[0]: first divergence "
      f"{planted_first}")

# %% [markdown]
# ## VMEM budget and a real compile
#
# The buffers of this run, then the whole megakernel of a real model compiled ahead of time
# for the chosen chip (qwen3-1.7b on v5e, whose 16 GiB do not hold qwen3-8b; qwen3-8b
# elsewhere), batch 8, 4096 cached positions.

# %%
if spec.kind == "tpu":
    fit = DecodePlan.make(config, batch=run.batch, rows=run.rows, context=run.context,
                          block=block).fits(spec)  # the T-row step: the larger one
    if not fit.ok:
        raise ValueError(fit.error)
    print(f"VMEM: {fit.vmem.total_bytes / 2**20:.2f} MiB of "
          f"{fit.vmem.limit_bytes / 2**20:.0f} MiB; biggest {fit.vmem.rows()[0]['buffer']}")
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
real = mk.preset("qwen3-1.7b" if compile_chip == "v5e" else "qwen3-8b")
report = tpu.compile_megakernel(real, compile_chip, batch=8, rows=1, context=4096)
print(report.summary())

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the step's time is its bytes over HBM bandwidth plus what the stream cannot
# hide: the first tiles of the step, each MoE layer's routing, and attention's KV tiles
# (which have their own ring). Everything else overlaps. The performance model of a later
# notebook replays this same `TileStream` on a chip model to show where the bubbles are.
#
# **Takeaway:** the megakernel is the stage kernels' pieces in a layer loop, with one tile
# schedule for the whole step, and it produces exactly the reference's greedy tokens.

# %%
np.testing.assert_array_equal(got, want)
np.testing.assert_array_equal(got_rows, want_rows)
assert first is None and planted_first == (0, "attn"), (first, planted_first)
assert report.ok, report.error
print("checks passed")
