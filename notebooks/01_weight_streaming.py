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
#
# **You will build** a 30-line ring kernel (`mk.course.teach.ring_matmul`), check it equals the
# real one, draw the ring slot by slot in time, and read the real `Ring.matmul`. **You will
# be able to** size a ring by Little's law and spot a ring race. **Prerequisites:** 00
# (why decode is memory-bound), 00b (HBM, VMEM, the DMA engine), 00c (a first Pallas
# kernel: BlockSpecs, then one copy by hand with `make_async_copy`); `lax.fori_loop`.

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
slots: int = 3  # ring slots of the last version
tile_rows: int = 128  # K rows per weight tile
tile_cols: int = 128  # N columns per weight tile
exercise_ring_race: bool = False  # the exercise: True reads the slot of the tile still in flight
solutions: bool = False  # True checks the worked solution in place of your kernel (headless runs)

# %%
import time

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import display

import mk
import mk.kernels.backend
import mk.course.run
from mk.course import course, teach
from mk.measure import measure, tpu
from mk.model import ops
from mk import plots, sim_plots
from mk.cost import sim
from mk.kernels.common import BlockSizes, vmem_budget
from mk.kernels.ring import Ring
from mk.kernels.stream import TileStream
from mk.kernels.weight_streaming import (stream_matmul, stream_matmul_buffers,
                                         stream_matmul_kernel)

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
mode = mk.kernels.backend.resolve(run.backend)
spec = mk.chip(run.chip)
print(f"{run.config.name}: M = B*T = {run.batch * run.rows} rows; kernels run on: {mode}")

# %% [markdown]
# ## The idea
#
# `W` [K, N] is cut into tiles of `tile_rows` x `tile_cols`, consumed column panel by column
# panel, and stored in HBM in that order (`ring_layout`: [tiles, tile_rows, tile_cols], so a
# tile is one contiguous copy; a matrix whose transpose is what the tiles divide is stored
# transposed, stage 05's row-sharded wo). Tile g lives in ring slot g mod `slots`; the
# rule is **when tile g has been consumed, issue tile g + slots into the slot it freed**.
# With one slot the DMA engine and the MXU take turns; with two, tile g+1 loads while g
# computes; with more, the extra tiles in flight absorb DMA latency. For n tiles of b
# bytes, a DMA latency $\ell$, a transfer time $d = b / \text{BW}$ and a compute time $c$
# per tile: tile g + s is issued
# only when tile g is consumed, and needs $\ell + d$ to land and $c$ to be consumed, so
# every s tiles take at least $\ell + d + c$; the DMA engine needs $d$ per tile, the MXU $c$:
#
# $$t_s \approx n\,\max\!\Big(d,\; c,\; \frac{\ell + d + c}{s}\Big),\qquad
#   t_1 = n\,(\ell + d + c).$$
#
# Decode has $t_\text{mxu} \ll t_\text{dma}$ (few rows), so the ring's job is to keep a DMA
# in flight at every instant.
#
# **How many slots? Little's law.** A queue holds on average (arrival rate) x (time in the
# queue) items. Here the DMA engine streams at the HBM bandwidth BW and each descriptor
# waits a latency $\ell$ before its bytes move, so keeping HBM busy needs
# $\text{bytes in flight} \ge \text{BW} \cdot \ell$: at least $\lceil \text{BW}\,\ell / b
# \rceil$ tiles in flight, plus one slot being computed and one landing. Two slots are
# not N slots: with fewer tiles in flight than Little's law asks, every tile pays part of
# $\ell$ with HBM idle. `mk.cost.sim.latency_slots` is this rule, and the simulator agrees
# (table below).

# %% [markdown]
# ## The reference
#
# Layer 0's query projection `wq` [D, N*H] of the run's model, times random activations.
# `mk.model.ops.matmul` rounds x to the weight dtype and accumulates in float32, as the
# MXU does.

# %%
params = mk.load_checkpoint(run.checkpoint)[1] if run.checkpoint else mk.init_params(
    run.config, run.seed)
w = params["wq"][0]
x = jax.random.normal(jax.random.key(run.seed), (run.batch * run.rows, w.shape[0]))
want = ops.matmul(x, w)
print(f"x {x.shape} @ wq {w.shape} {w.dtype} -> {want.shape}")

# %%
block = BlockSizes(slots=slots, tile_rows=tile_rows, tile_cols=tile_cols)
a = sim.Assumptions()
tile_bytes = tile_rows * tile_cols * w.dtype.itemsize
bw = spec.device_hbm_bw
need = sim.latency_slots(run.config, spec, block)
print(f"BW x latency = {bw / 1e12:.2f} TB/s x {a.dma_latency_s * 1e6:.1f} µs = "
      f"{bw * a.dma_latency_s / 1024:.0f} KiB in flight = "
      f"{bw * a.dma_latency_s / tile_bytes:.1f} tiles of {tile_bytes / 1024:.0f} KiB "
      f"-> {need} slots (Little's law, + 2)")
d, M, ring_rows = tile_bytes / bw, run.batch * run.rows, []
c = mk.cost.perf.mxu_flops(M, tile_rows * tile_cols, spec.mxu_rows) / (
    mk.cost.perf.peak_flops(spec) / spec.cores_per_chip)  # the MXU rule mk.cost.sim charges
n_tiles = (4096 // tile_rows) * (4096 // tile_cols)
for n in sorted({1, 2, 3, need // 2, need, 2 * need}):
    s = sim.replay_matmul(TileStream.build(
        BlockSizes(slots=n, tile_rows=tile_rows, tile_cols=tile_cols), [("w", 4096, 4096)]),
        spec, rows=M)
    ring_rows.append({"slots": n, "formula µs": f"{n_tiles * max(d, c, (a.dma_latency_s + d + c) / n) * 1e6:.1f}",
                      "simulated µs": f"{s.step_s * 1e6:.1f}", "HBM busy": f"{s.hbm_utilisation:.0%}"})
display(plots.table(ring_rows))

# %% [markdown]
# **Little's law against a chip.** The numbers above are the simulator's assumptions (the
# datasheet's bandwidth, an assumed latency). A TPU v5e's DMA probe (notebook 13,
# data/measured/v5e.json) timed copies of one size with more and more of them in flight;
# the law, from that chip's own measured latency and best bandwidth, says how many bytes
# must be in flight, and the table how far the chip needed to go past it:

# %%
probe_path = measure.path_for("v5e")
if probe_path.exists():
    probe = measure.load(probe_path)
    law = probe.hbm_bw * probe.dma_latency_s
    chunk = max({p.bytes for p in probe.dma}, key=lambda b: sum(p.bytes == b for p in probe.dma))
    display(plots.table([{
        "copies in flight": p.in_flight, "KiB in flight": p.bytes_in_flight // 1024,
        "x Little's law": f"{p.bytes_in_flight / law:.1f}",
        "GB/s (measured on v5e)": f"{p.bandwidth / 1e9:.0f}",
        "share of the best": f"{p.bandwidth / probe.hbm_bw:.0%}"}
        for p in sorted((p for p in probe.dma if p.bytes == chunk), key=lambda p: p.in_flight)]))
    print(f"Little's law: {probe.hbm_bw / 1e9:.0f} GB/s x {probe.dma_latency_s * 1e6:.2f} µs = "
          f"{law / 1024:.0f} KiB in flight ({probe.label}, {probe.commit[:7]}, "
          f"{probe.when[:10]})")
else:
    print(f"no probe record here ({probe_path.name} is in data/measured of a checkout of mk)")

# %% [markdown]
# **Slot by slot.** The same rule drawn per tile (`teach.ring_schedule`, which gives the
# simulator's times for this matrix, tested equal): each tile's slot row shows it in
# flight (issued -> landed, light) then consumed (solid). Press play or move the slider:
# with 1 slot nothing is in flight while a tile computes; with 2, one tile; at Little's
# law depth every latency overlaps the transfers before it.

# %%
gantt_stream = TileStream.build(BlockSizes(slots=1, tile_rows=tile_rows, tile_cols=tile_cols),
                                [("wq", *w.shape)])
gantt = {f"{n} slot{'s' * (n > 1)}": teach.ring_schedule(
    gantt_stream, slots=n, latency_s=a.dma_latency_s, dma_s=d, compute_s=c)
    for n in sorted({1, 2, need})}
plots.show(plots.ring_gantt(gantt, title=f"wq {tuple(w.shape)}: each tile in its ring slot "
                                         f"on {spec.name} (modelled)"))
print(", ".join(f"{k}: {rows[-1]['end'] * 1e6:.2f} µs" for k, rows in gantt.items()))

# %% [markdown]
# ## VMEM budget
#
# Before anything runs: every VMEM buffer of the kernel with its padded size (minor dim to
# 128 lanes, second minor to 8 rows of 32-bit / 16 of 16-bit). `vmem_budget` raises, naming
# the biggest buffers, when the total passes the chip's VMEM per core (try `slots=5000`).

# %%
block = BlockSizes(slots=slots, tile_rows=tile_rows, tile_cols=tile_cols)
if spec.kind == "tpu":
    budget = vmem_budget("stream_matmul", stream_matmul_buffers(
        x.shape[0], w.shape[0], w.shape[1], w.dtype, block), spec)
    display(plots.table(budget.rows()))
    print(f"total {budget.total_bytes / 2**20:.3f} MiB of {budget.limit_bytes / 2**20:.0f} MiB")
else:
    print(f"{spec.name} is a GPU: no VMEM budget")

# %% [markdown]
# The same replay drawn as lanes (simulated, µs): the DMA engine, the compute lane, and
# HBM idle coloured by cause. One slot: DMA and MXU take turns. Two: better, but each
# tile still waits out most of the latency ("ring empty"). Little's law depth: HBM busy.

# %%
lanes = {f"{n} slot{'s' * (n > 1)}": sim.replay_matmul(TileStream.build(
    BlockSizes(slots=n, tile_rows=tile_rows, tile_cols=tile_cols), [("w", 1024, 1024)]),
    spec, rows=M) for n in (1, 2, need)}
plots.show(sim_plots.timeline(lanes, title=f"x @ W [1024, 1024] through rings of 1, 2 and {need} "
                                       f"slots on {spec.name} (simulated)"))

# %% [markdown]
# ## The teaching version: 30 lines
#
# The whole idea with nothing else: W [K, N] stays in HBM (`pl.ANY`), a [slots, tile,
# tile] VMEM scratch is the ring, one DMA semaphore per slot. Prime `slots` tiles; per
# tile: wait, multiply, then issue tile g + slots into the slot just read.
#
# ## Exercise: write it from its spec
#
# Before you read ours, write it. Its spec is its docstring:

# %%
print(teach.ring_matmul_kernel.__doc__)

# %% [markdown]
# What you need: `pltpu.make_async_copy(src, dst, sem)` is one copy (`.start()` issues it,
# `.wait()` blocks until it landed); `w_hbm.at[pl.ds(start, size), pl.ds(...)]` is a
# window of a ref without reading it, `slots_vmem.at[s]` one slot, `sems.at[s]` its
# semaphore; `x_vmem[:, pl.ds(...)]` reads; `pl.when(cond)` guards a block at run time.
# `course.check_ring_kernel` runs yours in `teach.ring_matmul` at 1, 2 and 3 slots against
# the reference product with the race detector on, then compiles it for a v5e (Mosaic
# refuses some slices interpret mode allows: `pl.multiple_of` tells it a start is
# aligned). It fails until you write the body; `course.reveal("01-ring")` explains the answer and
# `solutions = True` (parameters cell) checks the worked kernel instead.

# %%
from jax import lax  # noqa: F401 - what your kernel needs
from jax.experimental import pallas as pl  # noqa: F401
from jax.experimental.pallas import tpu as pltpu  # noqa: F401


def my_ring_kernel(x_vmem, w_hbm, out_vmem, slots_vmem, sems, *, tile):
    """The ring kernel from the spec printed above."""
    ...


ring_error = course.check_ring_kernel(course.attempt("01-ring", my_ring_kernel, solutions))
print(f"the ring kernel passes: max error {ring_error:.1e}")

# %% [markdown]
# Ours, to set beside yours:

# %%
plots.show_source(teach.ring_matmul_kernel)

# %% [markdown]
# It equals the real kernel on this run's x and wq (and the race detector stays quiet):

# %%
taught = {}
if tile_rows == tile_cols:
    for n in sorted({1, 2, slots}):
        with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
            taught[n] = (teach.ring_matmul(x, w, slots=n, tile=tile_rows),
                         mk.kernels.backend.races_found())
        with mk.kernels.backend.use(run.backend):
            real_n = stream_matmul(x, w, block=BlockSizes(slots=n, tile_rows=tile_rows,
                                                          tile_cols=tile_cols))
        print(f"slots={n}: max |teaching - real| = "
              f"{float(jnp.abs(taught[n][0] - real_n).max()):.1e}, races: {taught[n][1]}")
else:
    print("the teaching kernel takes square tiles: tile_rows == tile_cols")

# %% [markdown]
# ## The kernel on the page
#
# The wrapper `stream_matmul` does everything static: shapes, checks, the schedule
# (`TileStream`), then `pl.pallas_call`. Read its specs: x and the output live in VMEM
# (`pltpu.VMEM`: Pallas copies them in and out), `w` is `pl.ANY`, which means *left where
# it is, in HBM*; the kernel copies it by hand. `scratch_shapes` asks for the ring, a
# [slots, tile_rows, tile_cols] VMEM buffer, and one DMA semaphore per slot.

# %%
plots.show_source(stream_matmul)

# %% [markdown]
# The kernel body receives refs in that order (inputs, outputs, scratch) and only builds a
# `Ring` over them: `prime` issues the first `slots` tiles, `matmul` consumes them.

# %%
plots.show_source(stream_matmul_kernel, Ring.start, Ring._issue, Ring._copies)

# %% [markdown]
# A tile's copy is `pltpu.make_async_copy(src, dst, sem)`: `src` the tile in HBM,
# `w_hbm.at[t]` (the weight is stored tile by tile in stream order: one address, one
# contiguous copy, whatever the matrix's shape), `dst` a ring slot, `sem` that slot's DMA
# semaphore.
# `.start()` hands the descriptor to the DMA engine and returns at once; `.wait()` blocks
# until the semaphore says the bytes landed. (A quantised weight's tile is two copies on the
# same semaphore, its packed data and its scales: notebook 12.) `Ring.start` routes tile g
# to its matrix (`_each_segment`, one `pl.when` per segment that may hold g: a run-time
# branch on a traced g) and `_issue` starts its copy. Then the loops that consume tiles,
# `lax.fori_loop`s inside the kernel:

# %%
teach.excerpt(Ring.matmul, [
    ("def tile(t, carry, *, after=None):", "slot, i, j = carry",
     "Tile t of this matrix is global tile g = base + t, in slot g % slots (the teaching "
     "version's `g % slots` across matrices and layers), contraction step i = t % steps "
     "and panel j = t // steps; the loop carries all three from trip to trip, so no trip "
     "divides."),
    ("def multiply():", "self._wait(seg, layer, copy, t, slot)",
     "Wait for tile g: the teaching `dma(g).wait()`."),
    ("xs = x[:, pl.ds(", "out_ref[:, cols] = jnp.where(i == 0, part",
     "Multiply and accumulate into the output panel, as the teaching `consume`; "
     "`_weights` dequantises a packed tile first (notebook 12)."),
    ("def multiply_then_issue(holder, holder_copy, holder_t):", "pl.when(on)(",
     "Then, and only then, issue tile g + slots into the slot just read (the teaching "
     "`refill`): directly in the steady loop, and at the edge directly too when one "
     "matrix on wherever this one runs holds it; else a search among the matrices that "
     "can follow and be on (`_following`: compares, no divide), one branch per "
     "candidate."),
    ("edge = max(0, seg.tiles - self.n)", "lax.fori_loop(first, end",
     "The loops: the steady one carries no search of the stream; the edge is cut into runs "
     "of tiles whose g + slots the same few matrices can hold, one loop each, so a trip "
     "carries only those matrices' DMA code (notebook 11 counts the bundles); none where "
     "they are all of a kind this layer is not (`TileStream.following_on`)."),
])

# %% [markdown]
# Per tile: wait for tile g (this matrix's tile t: one wait, no search), read slot g mod
# slots into the MXU (`jnp.dot`, f32 accumulation), and only *then* issue tile g + slots
# into the slot just read: the ring rule. In the steady loop tile g + slots is this
# matrix's own tile t + slots, issued directly; only the last `slots` tiles (the edge
# loops) may search which matrix, layer or tail holds it. The search costs bundles on every
# trip it is in, one DMA's code per matrix it may find (notebook 11 counts them in the
# compiled code), so the hot loop does without it, each edge loop searches only the
# matrices its own tiles can reach, and none searches where the only one it can reach is
# on wherever this matrix runs (no on/off flag, or this matrix's own layer kind). A layer
# runs one kind of each role (one token mixer, one MLP), so a matrix of another mixer
# kind is never searched from a mixer's product in its own layer: that layer skips it.
# The product itself is under no branch for its layer's kind
# (the caller runs it only in layers of that kind), so the compiler schedules the search's
# scalar work beside the MXU's.
# Each tile's product accumulates into its output panel of `out_ref` (the first
# contraction step overwrites it). Swap the order of the
# read and the start, or read the wrong slot, and the DMA overwrites a tile while the MXU
# reads it: a race.
#
# ## The kernel, three versions
#
# The same kernel with 1, 2 and `slots` slots. In interpret mode the race detector
# watches every DMA and every read of a slot. **Exercise:** set `exercise_ring_race = True`
# in the parameters: the ring then reads the slot of tile g + 1 (`mk.course.course.planted`
# swaps `Ring.slot` for that one wrong line), whose DMA is still in flight, and the last
# cell's check fails with the race detector's message.

# %%
results = {}
for n in sorted({1, 2, slots}):
    block = BlockSizes(slots=n, tile_rows=tile_rows, tile_cols=tile_cols)
    start = time.perf_counter()
    with (course.planted("ring_race" if exercise_ring_race else None),
          mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret"))):
        got = jax.block_until_ready(stream_matmul(x, w, block=block))
    seconds = time.perf_counter() - start
    results[n] = (got, mk.kernels.backend.races_found(), seconds)
    print(f"slots={n}: max |kernel - reference| = {float(jnp.abs(got - want).max()):.2e}, "
          f"races: {mk.kernels.backend.races_text(results[n][1])}, wall {seconds:.2f} s ({mode})")

# %% [markdown]
# On CPU the wall time above is the interpret-mode **simulation** (a few milliseconds per
# simulated DMA): it says nothing about a TPU. The bytes do:

# %%
weight_bytes = w.size * w.dtype.itemsize
tiles = (w.shape[0] // tile_rows) * (w.shape[1] // tile_cols)
print(f"{tiles} tiles of {tile_rows * tile_cols * w.dtype.itemsize / 1024:.0f} KiB, "
      f"{weight_bytes / 1e6:.3f} MB in all")
print(f"HBM floor on {spec.name}: {weight_bytes / spec.hbm_bw * 1e6:.2f} µs "
      f"at {spec.hbm_bw / 1e12:.2f} TB/s (datasheet peak)")

# %% [markdown]
# ## Compiled for a real TPU, with no TPU here
#
# The same kernel at the shape of qwen3-8b's MLP (x [8, 4096] @ W [4096, 12288], bf16),
# 512 x 1024 tiles, compiled ahead of time by libtpu's Mosaic compiler for the chosen chip.

# %%
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
real = BlockSizes(slots=slots, tile_rows=512, tile_cols=1024)
report = tpu.compile_for_chip(
    lambda a, b: stream_matmul(a, b, block=real),
    [jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
     jax.ShapeDtypeStruct((4096, 12288), jnp.bfloat16)], compile_chip, name="stream_matmul",
    vmem=vmem_budget("stream_matmul", stream_matmul_buffers(8, 4096, 12288, "bfloat16", real),
                     mk.chip(compile_chip)))
print(report.summary())
real_bytes = 4096 * 12288 * 2
print(f"that matmul moves {real_bytes / 2**20:.0f} MiB: HBM floor "
      f"{real_bytes / mk.chip(compile_chip).hbm_bw * 1e6:.0f} µs on {compile_chip}")

# %% [markdown]
# ## Narrow tiles, folded
#
# A tensor-parallel shard's tiles are tall and narrow: the 27B's TP8 shard streams 5120 x
# 128 tiles (notebook 10). A 128-lane tile feeds a quarter of a 512-wide output panel per
# weight push and costs the TensorCore more bundles per byte, so the ring stores such a
# plain tile **folded** (`mk.kernels.fold`): its row blocks side by side, [rows / f, f x
# cols], f = `panel_fold` (the same bytes, one contiguous DMA). The product then stacks
# x's column blocks along M (a transposed tile: x block-diagonal) so one MXU pass covers
# up to `STACK_ROWS` rows of blocks (`fold.stack`: every block at M = 1 or 8), and keeps
# the diagonal blocks: fewer bundles a tile in the compiled code
# (notebook 11 reads them per recorded shard). The check below folds a small tile and
# compares both products with the plain ones.

# %%
from mk.kernels import fold

plots.show_source(fold.folded_product)
f27 = fold.panel_fold(5120, 128)
print(f"a 5120 x 128 tile folds {f27} times: stored {fold.folded_shape((5120, 128), f27)}")
narrow = jax.random.normal(jax.random.key(seed + 1), (512, 128), jnp.float32)
f = fold.panel_fold(*narrow.shape)
folded = fold.fold_tiles(narrow, f)
xs = jax.random.normal(jax.random.key(seed + 2), (8, 512), jnp.float32)
print(f"512 x 128 folded {f}: stored {folded.shape}; blocks stacked for M = 8: "
      f"{fold.stack(f, 8)}")
# The plain products are `mk.model.ops.matmul`'s, float32 at full precision: a bare `xs @ narrow`
# on a TPU multiplies float32 in one bf16 pass (the chip found a 0.18 difference that way).
course.check_close("folded product", fold.folded_product(xs, folded, f, False),
                   ops.matmul(xs, narrow), atol=1e-3)
course.check_close("folded product, transposed",
                   fold.folded_product(xs[:, :128], folded, f, True),
                   ops.matmul(xs[:, :128], narrow.T), atol=1e-3)

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the slot count shows in time: with one slot every tile pays the DMA issue
# latency and the MXU idles while it waits; with a ring the DMA engine always has the next
# tile queued. On a TPU runtime (`backend="auto"`) the wall times printed above are real,
# but they time a call, not a stream: a call's fixed cost (host dispatch and launch, about
# 1.1 ms a step on a v5e by `mk.cost.calibration.call_seconds`, which `mk.measure.measure`
# on a v5e first met as "timing noise") dwarfs this kernel's floor printed
# above. Set a time against the floor only where the stream dwarfs the call: a
# whole decode step in a device loop (benchmarks/tpu_steps.py, notebook 06's measured
# table). The later stages put many matrices, and then every layer, into one stream, so the
# ring never drains at a matrix or layer edge.
#
# **Takeaway:** a decode kernel is a DMA schedule with some arithmetic attached; the ring
# rule "consume g, issue g + slots" is the whole schedule.
#
# ## Worked problems
#
# **1.** The compiled matmul above streams 512 x 1024 bf16 tiles (1 MiB) on `compile_chip`.
# How many slots does Little's law ask for? *Formula:* $s \ge \lceil \text{BW}\,\ell / b
# \rceil + 2$. **2.** How long do 2 slots and that many slots take for its 96 tiles, by
# $t_s = n \max(d, c, (\ell + d + c)/s)$ at M = 8 rows? Work them out, then open the
# answers (the cell's output is folded on the site):

# %% tags=["hide-output"]
big = mk.chip(compile_chip)
b, big_bw = 512 * 1024 * 2, big.device_hbm_bw
big_need = sim.latency_slots(mk.preset("qwen3-8b"), big, real)
d1, c1 = b / big_bw, mk.cost.perf.mxu_flops(8, 512 * 1024, big.mxu_rows) / (
    mk.cost.perf.peak_flops(big) / big.cores_per_chip)
t = {s: 96 * max(d1, c1, (a.dma_latency_s + d1 + c1) / s) * 1e6 for s in (2, big_need)}
print(f"1. BW x latency = {big_bw * a.dma_latency_s / 2**20:.2f} MiB < one 1 MiB tile: "
      f"{big_need} slots")
print(f"2. 2 slots: {t[2]:.0f} µs; {big_need} slots: {t[big_need]:.0f} µs; HBM floor "
      f"{96 * d1 * 1e6:.0f} µs")

# %% [markdown]
# *Takeaway:* with big tiles one latency is a fraction of a tile, so a 3-slot ring already
# hides it; small tiles (the tiny preset's 32 KiB) need many more slots for the same bytes
# in flight.
#
# ## Questions
#
# 1. In the teaching kernel, move `dma(g + slots).start()` above the `jnp.dot`. What does
#    the race detector say, and why? <details><summary>Answer</summary>A race: tile g +
#    slots lands in slot g % slots while the MXU still reads tile g from it.</details>
# 2. With 1 slot, what fraction of the step is HBM busy, by the formula?
#    <details><summary>Answer</summary>d / (l + d + c): one transfer per latency plus
#    compute.</details>
# 3. Why does the real kernel store W tile by tile (`ring_layout`) when the teaching one
#    copies a strided [tile, tile] window of W?
#    <details><summary>Answer</summary>One contiguous DMA per tile at one address, whatever
#    the matrix's shape, and one tile shape for transposed matrices.</details>
# 4. Why does `folded_product` stop stacking blocks past `STACK_ROWS` rows of M?
#    <details><summary>Answer</summary>Stacked rows are rows the MXU multiplies: at M 64
#    four stacked blocks would be 256 rows for one tile, costing more pushes than the
#    fold saves (measured: `mk.kernels.fold`'s docstring).</details>

# %%
for n, (got, races) in taught.items():
    course.check_race_free(f"teaching ring, slots={n}", races)
    course.check_close(f"teaching ring, slots={n}", got, want, rtol=1e-5, atol=1e-3)
for n, (got, races, _) in results.items():
    course.check_race_free(f"slots={n}", races)
    course.check_close(f"slots={n}", got, want, rtol=1e-5, atol=1e-3)
assert report.ok, report.error
print("checks passed")
