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
# # 03 · Decode attention over a KV cache in HBM
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/03_decode_attention.ipynb)
#
# After the prologue (stage 02) each sequence has T new query, key and value rows. This
# notebook builds the attention of those rows against the sequence's KV cache, which stays
# in HBM and is streamed tile by tile, and answers:
#
# - Which KV tiles does a decode step read, and why only those?
# - How does an online softmax attend tile by tile without ever holding a whole row of
#   scores, and how do G query heads share one kv head's tile?
# - How are the new K/V rows written into the cache in place?
# - How many bytes does attention move per step, and what does the roofline say?
#
# **You will build** a 35-line online-softmax attention kernel (`mk.course.teach.attend`), check
# it equals the real one, then read the real `attend` in annotated excerpts. **You will be
# able to** say which KV tiles a step reads, derive the online-softmax rescale, and find
# the bug when it is missing. **Prerequisites:** 01 (the weight ring: slots, DMA, wait)
# and 02 (q, k, v rows after RoPE); softmax and $e^{a-b} = e^a / e^b$.

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
kv_tile: int = 128  # cached positions per KV tile
kv_slots: int = 2  # KV tiles in the VMEM ring
solutions: bool = False  # True checks the worked solution in place of your fix (headless runs)

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
from mk.model import ops
from mk import plots
from mk.measure import tpu
from mk.kinds.attention import decode_attention as attention_module
from mk.kernels.common import BlockSizes, vmem_budget
from mk.kinds.attention.decode_attention import (decode_attention, decode_attention_buffers,
                                         write_back_rows)
from mk.kernels.kv_stream import tile_counts

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
mode = mk.kernels.backend.resolve(run.backend)
spec = mk.chip(run.chip)
c = run.config
B, T, S, N, K, H = run.batch, run.rows, run.context, c.heads, c.kv_heads, c.head_dim
block = BlockSizes(kv_tile=kv_tile, kv_slots=kv_slots)
print(f"{c.name}: B={B} T={T} S={S}, N={N} query heads share K={K} kv heads (G={N // K}), "
      f"H={H}, cache {c.dtype}; {S // block.kv_tile} tiles of {kv_tile}; kernels run on: {mode}")

# %% [markdown]
# ## The idea
#
# Row t of sequence b sits at position $p_b + t$ and sees cache positions $s \le p_b + t$.
# So sequence b needs only KV tiles $0 \ldots \lfloor (p_b + T - 1) / \text{kv\_tile}
# \rfloor$; the rest of its cache is never read, and a batch with ragged positions reads a
# ragged number of tiles. The tiles of all sequences form one stream through a
# `kv_slots`-deep VMEM ring, so the next sequence's first tile is already in flight while
# the current one finishes. The tiles holding $p_b \ldots p_b + T - 1$ (one, or two when the
# rows straddle a tile edge) get the new rows merged in VMEM, and the tile-aligned window
# of rows around them goes back to HBM (a DMA of the T rows alone does not lower: HBM row
# offsets must be multiples of the memory tile).
#
# The positions of this run (the first sequence is put at the last row of tile 0, so with
# T > 1 its new rows straddle a tile edge):

# %%
rng = np.random.default_rng(run.seed)
positions = rng.integers(0, S - T + 1, size=B)
positions[0] = min(block.kv_tile - 1, S - T)
display(plots.table([{
    "sequence": b, "positions[b]": int(p), "new rows": f"{p} .. {p + T - 1}",
    "tiles read": f"0 .. {(p + T - 1) // kv_tile}",
    "tiles written": f"{p // kv_tile} .. {(p + T - 1) // kv_tile}"}
    for b, p in enumerate(positions)]))
plots.show(plots.kv_tile_map(positions, T, kv_tile, S, title=f"The KV tiles this step reads "
                                                       f"(B={B}, T={T}, kv_tile={kv_tile})"))

# %% [markdown]
# **Online softmax.** Per query row, after tile j with scores $s_j$ (masked entries $-\infty$):
#
# $$m_j = \max(m_{j-1}, \max s_j),\quad \alpha = e^{m_{j-1} - m_j},\quad
#   \ell_j = \alpha\,\ell_{j-1} + \textstyle\sum e^{s_j - m_j},\quad
#   a_j = \alpha\,a_{j-1} + e^{s_j - m_j} V_j,$$
#
# and the output is $a / \ell$ after the last tile. The G query heads of one kv head and
# their T rows, $G \cdot T$ rows in all, meet its K tile in one matmul: GQA reads each K/V
# byte once for G heads.
#
# **Bytes.** Attention reads K and V of every visible position of every layer:
# $\text{bytes per layer} = \sum_b 2\,K\,H\,(p_b + T)\cdot\text{itemsize}
# \approx B \cdot K \cdot H \cdot 2 \cdot \text{positions} \cdot \text{itemsize}$; the
# kernel reads whole tiles, so up to kv_tile - 1 positions more per sequence.

# %% [markdown]
# ## The reference
#
# Random q, new K/V rows and a random cache with `c.layers` layers; the step works on the
# last layer. `mk.model.ops.write_rows` puts the new rows in the cache, then
# `mk.model.ops.attention` attends causally (q and k rounded to the cache dtype, f32
# scores, probabilities rounded to the cache dtype before P @ V).

# %%
keys = jax.random.split(jax.random.key(run.seed), 5)
q = jax.random.normal(keys[0], (B * T, N * H), jnp.float32)
k_new, v_new = (jax.random.normal(k, (B * T, K * H), jnp.float32) for k in keys[1:3])
k_cache, v_cache = (jax.random.normal(k, (c.layers, B, K, S, H), jnp.float32).astype(c.dtype)
                    for k in keys[3:])
pos, layer = jnp.asarray(positions, jnp.int32), c.layers - 1
k_want, v_want = (cache.at[layer].set(ops.write_rows(cache[layer],
                                                     new.reshape(B, T, K, H), pos))
                  for cache, new in ((k_cache, k_new), (v_cache, v_new)))
o_want = ops.attention(q.reshape(B, T, N, H), k_want[layer], v_want[layer], pos)
o_want = o_want.reshape(B * T, N * H)
print(f"q {q.shape}, k_new {k_new.shape}, caches {k_cache.shape} -> o {o_want.shape}")

# %% [markdown]
# ## The kernel
#
# `decode_attention` is a thin wrapper around `attend`, the in-kernel body the fused layer
# and the megakernel call. In interpret mode the race detector watches every DMA, every
# write-back and every read of a ring slot.

# %%
start = time.perf_counter()
with mk.kernels.backend.use(run.backend, detect_races=(mode == "interpret")):
    o, k_got, v_got = jax.block_until_ready(
        decode_attention(q, k_new, v_new, k_cache, v_cache, pos, layer=layer, block=block))
seconds = time.perf_counter() - start
races = mk.kernels.backend.races_found()
print(f"max |kernel - reference| = {float(jnp.abs(o - o_want).max()):.2e}, races: "
      f"{mk.kernels.backend.races_text(races)}, wall {seconds:.2f} s ({mode})")

# %% [markdown]
# On CPU that wall time is the interpret-mode **simulation** of the TPU (milliseconds per
# simulated DMA, plus tracing): it says nothing about a TPU. The difference from the
# reference is the online softmax's rounding: it rounds unnormalised probabilities to the
# cache dtype, the reference normalised ones.

# %% [markdown]
# ## The teaching version: 35 lines
#
# One sequence, one kv head: its G heads' T rows (G*T rows, row r is head r // T, new row
# r % T) against that head's cache, which already holds the new rows. The grid runs over
# KV tiles; the index map stops at the last visible tile (past it the block index repeats,
# so the pipeline loads nothing new), and `pl.when` skips the compute there. The update is
# the formula above, five lines. One visible tile's work (scores, mask, update) is its own
# function, `attend_tile`.
#
# ## Exercise: one KV tile from its spec
#
# Before you read ours, write `attend_tile`. Its spec is its docstring:

# %%
print(teach.attend_tile.__doc__)

# %% [markdown]
# What you need: `lax.dot_general(a, b, (((1,), (1,)), ((), ())),
# preferred_element_type=jnp.float32)` is a @ b.T; `lax.broadcasted_iota(jnp.int32, shape,
# axis)` numbers the rows (axis 0) or columns (axis 1) of an array; `jnp.where(mask, x,
# -jnp.inf)` masks; `update` is the online-softmax step (given, shown below).
# `course.check_attend_tile` runs yours as the tile of `teach.attend` for rows just past
# the first tile edge (they read all of tile 0 and part of tile 1) against the reference.
# It fails until you write the body; `course.reveal("03-tile")` explains the answer and
# `solutions = True` (parameters cell) checks the worked one instead.

# %%
import math  # noqa: F401 - what your tile needs

from jax import lax  # noqa: F401


def my_attend_tile(m, l, acc, q, k, v, start, position, *, rows, update):
    """One KV tile from the spec printed above: return the new (m, l, acc)."""
    ...


tile_error = course.check_attend_tile(course.attempt("03-tile", my_attend_tile, solutions))
print(f"your attend_tile passes: max error {tile_error:.1e}")

# %% [markdown]
# Ours, to set beside yours, and the kernel that calls it on every visible tile:

# %%
plots.show_source(teach.online_softmax_update, teach.attend_tile, teach.attend_kernel)

# %% [markdown]
# Run per (sequence, kv head) on this run's inputs, against the real kernel's output (the
# caches it returned hold the new rows):

# %%
G = N // K


def head_group(o, b, k):  # [B*T, N*H] -> rows (g, t) of sequence b's kv head k
    return o.reshape(B, T, N, H)[b][:, k * G:(k + 1) * G].transpose(1, 0, 2).reshape(G * T, H)


with mk.kernels.backend.use(run.backend):
    taught = {(b, k): teach.attend(head_group(q, b, k), k_got[layer, b, k], v_got[layer, b, k],
                                   pos[b], rows=T, kv_tile=kv_tile)
              for b in range(B) for k in range(K)}
teach_error = max(float(jnp.abs(t - head_group(o, b, k)).max()) for (b, k), t in taught.items())
print(f"max |teaching - real kernel| = {teach_error:.1e} over {B * K} (sequence, kv head) pairs")

# %% [markdown]
# ## The real `attend`, annotated
#
# The real body does the same update for every sequence and kv head in one stream, pipelined
# by hand (the teaching version lets the grid pipeline do it), and writes the new rows:

# %%
teach.excerpt(attention_module._Call.attend_tile, [
    ("def attend_tile(", "s.m[rows, :] = m_next",
     "The teaching update, per kv head k: R = G*T rows padded to 8 meet the K tile in one "
     "matmul (GQA reads each K byte once for G heads); m, l, acc live in VMEM scratch."),
], title="One KV tile (a phase of `attend`)")

# %%
teach.excerpt(attention_module.attend, [
    ("def step(g, carry):", "kv.start(ahead, (g + slots - 1) % slots)",
     "The hand pipeline: one loop over every sequence's tiles; tile g + slots - 1 is "
     "issued into the slot tile g - 1 left, so the next sequence's first tile is in "
     "flight while this one finishes."),
    ("def start_sequence():", "s.acc[...] = jnp.zeros",
     "A new sequence restarts the running max, sum and accumulator (the teaching "
     "version's `start` at grid step 0)."),
    ("def write_new_rows():", "attend_tile(b, i, p, slot)",
     "A tile holding new rows gets them merged in VMEM (`merge_new_rows`) before attention "
     "reads it (`attend_tile`, above): the new rows are attended to and written back from "
     "the same tile."),
    ("def finish_sequence():", "out[...] = s.acc[...] / s.l[...]",
     "After a sequence's last visible tile: the output is acc / l, as the teaching "
     "`finish`."),
])

# %% [markdown]
# ## Exercise: the missing rescale
#
# Below is the update with one line's worth of idea missing. **Predict** before you run:
# (a) for a sequence whose rows all sit in tile 0 (position + T <= kv_tile), is the output
# still right? (b) for rows that read two tiles, which way is the error: does tile 0 weigh
# too much or too little? Then **fix** a copy: `my_update` must pass
# `course.check_attend_update` (two KV tiles, a strong key at the start of the second).

# %%
plots.show_source(course.update_without_rescale)
try:
    course.check_attend_update(course.update_without_rescale)
except course.ExerciseFailed as caught:
    print("the check catches the broken update:", caught)

# %% [markdown]
# Write your fix in the next cell: `my_update` takes and returns what the broken update
# does. Its check fails until you write it; `solutions = True` (parameters cell) checks
# the worked solution instead, and `course.reveal("03-rescale")` explains it.

# %%
def my_update(m, l, acc, scores, v):
    """The update above with its mistake fixed: the running max m, sum l and accumulator
    acc after one more KV tile of scores and values v. Return (m_next, l_next, acc_next)."""
    ...


fix_error = course.check_attend_update(course.attempt("03-rescale", my_update, solutions))
print(f"the update passes: max error {fix_error:.1e}")

# %% [markdown]
# ## Check
#
# The output within the bf16/f32 tolerance of the tests; the caches equal the reference's
# bit for bit (the new rows, cast, and nothing else changed); no race.

# %%
tolerance = {"float32": 1e-5, "bfloat16": 1e-2}[c.dtype]
np.testing.assert_allclose(o, o_want, atol=tolerance, rtol=tolerance)
np.testing.assert_array_equal(np.asarray(k_got), np.asarray(k_want))
np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_want))
assert not races, "the race detector flagged the kernel"
print("kernel matches the reference; caches updated exactly")

# %% [markdown]
# ## VMEM budget
#
# Every VMEM buffer of the stage kernel with its padded size. The ring is
# `kv_slots` x [K, kv_tile, H] for K and for V; q and the outputs are regrouped into
# 8-row-aligned blocks of $R = \lceil G T / 8 \rceil \cdot 8$ rows per (sequence, kv head),
# because Mosaic loads and stores at dynamic row offsets only in whole (8, 128) tiles.

# %%
if spec.kind == "tpu":
    budget = vmem_budget("decode_attention", decode_attention_buffers(
        B, T, N, K, H, c.dtype, block, operands=True), spec)
    display(plots.table(budget.rows()))
    print(f"total {budget.total_bytes / 2**20:.3f} MiB of {budget.limit_bytes / 2**20:.0f} MiB")
else:
    print(f"{spec.name} is a GPU: no VMEM budget")

# %% [markdown]
# ## Compiled for a real TPU, with no TPU here
#
# qwen3-8b's attention (N=32, K=8, H=128, bf16 cache) for B=8 sequences of S=4096, the
# run's T (or 1 if 8*T rows are too many), 256-position tiles in a 3-deep ring; the layer is
# a traced argument, as in the megakernel. libtpu's Mosaic compiler does the real lowering.

# %%
compile_chip = run.chip if spec.kind == "tpu" else "v6e"
big, RB, RS = mk.preset("qwen3-8b"), 8, 4096
RT = T if RB * T <= 64 else 1
real = BlockSizes(kv_tile=256, kv_slots=3)
rows_q, rows_kv = (RB * RT, big.q_width), (RB * RT, big.kv_width)
cache_shape = (2, RB, big.kv_heads, RS, big.head_dim)
args = [jax.ShapeDtypeStruct(s, d) for s, d in (
    (rows_q, "float32"), (rows_kv, "float32"), (rows_kv, "float32"), (cache_shape, big.dtype),
    (cache_shape, big.dtype), ((RB,), "int32"), ((), "int32"))]  # the last is the layer

# %%
real_budget = vmem_budget("decode_attention", decode_attention_buffers(
    RB, RT, big.heads, big.kv_heads, big.head_dim, big.dtype, real, operands=True),
    mk.chip(compile_chip))
report = tpu.compile_for_chip(lambda *a: decode_attention(*a[:6], layer=a[6], block=real),
                              args, compile_chip, name="decode_attention", vmem=real_budget)
print(report.summary())

# %% [markdown]
# ## Bytes and the roofline
#
# The bytes this run's step moves in its one layer, against the visible-position count of
# the formula above, and the HBM floor they set on the chosen chip:

# %%
row_bytes = 2 * K * H * jnp.dtype(c.dtype).itemsize  # K and V of one position
ideal = sum((int(p) + T) * row_bytes for p in positions)
read, written = tile_counts(positions, T, block.kv_tile)
W = write_back_rows(T, block.kv_tile, c.dtype)
moved = (read * block.kv_tile + written * W) * row_bytes
print(f"visible K/V: {ideal / 1024:.1f} KiB; the kernel reads {read} tiles = "
      f"{read * block.kv_tile * row_bytes / 1024:.1f} KiB and writes back {written} windows "
      f"of {W} rows = {written * W * row_bytes / 1024:.1f} KiB")
print(f"HBM floor on {spec.name}: {moved / spec.hbm_bw * 1e9:.1f} ns per layer at "
      f"{spec.hbm_bw / 1e12:.2f} TB/s (datasheet peak)")

# %% [markdown]
# At the real shape, every sequence at its last position, across all its layers:

# %%
full = RB * 2 * big.kv_heads * big.head_dim * RS * jnp.dtype(big.dtype).itemsize
hbm = mk.chip(compile_chip).hbm_bw
flops = 4 * RB * RT * big.heads * big.head_dim * RS  # QK^T and PV
print(f"qwen3-8b, B={RB}, S={RS}: {full / 2**20:.0f} MiB of K/V per layer, "
      f"{big.layers * full / 2**30:.2f} GiB per step of {big.layers} layers; HBM floor "
      f"{big.layers * full / hbm * 1e3:.2f} ms per step on {compile_chip}")
print(f"intensity {flops / full:.1f} FLOP/byte vs the ridge point "
      f"{mk.chip(compile_chip).ridge_flop_per_byte:.0f}: attention is HBM-bound")

# %% [markdown]
# ## What a TPU does differently
#
# On hardware the ring overlaps the DMA of tile g + kv_slots - 1 with the matmuls of tile g,
# so the step would take the bytes over the bandwidth if each tile's compute (two small
# matmuls per kv head, the online softmax) were shorter than its DMA. On a v5e it is not:
# the attention loop took KV slower than the DMA engine brings weights
# (`mk.cost.ledger.basis_table()` prints both measured rates), so the steps that read much KV
# sit furthest from the floor (notebook 06's measured table). What the simulation cannot show: DMA issue
# latency per tile (larger tiles amortise it, at VMEM cost), whether a written tile's
# write-back, sent from a staging slot and waited for only when that slot comes round
# again (`drain_write_backs` at the kernel's end), ever holds the next layer up, and how
# long the Mosaic code for the row regrouping takes. Unlike the weights, the KV bytes grow with every sequence's length and do not shrink with batching:
# G heads share a tile, but sequences never do.
#
# **Takeaway:** decode attention is a KV stream whose length each sequence sets at run
# time; read exactly the visible tiles, share each tile across the G query heads of its kv
# head, and update the cache inside the same stream.

# %% [markdown]
# ## Questions
#
# 1. A batch has positions [5, 300] with T = 1 and kv_tile = 128. How many KV tiles does
#    the step read?
#    <details><summary>Answer</summary>1 + 3 = 4: sequence 0 reads tile 0, sequence 1
#    tiles 0, 1, 2 (position 300 is in tile 2).</details>
# 2. Why can the first tile's update skip the rescale, whatever its scores?
#    <details><summary>Answer</summary>m starts at -inf and l, acc at 0: alpha = exp(-inf)
#    = 0 multiplies zeros. Every row's first tile holds position 0, which every row sees,
#    so m is finite after it.</details>
# 3. G = 4 query heads share a kv head. How many times does the kernel read each K tile,
#    and how many query rows meet it in one matmul for T = 2?
#    <details><summary>Answer</summary>Once; G*T = 8 rows (padded to a multiple of 8).
#    </details>
# 4. Why does the kernel write back a 16-row window and not the one new row?
#    <details><summary>Answer</summary>HBM row offsets of a DMA must be tile-aligned: a bf16
#    tile has 16 sublane rows, so the aligned window around the row goes back.</details>

# %% [markdown]
# ## Checks

# %%
assert teach_error <= tolerance, f"the teaching attend differs from the kernel: {teach_error}"
assert fix_error < 2e-2
assert report.ok, report.error
assert read == sum((int(p) + T - 1) // block.kv_tile + 1 for p in positions)
assert read * block.kv_tile >= sum(int(p) + T for p in positions), "a visible row is unread"
print("checks passed")
