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
# # 05d · gpt-oss's layers: sliding windows, attention sinks, clamped experts
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/05d_gpt_oss_layers.ipynb)
#
# OpenAI's gpt-oss (transformers' `gpt_oss`) brings three layer pieces the other families
# lack, added to mk as two layer kinds in their own rooms (`mk.kinds.attention.kinds.SinkGQA`,
# `mk.kinds.mlp.kinds.ClampedMoE`): every other layer attends only to its last 128 positions (a
# sliding window), every head's softmax has one more learned logit that weighs no value (an
# attention sink), and the experts' SwiGLU is clamped. This notebook answers:
#
# - Which KV tiles does a sliding layer read, and what does the window save a step at long
#   context?
# - What is a sink, and where does the kernel's online softmax take it?
# - How does gpt-oss's expert activation differ from SwiGLU?
# - Is the megakernel's gpt-oss the reference's, token for token?
# - How does gpt-oss-20b, 2880 wide, fit the kernel's 128-lane tiles and one Colab chip?
#
# **You will** run attention with sinks and a window as a stage kernel, count the KV tiles
# it loads, and find a kernel that masks the window but still loads every tile. **You will
# be able to** say what a window saves and what it cannot. **Prerequisites:** 03, 04, 06.
# Part II.

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
preset: str = "tiny-gpt-oss"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 2  # B, sequences decoded together
rows: int = 1  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v6e"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
bytes_preset: str = "gpt-oss-20b"  # the gpt-oss model whose KV bytes and chip fit are shown
hf_model: str = ""  # on a TPU (Colab): "openai/gpt-oss-20b" decodes the real model
allow_download: bool = False  # True lets hf_model download from the hub (~13 GB)
hf_text: str = "The three primary colors are"  # its prompt (token ids "1 2 3" without a tokenizer)
hf_steps: int = 16  # greedy tokens of the real model
exercise_window_unskipped: bool = False  # the exercise: the window masked, not skipped

# %%
import contextlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display

import mk
import mk.kernels.backend
import mk.model.cache
import mk.course.run
from mk.course import course, teach
from mk.cost import ledger, perf, sim
from mk.step import megakernel
from mk.model import ops, reference
from mk import plots
from mk.kinds.attention import decode_attention
from mk.kernels import kv_stream
from mk.kernels.common import BlockSizes, dma_log
from mk.step.plan import DecodePlan
from mk.model.chips import RATE_ENDS
from mk.model.weights import param_count

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
if hf_model and not allow_download:
    raise ValueError(f"hf_model={hf_model!r} would download from the Hugging Face hub: set "
                     "allow_download=True as well to allow it")
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode = run.config, mk.kernels.backend.resolve(run.backend)
if not (config.attention_sinks and config.swiglu_limit):
    raise ValueError(f"preset={config.name!r} is not gpt-oss (sinks and clamped experts): "
                     f"choose one of {mk.model.presets.GPT_OSS_PRESET_NAMES}")
B, T, S = run.batch, run.rows, run.context
W = config.sliding_window
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    config, run.seed)
keys = jax.random.split(jax.random.key(run.seed), 4)
print(f"{config.name}: {config.layers} layers, sliding {config.sliding_layers} (a window of "
      f"{W} positions), the others full; {config.heads} heads of {config.head_dim}, "
      f"{config.kv_heads} kv heads, a sink each; {config.experts} experts, top "
      f"{config.experts_per_token}, clamp {config.swiglu_limit}; B={B} T={T} S={S}; "
      f"kernels run on: {mode}")

# %% [markdown]
# ## A sliding window: the tiles a layer reads
#
# A row at position q of a sliding layer sees the keys at q - W < s <= q, its own
# included (`mk.model.ops.attention(window=)`, checked against transformers). The kernel reads the
# cache in tiles of `kv_tile` positions (notebook 03); a sliding layer starts each sequence
# at the tile holding its first row's oldest visible position, position - W + 1:

# %%
plots.show_source(kv_stream.first_kv_tile, kv_stream.kv_tiles)

# %% [markdown]
# The tiles one step reads, for sequences at a few positions (tiles of 16 positions here,
# so the picture has some), in a full layer and in a sliding one:

# %%
tile = 16
positions = [min(p, S - T) for p in (5, 60, 150, S - T)]
plots.show(plots.kv_tile_map(positions, T, tile, S, title="A full layer: every tile up to "
                             "the new rows"))
plots.show(plots.kv_tile_map(positions, T, tile, S, window=W,
                             title=f"A sliding layer (window {W}): only the window's tiles"))

# %% [markdown]
# What that saves a step: every layer's KV bytes per sequence against the context, for
# `bytes_preset` as it is (half its layers sliding) and with every layer full. The
# sliding layers' bytes stop growing at the window; the full layers' do not, so at long
# context the window halves the KV traffic, and no more (`mk.cost.perf.seen_positions`, the
# positions a full layer reads on average):

# %%
big = mk.preset(bytes_preset)
per_position = mk.model.cache.bytes_per_position(big)  # every full layer's K and V, one position
contexts = [2**p for p in range(6, 18)]
series = {f"{big.name}: {len(big.sliding_layers)} of {big.layers} layers sliding":
              [per_position * perf.seen_positions(big, s) / 2**20 for s in contexts],
          "every layer full": [per_position * s / 2**20 for s in contexts]}
fig = plots.lines(contexts, series, title="KV bytes read per sequence per step (T = 1)",
                  xaxis="context (cached positions)", yaxis="KV bytes (MiB)")
fig.update_xaxes(type="log")
plots.show(fig)
print(f"at {contexts[-1]:,} positions: {series[next(iter(series))][-1]:.0f} MiB against "
      f"{series['every layer full'][-1]:.0f} MiB a sequence")

# %% [markdown]
# ## Attention sinks
#
# A sink is one more logit per head in each row's softmax, learned, that weighs no value:
# probabilities exp(s_i) / (exp(sink) + sum_j exp(s_j)). A head can so attend to "nothing"
# (its output shrinks toward 0) where an ordinary softmax must spread a whole unit of
# weight over the keys, the row's own key at least. The share a sink takes as the best
# score moves past it, for a row of 32 keys:

# %%
scores = np.linspace(-6, 6, 121)
sink_share = {f"sink = {s:g}": [1 / (1 + np.exp(x - s) * (1 + 31 * np.exp(-2.0)))
                                 for x in scores] for s in (-2.0, 0.0, 2.0)}
fig = plots.lines(scores, sink_share, title="The sink's share of a row's softmax (one key "
                  "at the best score, 31 two below it)", xaxis="the best score (logit)",
                  yaxis="the sink's share (fraction of the row)")
plots.show(fig)

# %% [markdown]
# The kernel's online softmax (notebook 03) starts each sequence from the sink: running
# max the sink's logit, running sum 1, nothing accumulated. Every tile then rescales as
# before, and the output's division by the running sum counts the sink's term. A row of a
# sliding layer that sees none of a tile's keys so keeps a finite max (the sink) where an
# empty start would divide 0 by 0:

# %%
teach.excerpt(decode_attention.attend, [
    ("def start_sequence", "s.acc[...] = jnp.zeros", "Each sequence starts from nothing, "
     "or from the sink: its logit as the running max, weight 1 in the running sum.")],
    title="The sink in attend")

# %% [markdown]
# ## The check: attention with sinks and a window, kernel against reference
#
# Stage 03's `decode_attention` with gpt-oss's sinks and window, on a random cache, the
# sequences past the window; the reference is `mk.model.ops.attention(window=, sinks=)`. The
# tiles before a window's first hold NaN: a kernel that reads one poisons its output. And
# with every DMA the kernel starts recorded (`mk.kernels.common.dma_log`, interpret mode
# only: on a TPU the NaN tiles are the check) the K tiles it loaded are counted against the
# tiles of the positions each sequence sees:

# %%
N, K, H = 4, 2, 128
att_tile, att_S = 16, 128
att_positions = jnp.array([70, 101][:B] + [40] * max(0, B - 2), jnp.int32)
q = jax.random.normal(keys[0], (B * T, N * H))
k_new, v_new = (jax.random.normal(k, (B * T, K * H)) for k in keys[1:3])
start = np.maximum(np.asarray(att_positions) - W + 1, 0) // att_tile * att_tile
cache = np.asarray(jax.random.normal(keys[3], (2, 1, B, K, att_S, H)))
cache = np.where(np.arange(att_S)[None, None, None, None, :, None]
                 < start[None, None, :, None, None, None], np.nan, cache)
k_cache, v_cache = (jnp.asarray(c, jnp.float32) for c in cache)
sinks = jnp.array([0.5, -1.0, 2.0, 4.0])
counting = mode == "interpret"  # the DMA log's host callbacks run in interpret mode only
begin = time.perf_counter()
with (course.planted("window_unskipped" if exercise_window_unskipped else None),
      mk.kernels.backend.use(run.backend, detect_races=counting),
      dma_log() if counting else contextlib.nullcontext([]) as log):
    o, _, _ = jax.block_until_ready(decode_attention.decode_attention(
        q, k_new, v_new, k_cache, v_cache, att_positions, layer=0, sinks=sinks, window=W,
        block=BlockSizes(kv_tile=att_tile, kv_slots=2)))
att_seconds, att_races = time.perf_counter() - begin, mk.kernels.backend.races_found()
k_written = ops.write_rows(jnp.nan_to_num(k_cache[0]), k_new.reshape(B, T, K, H),
                           att_positions)
v_written = ops.write_rows(jnp.nan_to_num(v_cache[0]), v_new.reshape(B, T, K, H),
                           att_positions)
want_o = ops.attention(q.reshape(B, T, N, H), k_written, v_written, att_positions, window=W,
                       sinks=sinks).reshape(B * T, N * H)
loaded = sum(1 for what, _ in log if what == "k_tile") if counting else "not counted"
seen = sum(len(np.unique(np.arange(max(p - W + 1, 0), p + T) // att_tile))
           for p in np.asarray(att_positions))
print(f"max |kernel - reference| = {float(jnp.nanmax(jnp.abs(o - want_o))):.2e}; K tiles "
      f"loaded {loaded}, tiles the rows see {seen}; races: {mk.kernels.backend.races_text(att_races)}; wall "
      f"{att_seconds:.2f} s on {mode}"
      + (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# **Exercise:** set `exercise_window_unskipped = True`: `mk.course.course.planted
# ("window_unskipped")` makes every sequence start at tile 0, as a full layer's does, and
# the window is kept by the mask alone. With the NaN tiles put back (the cache above
# holds NaN only before each window), what does the output say, and what does the tile
# count? The checks at the end fail: a window that is masked but not skipped costs the
# bytes it was meant to save, and reads positions it must not.
#
# ## gpt-oss's experts
#
# The router adds a bias to its logits and takes the softmax of the top-k of them (the
# renormalised softmax's weights); each expert adds a bias to its gate, up and down
# projections and replaces SwiGLU's silu(gate) * up with a clamped variant:

# %%
plots.show_source(ops.clamped_swiglu)
gate = np.linspace(-10, 10, 201)
activation = {
    "SwiGLU, up = 1: silu(gate)": np.asarray(jax.nn.silu(gate)),
    f"clamped, up = 0 (limit {config.swiglu_limit:g})": np.asarray(
        ops.clamped_swiglu(gate, np.zeros_like(gate), config.swiglu_limit,
                           config.swiglu_alpha))}
plots.show(plots.lines(gate, activation, title="An expert's activation against its gate "
                       "projection", xaxis="gate (x @ we_gate + be_gate)",
                       yaxis="activation (value)"))

# %% [markdown]
# The (up + 1) makes up = 0 pass the gate through; the clamp caps the gate from above
# (so the activation stops growing) and the up projection on both sides. In the kernel it
# is `mk.kinds.mlp.mlp.experts_body`'s activation, and each expert slot adds its expert's
# bias rows, picked from the layer's [E, Fe] bias tables by the slot's expert id.
#
# ## The whole model in the megakernel
#
# Every layer of the preset in one kernel against the reference's greedy tokens, the
# prompt longer than the window (the tests check transformers' own tokens on
# transformers-written `gpt_oss` checkpoints with MXFP4 experts, T = 1 and 4, tensor
# parallel at tp 2):

# %%
prompt = np.asarray(jax.random.randint(keys[0], (B, W + 4), 0, config.vocab))
begin = time.perf_counter()
got_tokens = megakernel.generate(config, params, prompt, 6, backend=run.backend,
                                 max_context=S, steps_per_call=5)
mk_seconds = time.perf_counter() - begin
want_tokens = reference.generate(config, params, prompt, 6, max_context=S)
print(f"megakernel {np.asarray(got_tokens).tolist()}\nreference  "
      f"{np.asarray(want_tokens).tolist()}\nwall {mk_seconds:.1f} s on {mode}"
      + (" (a CPU simulation, not TPU time)" if mode == "interpret" else ""))

# %% [markdown]
# ## gpt-oss-20b on one chip
#
# gpt-oss's width, 2880, is 22.5 lane tiles, and so is its experts' width: no weight tile
# of whole 128-lane units cuts it, and fp4 packs 128 rows together. So mk holds it
# *lane-padded* (`ModelConfig.lane_padded`, which the loader and the presets apply): 2944
# wide, the 64 extra lanes zero in every weight, bias and norm, so the residual stream's
# padding lanes stay zero. One thing must change for that to be exact: an RMSNorm of the
# residual stream averages the squares over the model's own 2880 lanes, not 2944
# (`ModelConfig.norm_width`, passed as `width` by every residual norm, the kernel's too):

# %%
plots.show_source(ops.rms_norm)
own = big.unpadded()
print(f"{big.name}: width {own.hidden} -> {big.hidden}, expert width {own.expert_ffn} -> "
      f"{big.expert_ffn} (padding {dict(big.padding)}); {param_count(own) / 1e9:.2f}B "
      f"values as published, {param_count(big) / 1e9:.2f}B held (+"
      f"{param_count(big) / param_count(own) - 1:.1%}, all zeros, all streamed)")

# %% [markdown]
# The plan for one core of each Colab TPU at B = 1 and 4,096 cached positions: its HBM
# (the fp4 experts packed, the rest bf16, the KV cache) against the core's and its VMEM;
# then the **simulated step** (`mk.cost.sim`: a model, not a TPU measurement) with the per-tile
# cost libtpu's bundle dump gives the whole compiled kernel (its costliest loop,
# mk/data/tile_costs/gpt_oss.json, recorded by benchmarks/tile_costs.py; a 1 us DMA
# latency), at both ends of the chip's bundle rate, against the **HBM floor** (the step's
# bytes at the core's bandwidth). The tiles are 128 x 2944, one 128-row panel of the
# whole width: 2944 = 23 x 128 has no other divisor, and the experts' fp4 tiles, fed bf16
# on both chips, are held to `QUANT_TILE_ELEMENTS` (the next smaller tile, 128 x 128, moves
# so few bytes that each tile's fixed loop cost outlasts its DMA; mk/data/README.md keeps that
# recording's numbers). A plain tile issues in a quarter to a third of its DMA time;
# an fp4 tile's dequantisation to bf16 issues for over three times its DMA (each chip's
# recorded loop), so HBM still idles for two fifths of the step or more:

# %%
recorded = {r["chip"]: r for r in json.loads(
    (Path(mk.__file__).parent / "data" / "tile_costs" / "gpt_oss.json").read_text())
    if r["preset"] == big.name}
fits = []
for chip_name in ("v6e", "v5e"):
    plan = DecodePlan.make(big, batch=1, context=4096, chip=chip_name)
    fit, row = plan.fits(chip_name), recorded.get(chip_name)
    line = {"chip": chip_name, "HBM GiB": f"{fit.hbm_bytes / 2**30:.2f}",
            "of GiB": f"{fit.hbm_limit_bytes / 2**30:.2f}",
            "VMEM MiB": f"{fit.vmem.total_bytes / 2**20:.1f}" if fit.vmem else "-",
            "ring": f"{plan.block.slots} x {plan.block.tile_rows} x {plan.block.tile_cols}",
            "fits": fit.ok or fit.error}
    for end in RATE_ENDS if row else ():  # recorded for gpt-oss-20b only
        step = sim.simulate(DecodePlan.make(big, chip=chip_name, batch=1, position=4096,
                                            kernel=False),
                            assumptions=ledger.recorded_assumptions(row, rate_end=end))
        rate = mk.chip(chip_name).bundle_rate(end, plan.M)  # bundles a second at this end
        fp4 = row.get("packed", {}).get("fp4")  # its loop, where the dump shows one
        plain_s, fp4_s = ledger.tile_bundles(row) / rate, fp4 and fp4["bundles"] / rate
        line |= {f"issue/DMA plain, {end}": f"{plain_s / (row['dma_ns'] * 1e-9):.1f}x",
                 f"issue/DMA fp4, {end}": f"{fp4_s / (fp4['dma_ns'] * 1e-9):.1f}x" if fp4
                 else "no loop",
                 "HBM floor ms": f"{step.hbm_floor_s * 1e3:.2f}",
                 f"simulated step ms, {end} rate": f"{step.step_ms:.2f}",
                 f"HBM busy, {end} rate": f"{step.hbm_utilisation:.0%}"}
    fits.append(line)
display(plots.table(fits))
display(plots.table(fit.vmem.rows()[:8]))  # the last chip's biggest VMEM buffers

# %% [markdown]
# ### On a Colab TPU: the real gpt-oss-20b
#
# With `hf_model = "openai/gpt-oss-20b"` and `allow_download = True` on a TPU runtime
# (v6e-1 or v5e-1: on v5e-1's 15.75 GiB its random weights in the real shapes counted 15.7
# GiB for a donating `generate` and peaked at 14.5 on a v5e, 1 of its 8 tokens exact, in
# data/measured/v5e-models.json: random routers are chaotic, a rounding-sized change flips
# an expert and every token after, so the chip's prefill and the CPU's parted at the first;
# `mk.model.checkpoint.pin_routes` gives random routers a margin), the cell below downloads the checkpoint (~13 GB, MXFP4 experts), loads it (`mk.load_checkpoint`:
# lane-padded, the experts kept fp4), prints the plan's fit for this chip and decodes
# `hf_text` greedily in the megakernel. Elsewhere it says why it skips.

# %%
on_tpu = mode == "hardware"
if hf_model and on_tpu:
    from huggingface_hub import snapshot_download

    from mk.measure import measure

    folder = snapshot_download(hf_model, allow_patterns=["*.json", "*.safetensors"])
    real_config, real_params = mk.load_checkpoint(folder)
    this_chip = measure.chip_of(jax.devices()[0].device_kind)
    real_fit = DecodePlan.make(real_config, batch=1, context=4096,
                               chip=this_chip).fits(this_chip)
    print(f"{real_config.name} on {this_chip}: HBM {real_fit.hbm_bytes / 2**30:.2f} of "
          f"{real_fit.hbm_limit_bytes / 2**30:.2f} GiB; "
          f"{'fits' if real_fit.ok else real_fit.error}")
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer(hf_text)["input_ids"]
    except (ImportError, OSError):  # no tokenizer here: token ids "1 2 3"
        tokenizer, ids = None, [int(t) for t in hf_text.split()]
    out = megakernel.generate(real_config, real_params, np.asarray([ids]), hf_steps,
                              max_context=4096)
    print(np.asarray(out).tolist() if tokenizer is None
          else hf_text + tokenizer.decode(np.asarray(out)[0]))
else:
    print("skipped: " + ("set hf_model='openai/gpt-oss-20b' and allow_download=True"
                         if on_tpu else f"kernels run on {mode}, not a TPU (Colab: "
                         "Runtime > Change runtime type > TPU)"))

# %% [markdown]
# **Takeaway:** a sliding layer reads only its window's tiles, so half of gpt-oss's KV
# traffic stops growing with the context; a sink is the online softmax's starting point
# (its logit, weight 1); the clamped experts are stage 04's expert slots with another
# activation and a bias row per slot; a width that is not whole lane tiles is held
# padded with zeros, exactly, if the norms average over the model's own width.

# %% [markdown]
# ## Questions
#
# 1. At 131,072 cached positions, what share of a gpt-oss-20b step's KV bytes does the
#    window save?
#    <details><summary>Answer</summary>Half of the layers read 128 positions instead of
#    131,072: just under half of the KV bytes.</details>
# 2. Why does the kernel start a sequence's online softmax from the sink rather than add
#    the sink's term at the end?
#    <details><summary>Answer</summary>Starting from it keeps the running max finite for
#    a row that sees none of a tile's keys (a sliding layer's first tile), and the
#    rescaling then treats the sink like any key.</details>

# %%
course.check_close("attention with sinks and a window", o, want_o, atol=1e-2, rtol=1e-2)
if counting:
    course.check_close("K tiles loaded", loaded, seen, atol=0, rtol=0)
course.check_race_free("attention with sinks and a window", att_races)
course.check_close("megakernel greedy tokens", got_tokens, want_tokens, atol=0, rtol=0)
print("checks passed")
