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
# # 00c · A first Pallas kernel: a copy, two ways
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/00c_first_pallas_kernel.ipynb)
#
# Notebook 00b drew where a kernel's arrays live. This one writes the smallest Pallas TPU
# kernel that moves them, a copy, twice: once the way Pallas does it for you, once by
# hand, the way every later kernel of the course moves its weights. It answers:
#
# - What are `pl.pallas_call`, a `grid` and a `BlockSpec`, and what does Pallas do with
#   them between HBM and VMEM?
# - What does the same copy look like when the kernel moves the bytes itself, with a DMA
#   (`pltpu.make_async_copy`), a VMEM buffer and a semaphore?
# - What goes wrong when a kernel reads a buffer before its copy has landed, and how does
#   the race detector see it?
#
# **You will** run a BlockSpec copy, write the hand copy from its spec (a check grades it),
# predict what a misplaced `.start()` does, and compile the kernel for a TPU with no TPU
# here. **You will be able to** read the specs and the scratch of any kernel in this
# course. **Prerequisites:** 00b (HBM, VMEM, the DMA engine); `lax.fori_loop`.

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
block_rows: int = 8  # rows of x per block (per grid step, per hand-written copy)
solutions: bool = False  # True checks the worked solution in place of your kernel (headless runs)

# %%
import jax
import jax.numpy as jnp

import mk
import mk.kernels.backend
import mk.course.run
from mk.course import course, teach
from mk import plots
from mk.cost import sim
from mk.measure import tpu

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
mode = mk.kernels.backend.resolve(run.backend)
x = jax.random.normal(jax.random.key(run.seed), (8 * block_rows, 256))
print(f"x {x.shape} {x.dtype}: {x.shape[0] // block_rows} blocks of {block_rows} rows; "
      f"kernels run on: {mode}")

# %% [markdown]
# ## One kernel, three pieces
#
# `pl.pallas_call(kernel, out_shape=..., grid=..., in_specs=..., out_specs=...)` turns a
# Python function of **refs** into a JAX function of arrays. A ref is a mutable view of a
# buffer in one memory space; the kernel reads it (`x_ref[...]`) and writes it
# (`o_ref[...] = ...`) and returns nothing. Three pieces say what the kernel sees:
#
# - `grid=(n,)`: run the kernel n times, as `for i in range(n)`; each run is a grid
#   **step**, and `pl.program_id(0)` is its i.
# - `BlockSpec(block_shape, index_map)`: at step i, the kernel sees the block of the array
#   of shape `block_shape` whose *block* index is `index_map(i)`: with blocks of
#   `block_rows` rows and the index map `lambda i: (i, 0)`, rows `[i * block_rows, (i + 1)
#   * block_rows)`.
# - The pipeline: before step i runs, Pallas has copied its input blocks from HBM into
#   VMEM; after it, it copies the output block back. It keeps two VMEM buffers per operand
#   (**double buffering**), so block i + 1 loads while step i computes and block i - 1 is
#   written back. The kernel sees only VMEM refs and never a DMA.
#
# The whole copy, the kernel's body one line:

# %%
plots.show_source(teach.block_copy_kernel, teach.block_copy)

# %% [markdown]
# Step by step, the block each step sees, then the copy run (on a CPU, in TPU interpret
# mode: `mk.kernels.backend.use(run.backend)`, the course's one switch; no kernel of the course
# passes `interpret=True` itself) and checked against its reference, x itself:

# %%
for i in range(x.shape[0] // block_rows):
    print(f"step {i}: index_map -> block ({i}, 0) = rows {i * block_rows}..."
          f"{(i + 1) * block_rows - 1} of x and of the output")
with mk.kernels.backend.use(run.backend):
    by_blocks = teach.block_copy(x, block_rows=block_rows)
course.check_close("the BlockSpec copy", by_blocks, x, atol=0.0, rtol=0.0)
print("equal to x, bit for bit")

# %% [markdown]
# ## The same copy by hand
#
# Notebook 01's weights are too big to wait for block by block and need a schedule no
# index map can say (a ring of slots, tiles of many matrices and layers in one stream).
# So its kernels ask Pallas to leave an input where it is: `BlockSpec(memory_space=pl.ANY)`
# hands the kernel a ref to the whole array **in HBM**, which the kernel cannot read, only
# copy from. What the pipeline did is then the kernel's to write:
#
# - `scratch_shapes=[pltpu.VMEM((block_rows, C), dtype), pltpu.SemaphoreType.DMA((2,))]`
#   asks for a VMEM buffer and two DMA semaphores; the kernel receives them as refs after
#   its inputs and outputs.
# - `copy = pltpu.make_async_copy(src, dst, sem)` describes one copy of a ref's window
#   (`x_hbm.at[pl.ds(start, size)]`: rows start .. start + size - 1, read nothing) into
#   another; `copy.start()` hands it to a DMA engine and returns at once; `copy.wait()`
#   blocks until `sem` says its bytes have landed.
#
# ## Exercise: write it from its spec
#
# No grid this time: one kernel run loops over the blocks itself. Its spec is its
# docstring:

# %%
print(teach.hand_copy_kernel.__doc__)

# %% [markdown]
# `teach.hand_copy` builds the `pallas_call` around your kernel (both arrays `pl.ANY`, the
# buffer and the two semaphores as scratch). `course.check_copy_kernel` runs it at 8 and
# 32 rows a block with the race detector on, checks the copy bit for bit and that every
# copy started was waited for. Write the body in place of the `...`; `pl.multiple_of(start,
# block_rows)` tells the TPU compiler a start is a whole number of blocks.
# `course.reveal("00c-copy")` explains the answer; `solutions = True` (parameters cell)
# checks the worked kernel instead.

# %%
from jax import lax  # noqa: F401 - what your kernel needs
from jax.experimental import pallas as pl  # noqa: F401
from jax.experimental.pallas import tpu as pltpu  # noqa: F401


def my_copy_kernel(x_hbm, o_hbm, buf_vmem, sems, *, block_rows):
    """The hand copy from the spec printed above."""
    ...


copied = course.check_copy_kernel(course.attempt("00c-copy", my_copy_kernel, solutions))
print(f"your copy kernel passes: {copied} blocks copied bit for bit, no race, no copy left")

# %% [markdown]
# Ours, to set beside yours, and its `pallas_call`:

# %%
plots.show_source(teach.hand_copy_kernel, teach.hand_copy)

# %% [markdown]
# Run on this notebook's x with the race detector on (it watches every DMA and every read
# and write of a buffer, in interpret mode only):

# %%
with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
    by_hand = teach.hand_copy(x, block_rows=block_rows)
    hand_races = mk.kernels.backend.races_found()
course.check_close("the hand copy", by_hand, x, atol=0.0, rtol=0.0)
print(f"equal to x, bit for bit; races: {mk.kernels.backend.races_text(hand_races)}")

# %% [markdown]
# ## Predict, then run
#
# `course.copy_out_before_wait` is our kernel with one line moved: the copy out of the
# buffer starts *before* the copy into it is waited for.

# %%
plots.show_source(course.copy_out_before_wait)

# %% [markdown]
# **Predict** before you run the next cell, on two blocks in interpret mode: are the
# copied values right? What does the race detector say?
#
# <details><summary>Answer</summary>The values come out right, and the race detector
# flags a race on the buffer at each block (its report names the two copies' lines).
# Interpret mode runs a DMA when it is waited for, so here the copy in happens to finish
# before the copy out reads; nothing made it so. On a TPU both DMAs are in flight at once
# and the copy out may read bytes of the previous block, or half of this one: wrong
# values, now and then, with no error. Only a `.wait()` orders a DMA before what follows
# it; the detector finds the missing one even when the values are right.</details>

# %%
two_blocks = x[:2 * block_rows]
with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
    early = teach.hand_copy(two_blocks, block_rows=block_rows,
                            kernel=course.copy_out_before_wait)
    early_races = mk.kernels.backend.races_found()
print(f"values equal to x: {bool(jnp.array_equal(early, two_blocks))}; "
      f"races: {mk.kernels.backend.races_text(early_races)}")

# %% [markdown]
# ## What the grid did that ours does not
#
# Ours waits for every copy before starting the next, so the DMA engine idles through
# each copy's latency, twice a block; the BlockSpec pipeline overlaps block i + 1's load
# with block i's write-back. On a TPU-sized copy ([4096, 1024] bf16 in blocks of 256 rows)
# the **modelled** times (`mk.cost.sim`'s assumed DMA latency and the datasheet's HBM
# bandwidth; nothing is timed here):

# %%
compile_chip = run.chip if mk.chip(run.chip).kind == "tpu" else "v6e"
big, big_rows = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), 256
spec, latency = mk.chip(compile_chip), sim.Assumptions().dma_latency_s
blocks, block_bytes = big.shape[0] // big_rows, big_rows * big.shape[1] * 2
one_way = block_bytes / spec.device_hbm_bw
print(f"{blocks} blocks of {block_bytes // 1024} KiB on {compile_chip}: by hand, each "
      f"copy waited for, {blocks * 2 * (latency + one_way) * 1e6:.1f} µs; the HBM floor "
      f"(every byte read and written once, back to back) {2 * blocks * one_way * 1e6:.1f} µs")

# %% [markdown]
# Closing that gap is notebook 01: keep the next copies in flight while the current block
# is used, in a ring of VMEM slots, each with its own semaphore.
#
# ## Compiled for a TPU, with no TPU here
#
# Interpret mode checks values and races, not what the chip accepts. libtpu's Mosaic
# compiler, run ahead of time for the chip (`mk.measure.tpu.compile_for_chip`, as notebook 01
# does), lowers both copies at that size:

# %%
reports = [tpu.compile_for_chip(lambda a, f=f: f(a, block_rows=big_rows), [big], compile_chip,
                                name=f.__name__) for f in (teach.block_copy, teach.hand_copy)]
for report in reports:
    print(report.summary())

# %% [markdown]
# **Takeaway.** A Pallas TPU kernel is a function of refs. With a grid and BlockSpecs,
# Pallas moves the blocks between HBM and VMEM and overlaps the moves for you; with
# `pl.ANY`, a VMEM scratch and a DMA semaphore the kernel moves them itself:
# `make_async_copy(src, dst, sem).start()`, then `.wait()` before anything touches `dst`.
# That pair is the move every later kernel of the course is built from.
#
# **Further reading** (JAX's documentation, docs.jax.dev): *Pallas Quickstart*; *Grids
# and BlockSpecs*; *Quickstart: TPU*; *Software Pipelining*; and *TPU Pipelining*, the
# memory spaces and the pipeline this notebook wrote by hand.
#
# ## Questions
#
# 1. x has 64 rows and `block_rows` is 8. How many grid steps does `block_copy` run, and
#    which rows does step 3 see? <details><summary>Answer</summary>8 steps; step 3's index
#    map gives block (3, 0), rows 24 to 31.</details>
# 2. Why can the hand kernel not write `buf_vmem[...] = x_hbm[rows]`?
#    <details><summary>Answer</summary>x_hbm is in HBM (`pl.ANY`): a kernel cannot load
#    from it, only copy a window of it with a DMA.</details>
# 3. In `hand_copy_kernel`, drop `copy_out.wait()`. What does interpret mode show, and
#    what would a TPU do? <details><summary>Answer</summary>Interpret mode runs a DMA when
#    it is waited for, so the copies out never run: the output stays uninitialised (NaN)
#    and the exit check lists every copy out as never waited for (`course.check_copy_kernel`
#    fails saying so). On a TPU the next block's copy in would overwrite the buffer while
#    the copy out may still read it, and the kernel could end before the last block
#    landed.</details>

# %% [markdown]
# ## Checks

# %%
course.check_close("the BlockSpec copy", by_blocks, x, atol=0.0, rtol=0.0)
course.check_close("the hand copy", by_hand, x, atol=0.0, rtol=0.0)
if mode == "interpret":
    course.check_race_free("the hand copy", hand_races)
    assert early_races, "the race detector missed the copy out started before the wait"
for report in reports:
    assert report.ok, report.error
print("checks passed")
