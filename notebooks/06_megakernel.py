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
# - How does one stream hold a hybrid's two token mixers (gated DeltaNet beside full
#   attention), and which linear states does a verifier keep?
#
# **You will** run a whole decode step in one kernel, localise a planted bug with
# `first_divergence`, and solve the mystery lab (an unnamed bug, found with the race
# detector and the taps, fixed in a copy). **You will be able to** read the step's tile
# schedule and debug a wrong step op by op. **Prerequisites:** 01-05.

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
steps: int = 6  # greedy tokens to generate
slots: int = 3  # weight ring slots
exercise_keep_row_k: bool = False  # the exercise: True keeps the states after row k, not k - 1
mystery_seed: int = 1  # the mystery lab's seed (which unnamed bug it plants); -1 skips the lab
solutions: bool = False  # True runs the mystery lab's worked answer (headless runs)

# %%
import time

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display

import mk
import mk.kernels.backend
import mk.model.cache
import mk.step.megakernel as megakernel
import mk.course.run
from mk.course import course, teach
from mk.cost import ledger, perf, sim
from mk import plots
from mk.model import reference
from mk.measure import tpu
from mk.step.plan import DecodePlan, default_block

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, mode, spec = run.config, mk.kernels.backend.resolve(run.backend), mk.chip(run.chip)
block = default_block(config, 128, slots=slots)  # KV tiles of 128 positions
print(f"{config.name}: {config.layers} layers, B={run.batch} T={run.rows} S={run.context}; "
      f"kernels run on: {mode}")

# %% [markdown]
# ## The schedule is data
#
# One device's step is a `DecodePlan` (`mk.step.plan`): the shard, the tiles, every
# VMEM buffer by name and one `TileStream`, the layer's matrices repeated for every layer
# (a hybrid's period holds both token mixers', see "Hybrids" below), then the lm_head.
# Tile g lives in ring slot g mod slots; consuming tile g issues tile
# g + slots. Below is the stream of a generation step (one row per sequence, M = B).

# %%
plan = DecodePlan.make(config, batch=run.batch, context=run.context, block=block)
stream = plan.stream
print(f"{stream.total} tiles of {block.tile_rows}x{block.tile_cols}: {stream.period} per "
      f"layer, {stream.total - config.layers * stream.period} of lm_head; ring of "
      f"{block.slots} slots")
plots.show(plots.tile_stream(stream, title=f"{config.name}: one decode step's weight tiles"))

# %% [markdown]
# ## Cross-layer prefetch
#
# The last tiles of one layer and the first of the next: layers 0 and 1, or in a hybrid the
# first full-attention layer after layer 0 and the layer before it (a linear layer does
# not load wq; "Hybrids" below shows what that costs). When the layer's last tile is
# consumed, the next `slots - 1` tiles (the next layer's wq) are already in flight: the DMA
# engine never waits for the layer edge. So are the next full layer's first KV tiles: each
# full layer issues them right after its own attention (`layer_body`'s "kv_prime" phase).
# (In an MoE layer the expert tiles are the one exception: they wait for the router.)

# %%
edge = next((layer for layer in config.full_layers if layer > 0), 1) * stream.period
table = stream.table(np.dtype(config.dtype).itemsize)
display(plots.table([{**r, "in flight when g=" + str(edge - 1) + " is consumed":
                      "yes" if edge - 1 < r["g"] < edge - 1 + block.slots else ""}
                     for r in table[edge - 3:edge + block.slots]]))

# %% [markdown]
# The same edge in time, slot by slot (`teach.ring_schedule` at the chip's modelled tile
# times, every tile active: drawn for a dense model, whose layers load every matrix): the
# tiles around the edge, layer l's last matrix in its colour, layer l + 1's wq already in
# flight in its own.

# %%
if not (config.is_moe or config.is_hybrid) and spec.kind == "tpu":
    times = teach.tile_times(spec, block, np.dtype(config.dtype).itemsize, run.batch)
    window = range(max(0, edge - 2 * block.slots), edge + 2 * block.slots)
    plots.show(plots.ring_gantt({f"{block.slots} slots": [
        t for t in teach.ring_schedule(stream, slots=block.slots, **times)
        if t["g"] in window]}, title=f"{config.name}: the tiles around the layer edge at "
                                     f"g={edge} on {spec.name} (modelled)"))

# %% [markdown]
# ## The megakernel on the page
#
# `mk.step.megakernel.megakernel_kernel`, from the module: the refs arrive as named pytrees
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
# call (decode step) in `mk.step.megakernel.generate`.

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
rows_plan = DecodePlan.make(config, batch=run.batch, rows=run.rows, context=run.context,
                            block=block)  # the same tiles, T = `rows` rows a step
with mk.kernels.backend.use(run.backend):
    got_rows, _, _ = megakernel.decode_step(rows_plan, megakernel.prepare(rows_plan, params),
                                            cache, drafted, positions)
print(f"T={run.rows}: reference {want_rows.tolist()}, megakernel {got_rows.tolist()}")

# %% [markdown]
# ## When tokens differ: the staged debug path
#
# `first_divergence` runs one step through the reference and through the megakernel with
# taps on the residual stream after every layer's attention and MLP blocks, compares them
# in execution order up to `stop_after=(layer, op)`, and names the first op whose error
# exceeds 1% of the activations' scale. Healthy, every op agrees to bf16 rounding; with a
# planted bug (layer 0's attention norm scaled by 1.5 in the megakernel's copy only) it
# points at that layer's token mixer, "attn" (in a hybrid, layer 0 is a linear layer and
# "attn" is its gated DeltaNet).

# %%
debug_tokens, debug_positions = want[:, :1], jnp.full((run.batch,), prompt.shape[1], jnp.int32)
first, report_ = megakernel.first_divergence(plan, params, cache, debug_tokens,
                                             debug_positions, backend=run.backend)
display(plots.table(report_))
weights = megakernel.prepare(plan, params)
planted = weights | {"norms": weights["norms"].at[0, 0].mul(1.5)}
planted_first, _ = megakernel.first_divergence(plan, params, cache, debug_tokens,
                                               debug_positions, backend=run.backend,
                                               weights=planted)
print(f"healthy: first divergence {first}; planted bug in layer 0's attention norm: "
      f"first divergence {planted_first}")

# %% [markdown]
# ## The mystery lab
#
# `course.mystery(seed)` plants one bug, unnamed, in the megakernel's code and gives you a
# tiny-preset step (T = 2 rows straddling a KV tile edge) that no longer matches the
# reference. **Find** it: `m.races()` runs the race detector, `m.divergence()` names the
# first wrong tap; then read the code those point at and `m.suspect("module.function")`
# tells you whether it is the planted one (and shows it). **Fix** a copy with the same
# arguments and `m.confirm(my_fix)`. (About a minute per tool in interpret mode.)

# %%
lab = course.mystery(mystery_seed) if mystery_seed >= 0 else None
if lab is not None:
    try:
        lab.check()
    except course.ExerciseFailed as caught:
        print("the step is wrong:", caught)
    print("race detector flags the step:", lab.races())

# %% [markdown]
# Your investigation goes here, in new cells. The worked answer below runs only with
# `solutions = True` (parameters cell; headless runs set it, and the site folds it), so
# Run all does not spoil the lab; `lab.where()` is the answer.

# %% tags=["hide-cell"]
if lab is not None and solutions:
    print("solutions = True: the worked answer of the mystery lab")
    print("first divergence:", lab.divergence()[0])
    display(lab.suspect(lab.where()))
    print(lab.confirm(lab.released()))  # the released function is the fix
elif lab is not None:
    print("the worked answer is skipped (solutions = False): find the bug above")

# %% [markdown]
# ## Hybrids: two token mixers in one stream
#
# A Qwen3.5 hybrid (presets `tiny-hybrid`, `qwen3.5-9b`, `qwen3.5-27b`) has gated-DeltaNet
# ("linear") layers beside gated full-attention layers. The stream repeats one period per
# layer, so the period holds both mixers' matrices: a full layer's wq, wk, wv, wq_gate and
# wo, a linear layer's lin_qkv, lin_z and lin_out (`mk.kinds.linear.deltanet.linear_mixer`), then
# the MLP. A linear layer skips the attention segments and a full layer the linear ones:
# their tiles are neither loaded nor computed (`Ring.skip` issues only the tiles past the
# skipped region). The cost of that design: the ring's look-ahead into a skipped region
# loads nothing, so HBM idles until the ring restarts at the region's end. The simulator
# (`mk.cost.sim`, a model of the chip, not a measurement) names that idle time "skipped mixer".

# %%
hybrid = config.is_hybrid
if not hybrid:
    print(f"{config.name} has no linear layers: every layer is full attention and nothing "
          "is skipped (run this notebook with preset='tiny-hybrid' for this section)")
else:
    mixers = [kind for kind in plan.kinds if kind.role == "mixer"]  # `mk.kinds`
    mixer = {n: kind.name for kind in mixers for n in kind.segment_names()}
    loaded_in = {kind.name: kind.layers for kind in mixers}
    display(plots.table([{
        "segment": s.name, "mixer": mixer.get(s.name, "MLP"),
        "tiles": f"{s.in_tiles} x {s.out_tiles}" + (" transposed" * s.transposed),
        "first g of the period": s.start,
        "loaded in layers": ", ".join(map(str, loaded_in.get(mixer.get(s.name),
                                                             range(config.layers))))}
        for s in stream.segments]))

# %%
if hybrid:
    sim_chip = run.chip if spec.kind == "tpu" else "v6e"
    simulated = sim.simulate(DecodePlan.make(config, chip=sim_chip, batch=run.batch,
                                             position=prompt.shape[1], block=block,
                                             kernel=False))
    skipped = [b for b in simulated.table("bubbles") if b["cause"] == "skipped mixer"]
    display(plots.table([{"layer": b["layer"], "kind": config.layer_types[b["layer"]],
                          "HBM idle (µs, simulated)": f"{b['idle_us']:.3g}"}
                         for b in skipped]))
    skipped_us, step_us = sum(b["idle_us"] for b in skipped), simulated.step_ms * 1e3
    print(f"simulated step on {sim_chip}: {step_us:.3g} µs, of which the 'skipped mixer' "
          f"bubble is {skipped_us:.3g} µs ({skipped_us / step_us:.1%})")

# %% [markdown]
# ### A fixed state beside a growing KV cache
#
# Each step a full layer reads every cached position of its KV cache; a linear layer reads
# its conv and recurrent states once and writes them after each of the T rows, whatever the
# context. One decode step of qwen3.5-27b at TP8 on tpu7x (`mk.cost.perf.predict`, bytes summed
# over the 8 devices, B = 1, T = 1), from 1K to 256K cached positions:

# %%
if hybrid:
    big = mk.preset("qwen3.5-27b")
    contexts = [min(2**p, big.max_position - 1) for p in range(10, 19)]  # 1K .. 256K
    estimates = [perf.predict(big, "tpu7x", tp=8, context=s) for s in contexts]
    series = {"weights": [e.weight_bytes / 2**30 for e in estimates],
              "KV cache (read + written)": [e.kv_bytes / 2**30 for e in estimates],
              "linear state (read + written)": [e.state_bytes / 2**30 for e in estimates]}
    fig = plots.lines(contexts, series, xaxis="context (cached positions)", yaxis="HBM bytes (GiB)",
                      title=f"{big.name}, TP8 on tpu7x: one decode step's HBM bytes")
    fig.update_xaxes(type="log")
    plots.show(fig)
    for e in (estimates[0], estimates[-1]):
        print(f"S={e.context}: weights {e.weight_bytes / 2**30:.3g} GiB, KV "
              f"{e.kv_bytes / 2**30:.3g} GiB, state {e.state_bytes / 2**30:.3g} GiB "
              f"({len(big.full_layers)} full, {len(big.linear_layers)} linear layers)")

# %% [markdown]
# ### Verifying T rows: the states after every row
#
# A verifier accepts a prefix of its T rows, so a linear layer must be able to restart
# from the state after any row: with `row_states=True` the step also returns
# `mk.model.cache.LinearRows`, the conv and recurrent states after each row. One megakernel
# step of T = 4 rows: the last accepted token and three drafts, the second of which is
# wrong, checked against `mk.model.reference.decode_step(..., row_states=True)`. Row 0 is always
# kept and draft t while it equals row t - 1's prediction: k rows are accepted.

# %%
if hybrid:
    T = 4
    if steps < T:
        raise ValueError(f"{steps=} must be >= T={T}: the drafts are the reference's tokens")
    drafts = want[:, :T].at[:, 2].set((want[:, 2] + 1) % config.vocab)  # draft 2 is wrong
    with mk.kernels.backend.use(run.backend):
        got_t, _, after, states = megakernel.decode_step(
            DecodePlan.make(config, batch=run.batch, rows=T, context=run.context,
                            block=block), weights, cache, drafts, positions, row_states=True)
    want_logits, _, want_states = reference.decode_step(config, params, cache, drafts,
                                                        positions, row_states=True)
    want_t = reference.greedy(want_logits)
    accepted = 1 + jnp.cumprod(drafts[:, 1:] == want_t[:, :-1], axis=1).sum(1)
    print(f"drafts     {drafts.tolist()}\nreference  {want_t.tolist()}\nmegakernel "
          f"{got_t.tolist()}\naccepted k = {accepted.tolist()} of T={T} rows")

# %% [markdown]
# The cache the step returns keeps the states after the last row; after accepting k rows
# the next step must start from the states after row k - 1, `states.state[:, :, k - 1]`,
# which is what `mk.model.cache.rollback` keeps (KV needs no rollback: rows past the accepted
# prefix are overwritten before anything attends to them). The oracle: a fresh reference
# step over only the k accepted rows.
#
# **Exercise:** set `exercise_keep_row_k = True`: the cell keeps the states after row k,
# the first rejected row. Its distance from the fresh step jumps from bf16 rounding to the
# state's own scale, and the last cell's check (the kept state is rollback's) fails.

# %%
if hybrid:
    keep = accepted - 1 + exercise_keep_row_k  # per sequence, the row the next step starts from
    kept = states.state[:, jnp.arange(run.batch), keep]  # [Ll, B, Nv, Hk, Hv] float32
    rolled = mk.model.cache.rollback(after, states, accepted)
    fresh = jnp.concatenate([reference.decode_step(
        config, params, jax.tree.map(lambda a, b=b: a[:, b:b + 1], cache), drafts[b:b + 1, :k],
        positions[b:b + 1])[1].state for b, k in enumerate(accepted.tolist())], axis=1)
    scale = float(jnp.abs(fresh).max())
    for name, x in (("kept", kept), ("rollback's", rolled.state),
                    ("the last row's (no rollback)", after.state)):
        print(f"{name} state: max |state - fresh| = {float(jnp.abs(x - fresh).max()):.3g} "
              f"(the state's scale {scale:.3g})")

# %% [markdown]
# ## VMEM budget and a real compile
#
# The buffers of this run, then the whole megakernel of a real model compiled ahead of time
# for the chosen chip (qwen3-1.7b on v5e, whose 16 GiB do not hold qwen3-8b; qwen3-8b
# elsewhere, or the hybrid qwen3.5-9b when this run's model is a hybrid), batch 8, 4096
# cached positions.

# %%
if spec.kind == "tpu":
    fit = DecodePlan.make(config, batch=run.batch, rows=run.rows, context=run.context,
                          block=block).fits(spec)  # the T-row step: the larger one
    if not fit.ok:
        raise ValueError(fit.error)
    print(f"VMEM: {fit.vmem.total_bytes / 2**20:.2f} MiB of "
          f"{fit.vmem.limit_bytes / 2**20:.0f} MiB; biggest {fit.vmem.rows()[0]['buffer']}")
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
real = mk.preset("qwen3-1.7b" if compile_chip == "v5e" else
                 "qwen3.5-9b" if config.is_hybrid else "qwen3-8b")
report = tpu.compile_megakernel(DecodePlan.make(real, chip=compile_chip, batch=8, rows=1,
                                                context=4096))
print(report.summary())

# %% [markdown]
# ## What a TPU does differently
#
# On hardware a step is its bytes over the bandwidth the DMA engine reaches, plus what the
# stream cannot hide: the first tiles of the step, each MoE layer's routing, attention's
# KV tiles (which have their own ring) and, in a hybrid, the look-ahead lost to each
# skipped mixer. A TPU v5e measured how much of that holds (the table below, device loops
# of 32 steps, random weights; "share of HBM floor" is the datasheet floor over the
# measured loop, "share of measured HBM floor" the same at the bandwidth the chip's DMA
# probe reached, issue 60's bar): the dense rows that read much KV (8 sequences, or a 4096-position cache) sit
# furthest from the floor, because the attention loop takes KV slower than the DMA engine
# brings it (`mk.cost.ledger.basis_table()` prints both rates). The performance model of a
# later notebook replays this same `TileStream` on a chip model; given those measurements
# (the "calibrated step", `mk.cost.calibration`) its error on each row is in the table. A
# one-step dispatch adds the host's call to all of it.

# %%
ledger.steps_table("v5e")

# %% [markdown]
# ## On a real chip
#
# Interpret mode checks the kernel's logic; the chip judges its lowering. The hardware tier
# (`make test-tpu` on a TPU, tests/test_tpu.py) runs every family's tiny preset there and
# judges each greedy token against the reference on the CPU, teacher-forced on the
# kernel's own tokens (`mk.measure.exactness.judge`): exact, a near-tie (the reference's two best
# logits within 1 % of their scale, where bf16 rounding may pick either) or wrong. Its
# records, by family, with the commit they measured ("stale" once kernel code changed):

# %%
ledger.verified_table()

# %% [markdown]
# **Takeaway:** the megakernel is the stage kernels' pieces in a layer loop, with one tile
# schedule for the whole step; in interpret mode its float32 tokens are the reference's,
# and on a chip the table above says how far each family's tokens are. A
# hybrid's two token mixers share that schedule, each layer skipping the other kind's
# tiles, and its linear states after every row let a verifier keep any accepted prefix.

# %% [markdown]
# ## Questions
#
# 1. Where in the stream is layer l + 1's first wq tile, and when is it issued?
#    <details><summary>Answer</summary>Right after layer l's last w_down tile: g runs on
#    across the edge, so it is issued when the tile `slots` before it is consumed, while
#    layer l's MLP computes.</details>
# 2. `first_divergence` names (3, "mlp"). Where do you look?
#    <details><summary>Answer</summary>Between the (3, "attn") tap and the (3, "mlp") tap:
#    layer 3's first residual add, MLP norm, MLP and second add.</details>
# 3. The race detector flags a step whose tokens are right. Is the kernel right?
#    <details><summary>Answer</summary>No: a race reads a slot a DMA is writing, and the
#    result depends on timing; interpret mode happened to order them well. On a TPU the
#    same code can read a half-written tile.</details>

# %%
np.testing.assert_array_equal(got, want)
np.testing.assert_array_equal(got_rows, want_rows)
assert first is None and planted_first == (0, "attn"), (first, planted_first)
assert report.ok, report.error
if hybrid:  # the T-row step, its states after every row, and the state a verifier keeps
    np.testing.assert_array_equal(got_t, want_t)
    for mine, ref in zip(states, want_states):  # conv, then recurrent state, 1% of scale
        ref = np.asarray(ref, np.float32)
        np.testing.assert_allclose(np.asarray(mine, np.float32), ref, rtol=0,
                                   atol=1e-2 * np.abs(ref).max())
    np.testing.assert_array_equal(kept, rolled.state)
    np.testing.assert_allclose(kept, fresh, rtol=0, atol=1e-2 * scale)
    assert skipped_us > 0, "the simulated step has no skipped-mixer bubble"
print("checks passed")
