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
# # 04 · The MLP: dense SwiGLU and a mixture of experts
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/04_mlp_and_moe.ipynb)
#
# After attention, every layer runs an MLP: a dense SwiGLU, or (Qwen3-MoE) a router that
# picks X of E experts per token, each expert a small SwiGLU. This notebook answers:
#
# - How do the three matrices of a SwiGLU stream through one ring?
# - How many experts does one decode step touch, and how many bytes does that save?
# - How does the router's output, a vector, become the scalars that address the expert
#   DMAs, in a form Mosaic compiles for v5e, v6e and TPU7x?
# - Does the kernel really read only the experts the batch selected?
#
# **You will build** a 35-line expert kernel addressed by scalar-prefetched ids
# (`mk.course.teach.moe_experts`), check it equals the real one, and read the real
# `experts_body`. **You will be able to** say which expert bytes a step reads and find a
# slot that loads the wrong expert. **Prerequisites:** 01 (the ring), 03 (SMEM scalars,
# `pl.when`).

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
slots: int = 3  # ring slots
tile: int = 128  # tile_rows and tile_cols of the tiny runs
router_seed: int = 3  # draws the MoE rows; 3 makes tiny-moe pick experts [3, 6], not a prefix
exercise_wrong_expert: bool = False  # the exercise: True loads expert slot s, not the id in it
solutions: bool = False  # True checks the worked solution in place of your kernel (headless runs)

# %%
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import plotly.graph_objects as go
from IPython.display import display

import mk
import mk.kernels.backend
import mk.course.run
from mk.course import course, teach
from mk.model import ops
from mk.cost import perf, routing_trace
from mk import plots
from mk.measure import tpu
from mk.kinds.mlp import mlp
from mk.kernels.common import BlockSizes, vmem_budget
from mk.kernels.weight_streaming import stage_block
from mk.kernels.stream import TileStream

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
mode = mk.kernels.backend.resolve(run.backend)
spec = mk.chip(run.chip)
M = run.batch * run.rows
dense_config = run.config if run.config.dense_layers else mk.preset("tiny")
moe_config = run.config if run.config.is_moe else mk.preset("tiny-moe")
block = BlockSizes(slots=slots, tile_rows=tile, tile_cols=tile)
print(f"M = B*T = {M} rows; dense SwiGLU of {dense_config.name}, MoE of {moe_config.name}; "
      f"kernels run on: {mode}")

# %% [markdown]
# ## The idea
#
# A dense SwiGLU reads its three matrices whole: $3\,D\,F$ weights per layer. An MoE layer
# reads its router ($D\,E$) and only the experts some token picked, $3\,D\,F_e$ each. If
# each of the M rows picks X of E experts independently and uniformly, the expected number
# of distinct experts is
#
# $$n(M) = E\,\big(1 - (1 - X/E)^{M}\big),$$
#
# between X (every row agrees) and $\min(E, M X)$ (no two rows agree); `mk.cost.perf.experts_touched`
# computes all three. Bytes per MoE layer, at the experts' data bits (`expert_bits`, a
# preset's `formats`; scales aside):

# %%
def moe_layer_row(config, m):
    n = perf.experts_touched(config.experts, config.experts_per_token, m)
    expert = config.expert_params * config.expert_bits / 8
    return {"model": config.name, "M": m, "E": config.experts, "X": config.experts_per_token,
            "distinct experts n(M)": f"{n:.1f}", "MiB read": f"{n * expert / 2**20:.1f}",
            "of all experts": f"{n / config.experts:.0%}"}


models = [moe_config] + [mk.preset(n) for n in ("qwen3-30b-a3b", "kimi-k3-like")
                         if n != moe_config.name]
display(plots.table([moe_layer_row(c, m) for c in models for m in sorted({1, 8, 64, M})]))

# %%
big = mk.preset("qwen3-30b-a3b")
ms = np.arange(1, 65)
fig = go.Figure([go.Scatter(x=ms, y=[perf.experts_touched(big.experts, big.experts_per_token,
                                                          int(m), r) for m in ms], name=r)
                 for r in perf.ROUTINGS])
fig.update_layout(title=f"Distinct experts one {big.name} layer reads (E={big.experts}, "
                  f"X={big.experts_per_token})", xaxis_title="activation rows M (rows)",
                  yaxis_title="distinct experts read (experts)")
plots.show(fig)

# %% [markdown]
# Uniform routing is an assumption, and a trained router breaks it: some experts are
# chosen far more often than others, so M rows share more of them and read fewer bytes.
# `mk.cost.routing_trace.record` runs the reference over a prompt and its greedy tokens and
# counts which experts each MoE layer's router chose. Passed as `routing=` to `mk.cost.perf`
# and `mk.cost.sim`, the trace replaces the assumption: expert e is chosen with its own
# probability $q_e$ (its count over the tokens), so $n(M) = \sum_e 1 - (1 - q_e)^{M}$.
# Random weights touch nearly as many experts as uniform routing (the table); with
# `checkpoint=` a trained MoE checkpoint's folder this cell records that router's skew
# (`mk.cost.routing_trace.save` keeps a trace for a CPU session). Every device of a
# tensor-parallel shard holds a slice of every expert, so skew changes the bytes of all
# devices alike, never which device is the busiest.

# %%
trace_params = (mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint and run.config.is_moe
                else mk.init_params(moe_config, run.seed))
trace = routing_trace.record(moe_config, trace_params, np.random.default_rng(run.seed).integers(
    0, moe_config.vocab, (2, 16)), steps=16)
print(f"{moe_config.name}: {trace.tokens} tokens routed in {len(trace.counts)} MoE layers; "
      f"the most chosen expert's share is {trace.skew():.2f}x the mean share")
routes = (moe_config.experts, moe_config.experts_per_token)  # E, X
display(plots.table([{"M": m, "uniform n(M)": f"{perf.experts_touched(*routes, m):.2f}",
                      "measured n(M)": f"{perf.experts_touched(*routes, m, trace):.2f}"}
                     for m in (1, 2, 4, 8, 16, 64)]))

# %% [markdown]
# At decode sizes most experts of a layer are untouched, so the kernel must decide *at run
# time* which experts to copy. The router's output lives in vector registers; DMA
# addresses are scalars. The kernel bridges the two in four steps:
#
# 1. **route** (vectors): logits $= h \cdot$ router in f32, softmax, then X rounds of "row
#    max, lowest lane that holds it" (ties go to the lower expert id), giving each row's
#    weight per expert, `combine` [M, E], and a flag per expert, `selected` [1, E];
# 2. **vector to SMEM**: `selected` is stored to VMEM and copied into SMEM by one local DMA;
# 3. **compact** (scalars): a `fori_loop` over E writes the selected ids in increasing order
#    to `ids_smem[0:count]`, the *expert slots*;
# 4. **stream**: the slots are one `Repeat` of (gate, up, down) in the ring. Slot s fetches
#    `we_gate_hbm.at[row, ids_smem[s]]` and is switched off unless s < count; a
#    `fori_loop` over the `count` active slots runs each expert on all M rows.
#
# The stream of the MoE kernel for this run (tiles of the first two slots):

# %%
D, E, Fe, X = moe_config.hidden, moe_config.experts, moe_config.expert_ffn, \
    moe_config.experts_per_token
expert_slots = mlp.expert_slots(E, X, M)
stream = TileStream.build(block, mlp.moe_segments(D, Fe, expert_slots))
per_slot = stream.segment("we_gate").stride
display(plots.table([{"g": g, "segment": name, "row tile": i, "col tile": j}
                     for g, _, name, i, j in list(stream.tiles())[:2 * per_slot]]))
print(f"{expert_slots} expert slots of {per_slot} tiles: {stream.total} tiles when all are "
      "active")

# %% [markdown]
# ## The reference
#
# `mk.model.ops.swiglu` and `mk.model.ops.moe` (which runs *every* expert and weights the
# unselected ones by zero) on random rows h [M, D]; every matmul rounds its input to the
# weight dtype and accumulates in float32.

# %%
dense_params = mk.init_params(dense_config, run.seed)
dense_w = [dense_params[n][0] for n in ("w_gate", "w_up", "w_down")]
h_dense = jax.random.normal(jax.random.key(run.seed), (M, dense_config.hidden))
moe_w, h_moe, picked = course.moe_inputs(moe_config, run.seed, router_seed, M)
picked = np.asarray(picked)
dense_want = ops.swiglu(h_dense, *dense_w)
moe_want = ops.moe(h_moe, *moe_w, X, moe_config.norm_topk)
print(f"dense: h {h_dense.shape} -> {dense_want.shape}; MoE: the {M} rows pick experts "
      f"{picked.tolist()} ({len(picked)} distinct of {E}); a prefix 0..count-1: "
      f"{course.is_prefix(picked)}")

# %% [markdown]
# ## Exercise: the compaction from its spec
#
# Step 3 turns the router's picks into the expert slots. Before you read the kernel's,
# write it: a scalar kernel over SMEM. Its spec is the teaching version's docstring:

# %%
print(teach.compact_experts_kernel.__doc__)

# %% [markdown]
# What you need: an SMEM ref is read and written one scalar at a time (`seen_smem[e] = 0`,
# `ids_smem[count] = e`, and an index may itself be a read: `seen_smem[picked_smem[i]]`);
# `lax.fori_loop(lower, upper, body, init)` runs `body(i, carry)` (bounds may be
# run-time values) and returns the last carry; `pl.when(cond)` guards a block.
# `course.check_compact_experts` runs yours in `teach.compact_experts` on picks that
# repeat across rows, skip experts and come out of order, against the reference
# compaction, then feeds your slots to the teaching expert kernel against the reference
# MoE. It fails until you write the body; `course.reveal("04-compact")` explains the
# answer and `solutions = True` (parameters cell) checks the worked one instead.

# %%
from jax import lax  # noqa: F401 - what your kernel needs
from jax.experimental import pallas as pl  # noqa: F401


def my_compact_kernel(picked_smem, ids_smem, count_smem, seen_smem):
    """The compaction from the spec printed above."""
    ...


compact_error = course.check_compact_experts(course.attempt("04-compact", my_compact_kernel,
                                                            solutions))
print(f"your compaction passes: the teaching experts on its slots, max error "
      f"{compact_error:.1e}")

# %% [markdown]
# Ours, to set beside yours (the real kernel's `select_experts`, below, is the same walk
# over flags the router set in vector registers):

# %%
plots.show_source(teach.compact_experts_kernel)

# %% [markdown]
# ## The kernels
#
# `mlp.swiglu` and `mlp.moe` are thin wrappers around `swiglu_body` and `moe_body`, the
# in-kernel bodies a fused layer kernel calls with its own ring. The dense body is three
# `ring.matmul`s and a SwiGLU on VMEM scratch:

# %%
plots.show_source(mlp.swiglu_body)

# %% [markdown]
# The MoE body is the four steps above: `route_body` (vectors), `select_experts` (the
# vector -> SMEM DMA and the compaction `fori_loop`), then `experts_body`, a `fori_loop`
# over the `count` active expert slots whose weights `moe_fetch` addresses by
# `ids_smem[s]`:

# %%
plots.show_source(mlp.moe_body, mlp.select_experts, mlp.moe_fetch, mlp.experts_body)

# %% [markdown]
# **Exercise:** set `exercise_wrong_expert = True`: `mk.course.course.planted("wrong_expert")`
# makes slot s stream expert s instead of `ids_smem[s]`. With `router_seed = 0` the rows
# pick experts [0, 1] and the mistake is invisible; with this run's seed the check fails.
# In interpret mode the race detector watches every DMA and every read of a ring slot.

# %%
def timed(fn):
    start = time.perf_counter()
    with (course.planted("wrong_expert" if exercise_wrong_expert else None),
          mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret"))):
        out = jax.block_until_ready(fn())
    return out, mk.kernels.backend.races_found(), time.perf_counter() - start


dense_got, dense_races, dense_s = timed(lambda: mlp.swiglu(h_dense, *dense_w, block=block))
(moe_got, loaded), moe_races, moe_s = timed(lambda: mlp.moe(
    h_moe, *moe_w, top_k=X, renormalise=moe_config.norm_topk, block=block,
    return_loaded=True))
for name, got, want, races, s in (("swiglu", dense_got, dense_want, dense_races, dense_s),
                                  ("moe", moe_got, moe_want, moe_races, moe_s)):
    print(f"{name}: max |kernel - reference| = {float(jnp.abs(got - want).max()):.2e}, "
          f"races: {mk.kernels.backend.races_text(races)}, wall {s:.2f} s ({mode})")
print(f"experts loaded by the kernel: {int(loaded[0])}")

# %% [markdown]
# On CPU those wall times are the interpret-mode **simulation** of a TPU (milliseconds
# per simulated DMA, plus tracing): they say nothing about a TPU.
#
# ## The experts in 35 lines
#
# The teaching version keeps one idea: one grid step per expert slot, the slot's expert id
# read from SMEM by the weights' index maps (scalar prefetch), so slot s loads expert
# `ids[s]`; a slot past `count` keeps the last live slot's id (its block index does not
# change, so nothing new is loaded) and computes nothing. The routing comes from the
# reference router here; the real kernel routes in the kernel (`route_body`).

# %%
plots.show_source(teach.moe_experts_kernel, teach.moe_experts)
combine, padded_ids, count = course.routed(moe_config, h_moe, moe_w[0])
with mk.kernels.backend.use(run.backend):
    taught_moe = teach.moe_experts(h_moe, combine, *moe_w[1:], padded_ids, count)
taught_error = float(jnp.abs(taught_moe - moe_got).max())
print(f"slots hold experts {padded_ids} ({count} live); max |teaching - real kernel| = "
      f"{taught_error:.1e}")

# %% [markdown]
# The real `experts_body`, annotated: the same loop, over the weight ring instead of the
# grid pipeline.

# %%
teach.excerpt(mlp.experts_body, [
    ("def expert_slot(s, slot):", 'slot = ring.matmul("we_down", gate_vmem',
     "One slot: gate, up, SwiGLU, down, each `ring.matmul` of copy s, whose tiles "
     "`moe_fetch` addresses by `ids_smem[s]` (the teaching index map). The loop carries "
     "the ring slot of its next tile: each `matmul` returns it, so no slot divides by "
     "the ring's depth."),
    ("expert = lax.broadcasted_iota", "out_ref[...] += weight * down_vmem[...]",
     "Each row's routing weight of expert ids[s] scales the slot's output, as in the "
     "teaching version."),
    ("lax.fori_loop(0, count, expert_slot,", "ring.skip(base + count * per_slot, end)",
     "Only `count` slots run; the off slots' tiles are skipped, neither loaded nor "
     "computed, and the tiles behind them issued (the teaching clamp's job)."),
])

# %% [markdown]
# **Only the selected experts are read.** Fill every expert nobody picked with NaN: a
# single byte of them in a computation would turn the output into NaN.

# %%
unused = jnp.asarray(~np.isin(np.arange(E), picked))[:, None, None]
poisoned = [moe_w[0]] + [jnp.where(unused, jnp.nan, w) for w in moe_w[1:]]
poisoned_got, poisoned_races, _ = timed(lambda: mlp.moe(
    h_moe, *poisoned, top_k=X, renormalise=moe_config.norm_topk, block=block))
print(f"{int(unused.sum())} experts poisoned; output finite: "
      f"{bool(np.isfinite(np.asarray(poisoned_got)).all())}, equal to the clean run: "
      f"{bool(np.array_equal(np.asarray(poisoned_got), np.asarray(moe_got)))}")

# %% [markdown]
# ## Check
#
# Both kernels within the tolerance of the tests (bf16: one rounding of the activation may
# flip), no race, the number of experts loaded equal to the number selected, and the
# poisoned run unchanged.

# %%
tolerance = {"float32": 1e-5, "bfloat16": 1e-3}
course.check_close("swiglu", dense_got, dense_want, atol=tolerance[dense_config.dtype])
course.check_close("moe", moe_got, moe_want, atol=tolerance[moe_config.dtype])
course.check_race_free("mlp kernels", dense_races or moe_races or poisoned_races)
assert taught_error <= tolerance[moe_config.dtype], taught_error
assert int(loaded[0]) == len(picked), f"loaded {int(loaded[0])} experts, picked {len(picked)}"
np.testing.assert_array_equal(np.asarray(poisoned_got), np.asarray(moe_got))
print("kernels match the reference; only the selected experts were loaded")

# %% [markdown]
# ## VMEM budget
#
# Every VMEM buffer of the MoE kernel at qwen3-30b-a3b's shape for this run's M, with its
# padded size. The router [D, E] is small but pads E to 128 lanes; it has its own DMA, not
# the ring's (E need not be a multiple of 128). The ring tile is the default tiling's
# (`stage_block`): the largest of at most 2 MiB whose rows divide D and whose columns
# divide Fe, with down ([Fe, D]) stored transposed so the same tile cuts it.

# %%
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
big_block = stage_block(mlp.moe_segments(big.hidden, big.expert_ffn, 1), big.dtype)
budget = vmem_budget("mk_moe", mlp.moe_buffers(M, big.hidden, big.experts, big.expert_ffn,
                                               big.dtype, big_block), mk.chip(compile_chip))
display(plots.table(budget.rows()))
print(f"{big_block}: total {budget.total_bytes / 2**20:.2f} MiB of "
      f"{budget.limit_bytes / 2**20:.0f} MiB on {compile_chip}")

# %% [markdown]
# ## Compiled for a real TPU, with no TPU here
#
# Both kernels at real shapes, compiled ahead of time by libtpu's Mosaic compiler: the MoE
# of qwen3-30b-a3b (its vector -> SMEM -> DMA-address path included) and the dense SwiGLU
# of qwen3-8b, both with this run's M rows.

# %%
S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
Dq, Fq = mk.preset("qwen3-8b").hidden, mk.preset("qwen3-8b").ffn
Db, Eb, Fb = big.hidden, big.experts, big.expert_ffn
moe_report = tpu.compile_for_chip(
    functools.partial(mlp.moe, top_k=big.experts_per_token, renormalise=big.norm_topk),
    [S((M, Db), jnp.float32), S((Db, Eb), bf16), S((Eb, Db, Fb), bf16),
     S((Eb, Db, Fb), bf16), S((Eb, Fb, Db), bf16)], compile_chip, name="mk_moe", vmem=budget)
dense_report = tpu.compile_for_chip(
    mlp.swiglu, [S((M, Dq), jnp.float32), S((Dq, Fq), bf16), S((Dq, Fq), bf16),
                 S((Fq, Dq), bf16)], compile_chip, name="mk_swiglu")
print(moe_report.summary())
print(dense_report.summary())

# %% [markdown]
# ## Bytes and the roofline
#
# What each kernel of this run moved, and the time a TPU needs just to read it from HBM
# (bytes / datasheet bandwidth); then the same for one qwen3-30b-a3b MoE layer and a whole
# step of its 48 layers, at the expected number of experts.

# %%
def bytes_row(what, nbytes):
    return {"what": what, "MiB": f"{nbytes / 2**20:.3f}",
            "HBM floor (µs)": f"{nbytes / mk.chip(compile_chip).hbm_bw * 1e6:.2f}"}


item = jnp.dtype(moe_config.dtype).itemsize
dense_bytes = 3 * dense_config.hidden * dense_config.ffn * jnp.dtype(dense_config.dtype).itemsize
moe_bytes = (D * E + int(loaded[0]) * 3 * D * Fe) * item
all_experts = (D * E + E * 3 * D * Fe) * item
n_big = perf.experts_touched(big.experts, big.experts_per_token, M)
big_layer = (big.hidden * big.experts * big.weight_bits  # the router, then the experts
             + n_big * big.expert_params * big.expert_bits) / 8
display(plots.table([
    bytes_row(f"{dense_config.name} SwiGLU", dense_bytes),
    bytes_row(f"{moe_config.name} MoE, {int(loaded[0])} experts loaded", moe_bytes),
    bytes_row(f"{moe_config.name} MoE if all {E} experts were read", all_experts),
    bytes_row(f"{big.name}, one layer, {n_big:.1f} experts", big_layer),
    bytes_row(f"{big.name}, {len(big.moe_layers)} MoE layers", len(big.moe_layers) * big_layer)]))
print(f"on {compile_chip} at {mk.chip(compile_chip).hbm_bw / 1e12:.2f} TB/s (datasheet peak), "
      f"M = {M}")

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the routing is a short serial section per MoE layer: one small matmul, a few
# cross-lane reductions, a 4·E-byte local DMA and a scalar loop over E. During it the ring
# cannot prefetch any expert tile (the ids are not known yet), so a fused kernel keeps
# other tiles in flight across it: `moe_body` only requires that expert tiles issued before
# routing were switched off (count = 0), re-issues the first `slots` of them after routing,
# and skips the unused slots without a DMA or a matmul. The expert tiles of qwen3-30b-a3b
# are small (the tile above), so many DMAs are in flight per expert; the ring's depth, not
# the tile size, hides their latency. Interpret mode shows none of this timing. A profile
# on a TPU runtime shows little more by default: a pallas_call is one op in the trace.
# With libtpu's `mk.cost.bundles.PHASE_FLAG` the megakernel's named scopes become trace markers
# (notebook 08 reads the v5e's that way): a MoE layer's `mlp` phase, its routing inside it;
# routing's own share of that phase is the simulator's to say, not the trace's.
#
# **Takeaway:** an MoE decode step is worth only the experts it touches. Getting there
# takes one idea: turn the router's vector output into SMEM scalars (a DMA and a scalar
# loop), and let those scalars address the weight DMAs of a ring whose unused slots cost
# nothing.

# %% [markdown]
# ## Questions
#
# 1. E = 128 experts, top-8, one row (M = 1). How many expert slots does the kernel
#    allocate, and how many experts' bytes does the step read?
#    <details><summary>Answer</summary>min(E, M x 8) = 8 slots, all 8 live: 8 experts'
#    gate, up and down (`mlp.expert_slots`).</details>
# 2. Why does the wrong-expert exercise need a router seed whose experts are not
#    0 .. count - 1? <details><summary>Answer</summary>With those experts slot s holds
#    expert s, so streaming expert s instead of ids[s] changes nothing.</details>
# 3. In the teaching kernel, what does the index map return for a slot past `count`, and
#    why that? <details><summary>Answer</summary>The last live slot's expert: the block
#    index does not change, so the pipeline fetches nothing new, and `pl.when` skips the
#    compute.</details>

# %%
assert moe_report.ok, moe_report.error
assert dense_report.ok, dense_report.error
assert moe_bytes < all_experts or len(picked) == E
print("checks passed")
