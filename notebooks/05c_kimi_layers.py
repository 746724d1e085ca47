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
# # 05c · Kimi's layers: MLA over a latent cache, Kimi Delta Attention, a shared-expert MoE
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/05c_kimi_layers.ipynb)
#
# The model behind the release's headline number is a Kimi K3: Kimi Linear's layer kinds
# (transformers' `kimi_linear`). Three of every four layers are Kimi Delta Attention (KDA),
# every fourth is Multi-head Latent Attention (MLA), and the MoE layers route with a
# biased sigmoid router and add a shared expert. This notebook runs each piece as a stage
# kernel against the reference and answers:
#
# - How many bytes does a cached token cost with MLA, against GQA and against MLA's own
#   per-head keys and values?
# - How does the absorbed form let attention read only the latent cache, and is it the
#   reference's layer?
# - What does KDA change in the gated DeltaNet (notebook 05b), and does the kernel keep the
#   state after every row?
# - How does Kimi's router choose, and where does the shared expert stream?
# - How does the megakernel run MLA between its ring and `attend`, and what does one
#   device of Kimi K3's TP32 step hold in VMEM?
#
# The sections run each piece as a stage kernel; the last runs the whole model in the
# megakernel (`mk.kinds.attention.mla` holds its MLA prologue and epilogue).
#
# **You will** run MLA, Kimi Delta Attention and the grouped router as stage kernels and
# find a per-head decay where KDA has one per channel. **You will be able to** compare
# MLA's cache bytes with GQA's. **Prerequisites:** 03, 04, 05b, 06. Part II.

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
preset: str = "tiny-kimi"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 2  # B, sequences decoded together
rows: int = 2  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "tpu7x"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
bytes_preset: str = "kimi-k2-shaped"  # the Kimi Linear model whose cache bytes are drawn
gqa_preset: str = "kimi-k3-like"  # the GQA model it is drawn against
exercise_head_decay: bool = False  # the exercise: True decays all of a head's channels alike

# %%
import time

import jax
import jax.numpy as jnp
import numpy as np
import plotly.graph_objects as go
from IPython.display import display

import mk
import mk.model.cache
import mk.kernels.backend
from mk.step.plan import DecodePlan
import mk.course.run
from mk import colours, plots
from mk.course import course
from mk.model import linear_attention, ops, reference
from mk.step import megakernel
from mk.kinds.attention import decode_attention, mla
from mk.kinds.linear import deltanet
from mk.kinds.mlp import joined_experts, mlp
from mk.kinds.mlp import routing as routing_module
from mk.kernels.common import BlockSizes

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode = run.config, mk.kernels.backend.resolve(run.backend)
if not (config.is_mla and config.channel_decay and config.shared_expert_ffn):
    raise ValueError(f"preset={config.name!r} is not Kimi Linear (MLA, KDA and a shared "
                     f"expert): choose one of {mk.model.presets.KIMI_PRESET_NAMES}")
B, T, S = run.batch, run.rows, run.context
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
keys = jax.random.split(jax.random.key(run.seed), 5)
x = jax.random.normal(keys[0], (B, T, config.hidden))  # the residual stream entering a layer
print(f"{config.name}: layers {config.layer_types}; MLA: {config.heads} heads of "
      f"{config.head_dim} (no-RoPE {config.head_dim - config.rope_dim} + shared "
      f"{config.rope_dim}), latent rank {config.latent_rank}; KDA: {config.linear_value_heads} "
      f"heads of {config.linear_key_dim}; MoE: {config.experts} experts, top "
      f"{config.experts_per_token} of the best {config.topk_groups} of {config.expert_groups} "
      f"groups, a shared expert of {config.shared_expert_ffn}; B={B} T={T}; kernels run on: "
      f"{mode}")

# %% [markdown]
# ## MLA: what a cached token costs
#
# A GQA layer caches, per token, K and V of its kv heads: 2 x K x H values. MLA caches one
# latent row of kv_lora_rank values (normed) plus the key part every head shares, R + Hr
# values, and rebuilds each head's key and value from it with the up-projection wkv_b.
# Per layer, and for the whole model per token, against the same heads' keys and values
# cached whole and against the GQA stand-in `gqa_preset`:

# %%
big, gqa = mk.preset(bytes_preset), mk.preset(gqa_preset)
item = big.weight_bits // 8
per_layer = {
    f"{big.name}: MLA latent (R + Hr = {big.latent_width})": big.latent_width * item,
    f"{big.name}: its heads' K and V cached whole": big.heads * (big.head_dim + big.value_dim)
    * item,
    f"{gqa.name}: GQA K and V ({gqa.kv_heads} kv heads of {gqa.head_dim})":
        2 * gqa.kv_width * gqa.weight_bits // 8}
fig = go.Figure(go.Bar(x=list(per_layer.values()), y=list(per_layer), orientation="h"))
fig.update_layout(title="Cache bytes per token, one attention layer",
                  xaxis_title="cache (bytes per token)", yaxis_title="layer", height=300,
                  margin=dict(l=380))
plots.show(fig)
for label, n in per_layer.items():
    print(f"{label}: {n:,} bytes")
big_position, gqa_position = mk.model.cache.bytes_per_position(big), mk.model.cache.bytes_per_position(gqa)
print(f"whole model per token: {big.name} {big_position:,} bytes "
      f"({len(big.full_layers)} MLA layers), {gqa.name} {gqa_position:,} bytes "
      f"({len(gqa.full_layers)} GQA layers): "
      f"{gqa_position / big_position:.1f}x")

# %% [markdown]
# With only one layer in four MLA and the rest KDA (a fixed state per sequence), the
# bytes one step reads per sequence hardly grow with context:

# %%
contexts = [2**p for p in range(10, 18)]
series = {f"{big.name}: latent cache + KDA state":
              [(big_position * s + 2 * mk.model.cache.state_bytes_per_sequence(big)) / 2**20
               for s in contexts],
          f"{gqa.name}: KV cache": [gqa_position * s / 2**20 for s in contexts]}
fig = plots.lines(contexts, series, title="Cache and state bytes per sequence per step "
                  "(T = 1)", xaxis="context (cached positions)",
                  yaxis="bytes per sequence (MiB)")
fig.update_xaxes(type="log")
plots.show(fig)

# %% [markdown]
# ## MLA's absorbed decode
#
# The reference (`mk.model.reference.mla_decoder_layer`, checked against transformers) expands
# the whole latent cache into per-head keys and values every step. A decode kernel must
# not: that is heads x (H + Ho) values per cached token instead of R + Hr. Head n's key for
# a cached latent c and shared part r is [c wkv_b_k(n), r], so
#
#   q . key = (wkv_b_k(n) q_nope) . c + q_rope . r
#
# and the head's query can be moved into the latent space once per step ("absorbed"):
# every head then attends over the latent rows themselves, one shared "kv head", and its
# output P @ c times wkv_b_v(n) is the head's P @ values:

# %%
plots.show_source(reference.mla_absorbed, reference.mla_output)

# %% [markdown]
# The kernel is stage 03's `attend` without values: each latent tile is loaded once and
# serves as keys and, its first R lanes, as values; the scale stays the unabsorbed head's
# 1/sqrt(H):

# %%
plots.show_source(decode_attention.latent_attention)

# %% [markdown]
# The check: the reference's MLA layer against absorbed queries -> `latent_attention` ->
# the value up-projection -> wo, on a cache of random rows, with sequence 1's new rows
# past the first KV tile:

# %%
layer, a = config.full_layers[0], 0
cache = (0.5 * jax.random.normal(keys[1], (1, B, S, config.latent_width))).astype(config.dtype)
positions = jnp.array([3 + 130 * (b % 2) for b in range(B)], jnp.int32)
_, want_latent, want_mla = reference.mla_decoder_layer(config, params, layer, x, cache[a],
                                                       positions)
h = ops.rms_norm(x, params["attn_norm"][layer], config.rms_eps,
                 width=config.norm_width).reshape(B * T, -1)
queries, latent, up_v = reference.mla_absorbed(config, params, a, h)
start = time.perf_counter()
with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
    o, got_cache = jax.block_until_ready(decode_attention.latent_attention(
        queries, latent, cache, positions, layer=a, scale=1 / np.sqrt(config.head_dim),
        block=BlockSizes(kv_tile=128, kv_slots=2)))
mla_seconds, mla_races = time.perf_counter() - start, mk.kernels.backend.races_found()
got_mla = x + ops.matmul(reference.mla_output(config, o, up_v),
                         params["wo"][a]).reshape(B, T, -1)
mla_scale = float(jnp.abs(want_mla - x).max())
print(f"x after MLA: max |kernel - reference| = {float(jnp.abs(got_mla - want_mla).max()):.2e}"
      f" (the attention output's scale {mla_scale:.2f}); latent rows written equal: "
      f"{bool(jnp.array_equal(got_cache[a], want_latent))}; races: {mk.kernels.backend.races_text(mla_races)}; wall "
      f"{mla_seconds:.2f} s on {mode}"
      + (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# The two forms round differently (the absorbed query is rounded to the cache dtype once,
# the reference rounds every expanded key), so they agree to a fraction of a percent of
# the output's scale, not bit for bit; the latent rows the kernel writes are the
# reference's exactly.
#
# ## Kimi Delta Attention against the gated DeltaNet
#
# KDA is notebook 05b's layer with three changes: the decay is one per **key channel**,
# from a low-rank forget gate (h f_a f_b, rank Hk); the output gate is a low-rank sigmoid
# gate (h g_a g_b) where the gated DeltaNet had z and SiLU; and q, k and v have the same
# head count. So the state update reads S <- diag(exp(g)) S: each row of a head's state
# [Hk, Hv] fades at its own rate. One step's decays for sequence 0, row 0, from the
# reference (`mk.model.linear_attention.kda_decay`):

# %%
linear = config.linear_layers[-1]
i = config.mixer_index(linear)[1]
h_lin = ops.rms_norm(x, params["attn_norm"][linear], config.rms_eps, width=config.norm_width)
decay = np.exp(np.asarray(linear_attention.kda_decay(config, params, i, h_lin))[0, 0])  # [Nv, Hk]
fig = go.Figure(go.Heatmap(z=decay, colorscale="Viridis", colorbar=dict(title="exp(g)")))
fig.update_layout(title=f"KDA layer {linear}: the decay of each key channel (row 0)",
                  xaxis_title="key channel (index)", yaxis_title="head (index)",
                  height=300)
plots.show(fig)
print(f"decays from {decay.min():.3f} to {decay.max():.3f}; the spread within a head: up "
      f"to {float(np.max(decay.max(1) - decay.min(1))):.3f} (a gated DeltaNet's is 0)")

# %% [markdown]
# In the kernel the per-channel decays are blocked per (sequence, head) beside q and k,
# and row t's decays become the column that scales the state's rows. The four low-rank
# weights (rank Hk, printed above: narrower than a ring tile can be) come by their own
# DMA; the ring streams in_proj_qkv and out_proj:

# %%
plots.show_source(deltanet.kda_gates_body, linear_attention.kda_log_decay,
                  deltanet.channel_column)

# %% [markdown]
# The check against the reference layer (x after the mixer, the conv and recurrent states
# after every row):

# %%
conv = jax.random.normal(keys[2], (B, config.conv_kernel - 1, config.conv_channels))
conv = conv.astype(config.dtype)
state = 0.1 * jax.random.normal(keys[3], (B, config.linear_value_heads, config.linear_key_dim,
                                          config.linear_value_dim))
start = time.perf_counter()
with (course.planted("head_decay" if exercise_head_decay else None),
      mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret"))):
    got_kda = jax.block_until_ready(deltanet.gated_deltanet(config, params, x, conv, state,
                                                            layer=linear))
kda_seconds, kda_races = time.perf_counter() - start, mk.kernels.backend.races_found()
_, want_conv, want_state, want_kda = reference.linear_decoder_layer(config, params, linear, x,
                                                                    conv, state)
for name, g, w in zip(("x", "conv rows", "state rows"), got_kda,
                      (want_kda, want_conv, want_state)):
    print(f"{name} {tuple(g.shape)}: max |kernel - reference| = "
          f"{float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()):.2e}")
print(f"races: {mk.kernels.backend.races_text(kda_races)}; wall {kda_seconds:.2f} s on {mode}"
      + (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# **Exercise:** set `exercise_head_decay = True`: `mk.course.course.planted("head_decay")` makes
# the kernel decay all of a head's channels by its first channel's decay, as a gated
# DeltaNet would. The last cell's state check fails: one decay per head is a different
# model.
#
# ## Kimi's MoE block
#
# The router scores are sigmoids; a per-expert bias shifts the choice (not the weights);
# the choice keeps the `topk_groups` expert groups whose two best biased scores sum
# highest; the weights are renormalised and scaled. A shared expert, a SwiGLU every row
# runs, is added. In the kernel (`mk.kinds.mlp.routing.Routing`) the group choice is a few
# rounds of row maxima, as stage 04's top-k is:

# %%
plots.show_source(routing_module.kept_groups)

# %% [markdown]
# The shared expert's segments come before the expert slots in the stream: their
# addresses are known at the layer's start, so they stream while nothing else can, and
# they run before routing, while the expert tiles the ring issues are still no-ops:

# %%
moe_layer = config.moe_layers[0]
_, row = config.mlp_index(moe_layer)
h_moe = jax.random.normal(keys[4], (B * T, config.hidden))
experts = [params[n][row] for n in mlp.EXPERT_WEIGHTS]
shared = [params[n][row] for n in mlp.SHARED_WEIGHTS]
routing = routing_module.Routing.of(config)
weights, chosen = ops.route_grouped(
    h_moe, params["router"][row], params["router_bias"][row], routing.top_k,
    routing.expert_groups, routing.topk_groups, routing.renormalise, routing.routed_scale)
want_moe = ops.mix_experts(h_moe, weights, chosen, *experts) + ops.swiglu(
    h_moe, *shared)
with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
    got_moe, loaded = jax.block_until_ready(mlp.moe(
        h_moe, params["router"][row], *experts, top_k=routing.top_k,
        renormalise=routing.renormalise, router_score=routing.router_score,
        router_bias=params["router_bias"][row], expert_groups=routing.expert_groups,
        topk_groups=routing.topk_groups, routed_scale=routing.routed_scale, shared=shared,
        return_loaded=True))
moe_races = mk.kernels.backend.races_found()
print(f"{routing}\nexperts chosen per row: {np.asarray(chosen).tolist()}; distinct experts "
      f"loaded: {int(loaded[0])}; max |kernel - reference| = "
      f"{float(jnp.abs(got_moe - want_moe).max()):.2e}; races: {mk.kernels.backend.races_text(moe_races)}")

# %% [markdown]
# ## MLA in the megakernel
#
# In the megakernel an MLA layer is the same `attend` between a prologue and an epilogue of
# its own. The ring streams the matrices with D rows or columns (wq_a, wkv_a padded to
# whole tiles, wo); the narrow ones (wq after the q low rank, wkv_b, the two low-rank
# norms) would force small tiles on every matrix, so each MLA layer DMAs them whole at its
# start and waits for each where it first uses it:

# %%
plots.show_source(mla.mla_matrices, mla.mla_prologue, mla.mla_epilogue)

# %% [markdown]
# The whole model, every layer in one kernel, against the reference's greedy tokens (the
# tests check transformers' own tokens on TPU-shaped `kimi_linear` checkpoints, batch 1
# and 4, T = 1 and 4):

# %%
prompt = np.asarray(jax.random.randint(keys[4], (B, 5), 0, config.vocab))
start = time.perf_counter()
got_tokens = megakernel.generate(config, params, prompt, 6, backend=run.backend,
                                 max_context=S, steps_per_call=5)
mk_seconds = time.perf_counter() - start
want_tokens = reference.generate(config, params, prompt, 6, max_context=S)
print(f"megakernel {np.asarray(got_tokens).tolist()}\nreference  "
      f"{np.asarray(want_tokens).tolist()}\nwall {mk_seconds:.1f} s on {mode}"
      + (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# One device of the Kimi K3 stand-in's TP32 step (`kimi-k2-shaped`, Kimi Linear's layers at
# Kimi K2's shapes, split over 32 TensorCores: its share of
# the MLA and KDA heads, the low-rank wq_a and wkv_a whole on each, the latent cache whole
# on each), its VMEM by buffer as the plan sizes it for the chip. The ring and the router
# (E x D, DMA'd per MoE layer) dominate; MLA adds its loaded wq and wkv_b and a latent KV
# ring (`k_tiles`: R + Hr values a row, padded to whole 128-lane tiles in VMEM). Its FP4
# experts (the preset's `formats`) stream packed on each device (`mk.step.shards` splits the
# packed bytes and their scales), through a ring of their own beside the plain one. Both
# rings share one slot index, so Little's law over the stream's tiles (long runs of small
# FP4 tiles) would make each of them hundreds of slots deep, over VMEM: the plan shortens
# the ring to what leaves Mosaic its room (`DecodePlan.make`, printed below):

# %%
k3_plan = DecodePlan.make(mk.preset(bytes_preset), tp=32, batch=1, rows=1, context=4096,
                          chip=run.chip, kernel=False)
k3_fit, k3, local = k3_plan.fits(run.chip), k3_plan.config, k3_plan.local
display(plots.table(k3_fit.vmem.rows()[:12]))
k3_moe = next(kind for kind in k3_plan.kinds if kind.name == "moe")
print(f"a device: {local.heads} MLA heads, {local.linear_value_heads} KDA heads; "
      f"{k3_moe.layout_note().removeprefix(', ')}; stored as "
      f"{dict(k3.formats)['experts']} (half a byte a value and a scale byte per 32 values "
      "in HBM)")
print(f"{k3_plan.local.name}: {k3_fit.vmem.total_bytes / 2**20:.1f} MiB of VMEM in "
      f"{len(k3_fit.vmem.buffers)} buffers, {k3_plan.block.slots} ring slots of "
      f"{k3_plan.block.tile_rows} x {k3_plan.block.tile_cols}; HBM "
      f"{k3_fit.hbm_bytes / 2**30:.1f} GiB against {k3_fit.hbm_limit_bytes / 2**30:.1f} "
      f"GiB: {'fits' if k3_fit.ok else k3_fit.error}")

# %% [markdown]
# ## An expert's gate and up in one lane tile
#
# Split 32 ways, each of Kimi K3's experts gives a device 64 of its 2048 columns of gate
# and of up. A lane tile is 128 wide, so apart each would stream a tile half of zeros:
# twice the expert's bytes, and the whole shard over a core's HBM. The kernel streams the
# two side by side in one tile instead (`we_gate_up`), one product for both; up's values
# come out by rotating the product's lanes. Down's 64 rows still pad to 128 (fp4 packs
# 128 rows), so an expert streams 4/3 of its bytes, not 2x:

# %%
share = k3.expert_ffn // k3_plan.tp
lanes = {"apart": [("we_gate", share), (None, local.expert_ffn - share), ("we_up", share),
                   (None, local.expert_ffn - share)],
         "joined (we_gate_up)": [("we_gate", share), ("we_up", share),
                                 (None, k3_moe.joined - 2 * share)]}
fig = go.Figure()
for layout, parts in lanes.items():
    start = 0
    for name, width in parts:
        if width:
            fig.add_trace(go.Bar(
                y=[layout], x=[width], base=start, orientation="h", showlegend=False,
                marker_color=colours.WEIGHT_COLOURS[name] if name else colours.IDLE_GREY,
                text=f"{name or 'zeros'} {width}", textposition="inside"))
        start += width
fig.update_layout(title=f"One expert's gate and up on one of {k3_plan.tp} devices, lane by "
                  "lane", xaxis_title="lanes (128 a tile)", yaxis_title="layout", height=260,
                  barmode="overlay", margin=dict(l=160))
fig.update_xaxes(dtick=128)
plots.show(fig)

# %% [markdown]
# The plan joins them only where both fit one lane tile (`gate_up_width`, its reasons in
# the docstring), and the kernel splits the joined product with one rotation inside each
# lane tile (`split_gate_up`; `experts_body` then zeroes the activation's lanes past the
# values, where down's padded rows are):

# %%
plots.show_source(joined_experts.gate_up_width, joined_experts.split_gate_up)

# %% [markdown]
# **Exercise.** At TP64 a device would hold 32 columns each of gate and up, joined in 128
# lanes. By how many lanes (`jnp.roll`'s direction: lane i moves to i + shift) must the
# product rotate to bring up's values to lanes 0-31? Set `up_rotation`; the check runs
# the kernel's own split on a product whose lanes hold their index.

# %%
up_rotation: int = 96  # lanes; the kernel's choice at TP64

# %%
with mk.kernels.backend.use(run.backend):
    course.check_up_rotation(up_rotation, used=32, lanes=128)
print(f"a rotation by {up_rotation} lanes brings up's 32 values to lanes 0-31")

# %% [markdown]
# So the whole shard fits a core's HBM (printed above) and compiles whole for tpu7x:2x2x4
# (tests/test_tensor_parallel.py); notebook 11 reads the ledger's distances.
#
# **Takeaway:** MLA makes a cached token cost R + Hr values per layer whatever the head
# count, and its absorbed form reads nothing else; in the megakernel it is `attend` over
# the latent rows between a prologue and an epilogue of small products in VMEM; KDA is the
# gated DeltaNet with a decay per key channel; Kimi's router and shared expert fit stage
# 04's ring unchanged.

# %% [markdown]
# ## Questions
#
# 1. How many values per cached token does MLA's absorbed decode read, against GQA's?
#    <details><summary>Answer</summary>W = kv_lora_rank + the shared key part, once for all heads; GQA reads
#    2 x kv_heads x head_dim.</details>

# %%
course.check_close("MLA x after attention", got_mla, want_mla, atol=1e-2 * mla_scale, rtol=0)
course.check_close("megakernel greedy tokens", got_tokens, want_tokens, atol=0, rtol=0)
course.check_close("latent rows", got_cache[a], want_latent, atol=0, rtol=0)
course.check_close("KDA x after the mixer", got_kda[0], want_kda, atol=1e-5)
course.check_close("KDA state rows", got_kda[2], want_state, atol=1e-5)
# The conv input is rounded to the cache dtype once; the kernel's projection sums run in
# another order, so a value may land one bfloat16 step away: 2^-8 to 2^-7 of it, by where
# it sits between two powers of two.
course.check_close("KDA conv rows", got_kda[1], want_conv, atol=1e-6, rtol=2**-7)
course.check_close("Kimi MoE", got_moe, want_moe, atol=2e-2, rtol=2e-2)
for what, races in (("latent attention", mla_races), ("KDA layer", kda_races),
                    ("Kimi MoE", moe_races)):
    course.check_race_free(what, races)
print("checks passed")
