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
# # 05b · A gated-DeltaNet layer: a fixed state instead of a growing KV cache
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/05b_gated_deltanet.ipynb)
#
# Qwen3.5 is a hybrid: three of every four layers are gated DeltaNets (linear attention),
# which keep a recurrent state per sequence instead of KV rows. This notebook builds one
# such layer's decode step as one kernel and answers:
#
# - What does the layer compute, and what does the delta rule do to its state?
# - How does the kernel stream the projections, the conv state and the recurrent state?
# - How many bytes does a step move for the state, against a KV cache as context grows?
# - Is it exactly the reference, including the state after every row a verifier needs?
#
# **You will** run a gated-DeltaNet layer's step and find an unshifted conv state.
# **You will be able to** say what state a linear layer carries and what it costs
# against a KV cache. **Prerequisites:** 05 (one fused layer). Part II: another layer kind.

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
preset: str = "tiny-hybrid"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 2  # B, sequences decoded together
rows: int = 3  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "tpu7x"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
layer: int = -1  # which linear layer, counted among the linear layers; -1 is the last
bytes_preset: str = "qwen3.5-27b"  # the model whose state and KV bytes are drawn
exercise_unshifted_conv: bool = False  # the exercise: True writes row t's conv state unshifted

# %%
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import plotly.graph_objects as go
from IPython.display import display
from plotly.subplots import make_subplots

import mk
import mk.model.cache
import mk.kernels.backend
import mk.course.run
from mk.course import course
from mk.model import linear_attention, ops, reference
from mk import plots
from mk.kinds.linear import delta_rule, deltanet
from mk.kernels.common import vmem_budget
from mk.kernels.weight_streaming import stage_block
from mk.kernels.stream import TileStream

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode, spec = run.config, mk.kernels.backend.resolve(run.backend), mk.chip(run.chip)
if not config.linear_layers or config.channel_decay:
    raise ValueError(f"preset={config.name!r} has no gated-DeltaNet layers: choose a hybrid")
layer = config.linear_layers[layer]
Nk, Nv = config.linear_key_heads, config.linear_value_heads
Hk, Hv, W, C = config.linear_key_dim, config.linear_value_dim, config.conv_kernel, \
    config.conv_channels
print(f"{config.name} layer {layer} (linear): B={run.batch} T={run.rows}; {Nk} key heads, "
      f"{Nv} value heads, Hk={Hk} Hv={Hv}, conv width {W} over C={C} channels; kernels run "
      f"on: {mode}")

# %% [markdown]
# ## What the layer computes
#
# For each row, after the input RMSNorm h:
#
# 1. q, k, v = one projection `in_proj_qkv` (C = 2 Nk Hk + Nv Hv channels), then a
#    depthwise causal conv of width W over the last W rows (SiLU after). The W-1 previous
#    rows are the **conv state** [W-1, C].
# 2. q and k are L2-normalised per key head (q also / sqrt(Hk)); key head j serves value
#    heads j G .. j G + G-1 (G = Nv / Nk).
# 3. beta = sigmoid(h b), decay g = -exp(A_log) softplus(h a + dt_bias), one per value head.
# 4. The **delta rule** on the recurrent state S [Hk, Hv] of each value head:
#
#    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   out = q^T S
#
#    k^T S is what the state "remembers" under key k; the update moves it a fraction beta
#    toward v. It is a rank-1 write: one outer product per row and head.
# 5. out = RMSNorm(out) * w * SiLU(h z) per head (the gated norm), then `out_proj`, plus
#    the residual.
#
# One row of one head, drawn from the reference (`mk.model.linear_attention.delta_rule`):

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
keys = jax.random.split(jax.random.key(run.seed), 3)
x = jax.random.normal(keys[0], (run.batch, run.rows, config.hidden))
conv = jax.random.normal(keys[1], (run.batch, W - 1, C)).astype(config.dtype)
state = 0.1 * jax.random.normal(keys[2], (run.batch, Nv, Hk, Hv))  # a state mid-sequence
h = ops.rms_norm(x, params["attn_norm"][layer], config.rms_eps, config.norm_offset,
                 config.norm_width)
i = config.mixer_index(layer)[1]
q, k, v, _ = linear_attention.conv_qkv(config, params, i, h, conv)
beta = jax.nn.sigmoid(ops.matmul(h, params["lin_b"][i]))
k0, v0, b0, s0 = k[0, 0, 0], v[0, 0, 0], beta[0, 0, 0], state[0, 0]  # value head 0: key head 0
write = b0 * jnp.outer(k0, v0 - k0 @ s0)  # decay left out: exp(g) only scales S
recalled = k0 @ (s0 + write)  # what S returns for key k after the write
promised = (1 - b0) * (k0 @ s0) + b0 * v0
print(f"beta = {float(b0):.3f}, |k| = {float(jnp.linalg.norm(k0)):.6f}; max |k^T S_after - "
      f"((1 - beta) k^T S + beta v)| = {float(jnp.abs(recalled - promised).max()):.1e}")

# %%
titles = ("S before [Hk, Hv]", "the write k (beta (v - k^T S))^T", "S after")
fig = make_subplots(1, 3, subplot_titles=titles)
for col, m in enumerate((s0, write, s0 + write), start=1):
    fig.add_trace(go.Heatmap(z=np.asarray(m)[:32, :32], coloraxis="coloraxis"), 1, col)
fig.update_layout(title="The delta rule on one head (first 32 x 32 of the state): a rank-1 "
                  "write", coloraxis=dict(colorscale="RdBu", cmid=0))
fig.update_xaxes(title_text="value channel (index)")
fig.update_yaxes(title_text="key channel (index)")
plots.show(fig)

# %% [markdown]
# The printed difference is the delta rule's promise: after the write, what S returns for
# key k is (1 - beta) of the old memory plus beta of v, because k has unit length; other
# keys are disturbed only as far as they overlap k.
#
# ## The kernel: one stream, two states
#
# The projections in_proj_qkv, in_proj_z and out_proj are one `TileStream` through the
# ring of stage 01: out_proj's first tiles load while the conv and the delta rule compute.
# in_proj_b and in_proj_a have only Nv columns, narrower than a 128-lane ring tile, so
# they come by their own DMA (as a MoE router does in stage 04). The stream:

# %%
block = stage_block(deltanet.gated_deltanet_matrices(config), config.dtype)
stream = TileStream.build(block, deltanet.gated_deltanet_matrices(config))
tiles = f"{stream.total} tiles of {block.tile_rows}x{block.tile_cols}"
plots.show(plots.tile_stream(stream, title=f"{config.name} linear layer {layer}: {tiles}"))

# %% [markdown]
# The kernel body, in the order it runs. The recurrent state's first copy-in, the conv
# state and the b/a weights start before the first projection, so they land behind the
# weight stream:

# %%
plots.show_source(deltanet.gated_deltanet_kernel)

# %% [markdown]
# The conv: each sequence's window is its W-1 remembered rows, then its T new rows; the
# conv state after row t is window rows t+1 .. t+W-1, written for every row so a verifier
# that accepts k rows restarts from row k-1's:

# %%
plots.show_source(deltanet.conv_body, deltanet.conv_state_after)

# %% [markdown]
# The delta rule (`mk.kinds.linear.delta_rule`, whose `delta_rule_step` runs it alone too):
# sequence b+1's state copies in while sequence b computes, and b's T row states copy out
# while b+1 computes:

# %%
plots.show_source(delta_rule.delta_rule_body, delta_rule.delta_rule_head)

# %% [markdown]
# ## The check against the reference
#
# The reference layer (`mk.model.reference.linear_decoder_layer`, itself checked against
# transformers' Qwen3.5) returns x after the mixer and both states after every row. The
# kernel, in interpret mode with the race detector on:

# %%
start = time.perf_counter()
with (course.planted("conv_unshifted" if exercise_unshifted_conv else None),
      mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret"))):
    got = jax.block_until_ready(deltanet.gated_deltanet(config, params, x, conv, state,
                                                        layer=layer, block=block))
seconds, races = time.perf_counter() - start, mk.kernels.backend.races_found()
_, want_conv, want_state, want_x = reference.linear_decoder_layer(config, params, layer, x,
                                                                  conv, state)
want = dict(x=want_x, conv_rows=want_conv, state_rows=want_state)
for (name, w), g in zip(want.items(), got):
    print(f"{name} {tuple(g.shape)}: max |kernel - reference| = "
          f"{float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()):.2e}")
print(f"races: {mk.kernels.backend.races_text(races)}; wall {seconds:.2f} s on {mode}"
      + (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# **Exercise:** set `exercise_unshifted_conv = True`: `mk.course.course.planted("conv_unshifted")`
# makes the kernel write, as the conv state after row t, the window *before* row t. The
# layer's output x is unchanged (the conv itself reads the right rows), so a check of x
# alone passes; the conv-rows check in the last cell fails. A wrong state is invisible in
# this step's tokens and surfaces only when the next step (or a rollback) starts from it.

# %% [markdown]
# ## Bytes per step: a fixed state against a growing KV cache
#
# A linear layer reads its state once per step and writes it after each of the T rows;
# the state's size does not depend on context. A full-attention layer reads every cached
# position. Per sequence and step for `bytes_preset`, at T = 1:

# %%
big = mk.preset(bytes_preset)
contexts = [2**p for p in range(10, 19)]
per_position = mk.model.cache.bytes_per_position(big)  # KV of the full layers
per_sequence = mk.model.cache.state_bytes_per_sequence(big)  # the linear layers' states
state_bytes = 2 * per_sequence  # read, plus the state after the one row written
series = {f"linear state ({len(big.linear_layers)} layers)":
              [state_bytes / 2**20] * len(contexts),
          f"KV read ({len(big.full_layers)} full layers)":
              [per_position * s / 2**20 for s in contexts],
          f"KV if all {big.layers} layers were full":
              [per_position * big.layers / len(big.full_layers) * s / 2**20
               for s in contexts]}
fig = plots.lines(contexts, series, title=f"{big.name}: bytes per sequence per step (T = 1)",
                  xaxis="context (cached positions)",
                  yaxis="bytes per sequence (MiB)")
fig.update_xaxes(type="log")
plots.show(fig)
even = state_bytes / per_position
print(f"{big.name}: linear state {per_sequence / 2**20:.1f} MiB per sequence "
      f"(read + written: {state_bytes / 2**20:.1f} MiB per step); KV "
      f"{per_position / 1024:.0f} KiB per position: the state costs as much as "
      f"{even:,.0f} cached positions of the full layers")

# %% [markdown]
# For T > 1 (speculative verification) the state is written T times, once per row, so a
# rollback to any accepted row needs no recomputation; the recurrent state dominates
# (float32, Nv x Hk x Hv per layer), the conv state is (W-1) rows of C channels.
#
# ## VMEM budget at the real shape
#
# Every VMEM buffer of the kernel for `bytes_preset` at batch 8, T = 4, checked against
# the chip's VMEM per core (the TPU7x ahead-of-time compile of this shape is in
# tests/kernels/test_deltanet.py). The ring has two slots of the default tile here: at this
# B and T the whole layer's row states leave TPU7x no room for a third.

# %%
if spec.kind == "tpu":
    big_block = dataclasses.replace(
        stage_block(deltanet.gated_deltanet_matrices(big), big.dtype), slots=2)
    budget = vmem_budget("gated_deltanet",
                         deltanet.gated_deltanet_buffers(big, 8, 4, big_block), spec)
    display(plots.table(budget.rows()[:6]))
    print(f"total {budget.total_bytes / 2**20:.1f} MiB of {budget.limit_bytes / 2**20:.0f} MiB")

# %% [markdown]
# The row states, double-buffered, are the biggest buffers: 2 x T x Nv x Hk x Hv x 4
# bytes, growing with T. A deeper verification would write the row states per head
# instead of per sequence.
#
# ## What a TPU does differently
#
# On hardware the layer's time is its weight bytes over HBM bandwidth plus the state
# traffic, both streamed by DMA engines while the MXU and VPU compute. The delta rule
# itself is small matmuls per head and row ([8, Hk] x [Hk, Hv]) on a state already in
# VMEM; its inputs arrive in order, so nothing waits except the data dependencies:
# conv after qkv, the delta rule after the conv, out_proj after the gated norm.
#
# **Takeaway:** a gated-DeltaNet layer trades a KV cache that grows with context for a
# fixed float32 state, read once and written once per row; the kernel matches the
# reference on its output and on the state after every row.

# %% [markdown]
# ## Questions
#
# 1. What must a verifier get from a linear layer after T rows, and why?
#    <details><summary>Answer</summary>The state after every row: after acceptance it restarts from the state
#    after the last kept row (`mk.model.cache.rollback`).</details>

# %%
course.check_close("layer output x", got[0], want_x, rtol=1e-5, atol=1e-5)
course.check_close("state rows", got[2], want_state, rtol=1e-5, atol=1e-5)
course.check_close("conv rows", got[1], want_conv, rtol=0, atol=0)
course.check_race_free("gated DeltaNet layer", races)
print("checks passed")
