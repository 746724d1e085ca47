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
# # 12 · Quantised weights
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/12_quantised_weights.ipynb)
#
# A decode step that streams at the HBM floor is as fast as its bytes are few, so there the
# storage format of the weights is the speed; a format whose tiles take longer to decode
# than to arrive is not: a TPU v5e measured an fp4 tile of 27 % of a bf16 tile's bytes in
# 97 % of its time (data/measured/v5e-tiles.json; 11b's tables print the compiled loops'
# issue time per tile, by storage).
# This notebook answers:
#
# - How are int8, fp8, int4 and fp4 (MXFP4) weights laid out, bit by bit, and how does a
#   kernel turn one streamed tile back into numbers?
# - How far from the bf16 model does each format decode?
# - How many bytes does one step read per format, what HBM floor does that give, and which
#   presets fit one Colab chip (v5e-1, v6e-1)?
# - How does the weight ring stream a packed tile, and does the megakernel decode the
#   reference's tokens from the same quantised weights?
#
# Everything runs on the CPU: the formats and the oracle (`mk.model.quant`, `mk.model.reference`), the
# byte counts (`mk.cost.perf.predict(..., formats=)`, the plan's own), the capacity check
# (`DecodePlan.fits`), and the megakernel streaming packed tiles (interpret mode here, Mosaic
# on a TPU).
#
# **You will** decode int8, fp8, int4 and fp4 weights bit by bit and stream packed tiles
# through the ring. **You will be able to** say what each format saves in bytes and
# costs in accuracy. **Prerequisites:** 01 (the ring), 06 (the megakernel). Part II.

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
preset: str = "tiny-moe"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 1  # B, sequences decoded together
rows: int = 1  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v5e"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
dense_format: str = "int8"  # storage of the dense projections: bf16, int8, fp8, int4 or fp4
expert_format: str = "int4"  # storage of the experts (MoE models): bf16, int8, fp8, int4, fp4
lm_head_format: str = "int8"  # storage of an untied lm_head: bf16, int8, fp8, int4 or fp4
accuracy_steps: int = 64  # greedy tokens of the accuracy comparison
fit_batch: int = 8  # B of the per-preset byte and capacity tables
fit_context: int = 4096  # S of the per-preset byte and capacity tables
exercise_scale: float = 1.0  # the exercise: 2.0 doubles one group's scale (a wrong quantiser)

# %%
import contextlib
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import plotly.graph_objects as go
from IPython.display import Markdown, display
from tqdm.auto import tqdm

import mk
import mk.course.run
from mk.step import megakernel
from mk.model import ops, quant, unpack
from mk.cost import perf
from mk import plots
from mk.model.config import finite_number
from mk.model.presets import PRESET_NAMES
from mk.kernels.common import BlockSizes, dma_log
from mk.step.plan import DecodePlan, capacity
from mk.kernels.ring import Ring
from mk.kernels.weight_streaming import stream_matmul

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
FORMATS = ("bf16", *quant.SCHEMES)
for field, value in (("dense_format", dense_format), ("expert_format", expert_format),
                     ("lm_head_format", lm_head_format)):
    perf.check_choice(field, value, FORMATS)
finite_number("exercise_scale", exercise_scale, open_low=True)  # a factor on a scale


def schemes(config, dense, experts, lm_head):
    """The families' schemes for `config` (None: stays bf16; no experts or tied head: None)."""
    return dict(dense=None if dense == "bf16" else dense,
                experts=None if experts == "bf16" or not config.is_moe else experts,
                lm_head=None if lm_head == "bf16" or config.tie_embeddings else lm_head)


MIX = (dense_format, expert_format, lm_head_format)  # this run's formats, per family
TABLE_FORMATS = {**{fmt: (fmt,) * 3 for fmt in FORMATS}, "mix": MIX}
chosen = schemes(run.config, *MIX)
print(f"{run.config.name}: B={run.batch} T={run.rows} S={run.context} on {run.chip}; {chosen}")

# %% [markdown]
# ## The formats, bit by bit
#
# Every format stores small codes plus a scale per group of values: the scale carries the
# magnitude, the codes the shape. The layouts, as `mk.model.quant`'s design page documents them
# (docs/design/mk.model.quant.md, once, there):

# %%
design = Path(mk.__file__).resolve().parent.parent / "docs" / "design" / "mk.model.quant.md"
if design.exists():  # a checkout; an installed package has no docs/
    doc = design.read_text(encoding="utf-8")
    print(doc[doc.index("Layouts."):doc.index("Accuracy against bf16")])
else:
    print("the layouts: docs/design/mk.model.quant.md in the repository")

# %% [markdown]
# One stored byte of each format. int8 and fp8 hold one value per byte; int4 and fp4 hold two,
# and the scales add a little: per value, 32 bits per output column over I values for int8, a
# float32 per 128 x 128 block for fp8, a bf16 per 128 for int4, one e8m0 byte per 32 for fp4.

# %%
FIELDS = {  # (label, bits, colour) from the most significant bit down
    "int8": [("q (two's complement)", 8, "#1f77b4")],
    "fp8 e4m3": [("sign", 1, "#d62728"), ("exponent (bias 7)", 4, "#2ca02c"),
                 ("mantissa", 3, "#ff7f0e")],
    "int4 x2": [("row 2b+1: q+8", 4, "#9467bd"), ("row 2b: q+8", 4, "#1f77b4")],
    "fp4 e2m1 x2": [("sign", 1, "#d62728"), ("exp", 2, "#2ca02c"), ("man", 1, "#ff7f0e"),
                    ("sign", 1, "#d62728"), ("exp", 2, "#2ca02c"), ("man", 1, "#ff7f0e")],
}
BIT_AXIS = dict(title="bit (position in the byte)", tickvals=list(range(9)),
                ticktext=[str(7 - b) for b in range(8)] + [""])


def byte_bars(fig, fmt, fields):
    """One horizontal bar per field of a byte of `fmt`, bit 7 on the left."""
    start = 0
    for label, bits, colour in fields:
        fig.add_bar(y=[fmt], x=[bits], base=start, orientation="h", marker_color=colour,
                    text=label, textposition="inside", showlegend=False, hovertext=label)
        start += bits


fig = go.Figure()
for fmt, fields in FIELDS.items():
    byte_bars(fig, fmt, fields)
fig.update_layout(title="One stored byte per format (bit 7 on the left)", barmode="stack",
                  yaxis_title="format", xaxis=BIT_AXIS, height=320)
plots.show(fig)

# %% [markdown]
# The decoders build every value from integer fields and powers of two: no lookup table, no
# native 4-bit float type (a float4 ref does not even lower on v5e or v6e); e4m3 bytes are
# converted as float8, and an e2m1 code's bits, moved two places up into an e4m3 byte (its
# sign four), read as its value / 64: the formats' exponent biases (1 and 7) differ by 6,
# and e2m1's one subnormal (0.5) lands on e4m3's subnormal 2^-7. One multiply by 64 puts the
# value back. They are exact: every e4m3 and e2m1 code decodes to ml_dtypes' value.

# %%
codes = np.arange(256, dtype=np.uint8)
e4m3 = np.asarray(unpack.e4m3_values(jnp.asarray(codes)))
e2m1 = np.asarray(unpack.e2m1_values(jnp.asarray(codes[:16])))
assert np.array_equal(e4m3, codes.view(jnp.float8_e4m3fn).astype(np.float32),
                      equal_nan=True), "e4m3 decoder"
assert np.array_equal(e2m1, codes[:16].view(jnp.float4_e2m1fn).astype(np.float32)), \
    "e2m1 decoder"
print("e2m1 codes 0..15:", e2m1.tolist())
print(f"e4m3: {np.isfinite(e4m3).sum()} finite codes, largest {np.nanmax(e4m3)}, smallest "
      f"positive {e4m3[e4m3 > 0].min()}")

# %% [markdown]
# Where an e2m1 code's bits land in the e4m3 byte (`unpack.e2m1_to_e4m3`): its two exponent
# bits become the bottom of e4m3's four, its mantissa bit the top of e4m3's three, its sign
# e4m3's sign. Read as e4m3, the byte is the value / 64 for every code, 0.5 (e2m1's
# subnormal) included: the table below decodes each magnitude both ways. The shift is a
# knob: move the bits three places instead of two and the check names the codes that go
# wrong (all three land in e4m3's exponent: every nonzero code).

# %%
shift = 2  # places the magnitude bits move up (try 3)
source = {7: "e2m1 sign"} | {shift + b: f"e2m1 {'man' if b == 0 else 'exp'} bit {b}"
                             for b in range(3)}
fig = go.Figure()
byte_bars(fig, "e4m3 byte", FIELDS["fp8 e4m3"])
for bit, what in source.items():
    fig.add_annotation(x=7 - bit + 0.5, y=0.45, text=what, showarrow=True, arrowhead=2,
                       ax=0, ay=-40, font=dict(size=10))
fig.update_layout(title=f"An e2m1 code placed in an e4m3 byte (shift {shift})",
                  yaxis_title="format", xaxis=BIT_AXIS, height=260)
plots.show(fig)
magnitudes = np.arange(8, dtype=np.int32)
placed = (magnitudes << shift).astype(np.uint8)
placements = [{"e2m1 code": f"{c:03b}", "value": float(v), "e4m3 byte": f"{b:08b}",
               "e4m3 value x 64": float(e * unpack.E2M1_GAIN)}
              for c, v, b, e in zip(magnitudes, codes[:8].view(jnp.float4_e2m1fn).astype(float),
                                    placed, placed.view(jnp.float8_e4m3fn).astype(float))]
display(plots.table(placements))
assert np.array_equal(np.asarray(unpack.e2m1_to_e4m3(jnp.asarray(magnitudes))),
                      magnitudes << 2), "mk.model.unpack places the bits as drawn with shift 2"
wrong = [r["e2m1 code"] for r in placements if r["value"] != r["e4m3 value x 64"]]
assert not wrong, f"shift {shift}: codes {wrong} decode to another value"

# %% [markdown]
# ## The kernel's dequantisation code
#
# What a kernel runs on one tile in VMEM, after the DMA brought its packed bytes and scales:
# the bytes are viewed as 32-bit words. int4 packs rows 2b and 2b + 1 in byte b, so a word
# is eight rows in order: one xor makes its codes two's complement and the word viewed as
# int4 is the codes (`int4_codes`). fp4's shifts and masks split the nibbles of four bytes
# at once; it is packed for its move into e4m3
# (`pack_codes`): a byte's first code already sits at its e4m3 bits, so one mask of a word
# gives four e4m3 bytes, and the second code's bits move into place with two shifts
# (`fp4_words_to_e4m3`). The scale's
# exponent becomes a power of two through a bitcast, one multiply applies the group's
# scale. The same code
# runs in interpret mode on the CPU and compiles with Mosaic for v5e, v6e and tpu7x
# (`tests/test_quant.py` compiles one tile per format per chip).

# %%
plots.show_source(unpack.dequantize_tile, unpack.int4_codes, unpack.nibble_bytes,
                  unpack.pack_codes, unpack.fp4_words_to_e4m3,
                  unpack.e2m1_to_e4m3,
                  unpack.e4m3_values, unpack.pow2)

# %% [markdown]
# ## Quantising the run's model
#
# `mk.quantize` replaces each weight of a chosen family by a `QuantWeight` (packed data and
# scales); `quant.check_error` holds every element to its format's bound: half an integer
# step for int8 and int4, half a unit in the last place for fp8, a quarter of the value (or
# of the step) for fp4's single mantissa bit.

# %%
params = mk.init_params(run.config, seed=run.seed)
qparams = mk.quantize(run.config, params, **chosen)
quantised = [name for name, q in qparams.items() if isinstance(q, quant.QuantWeight)]
if exercise_scale != 1.0:  # the exercise: one group's scale off by exercise_scale
    first = qparams[quantised[0]]
    scale = np.array(first.scale)
    scale.flat[0] = scale.flat[0] * exercise_scale if first.scheme != "fp4" else \
        scale.flat[0] + np.log2(exercise_scale)
    qparams[quantised[0]] = dataclasses.replace(first, scale=jnp.asarray(scale))
deq = quant.dequantize(qparams, jnp.float32)
rows_out = []
for name in quantised:
    q, w = qparams[name], np.asarray(params[name], np.float32)
    err = np.asarray(deq[name]) - w
    rows_out.append({"weight": name, "format": q.scheme, "shape": list(q.shape),
                     "data MiB": f"{q.data.nbytes / 2**20:.3f}",
                     "scales KiB": f"{q.scale.nbytes / 2**10:.1f}",
                     "relative RMS error": f"{np.sqrt((err ** 2).mean() / (w ** 2).mean()):.4f}"})
display(plots.table(rows_out))

# %% [markdown]
# **Exercise:** set `exercise_scale = 2.0`: the first quantised weight's first group gets a
# scale twice too large, as a quantiser that computed absmax over the wrong axis might give.
# The table's error barely moves (one group of many), but the check names the weight and the
# element:

# %%
for name in quantised:
    quant.check_error(name, params[name], qparams[name])
print(f"every element of {len(quantised)} quantised weights is within its format's bound")

# %% [markdown]
# ## Accuracy against bf16
#
# The oracle for a quantised model is the reference decoder run on the dequantised weights
# (`quant.dequantize`, then the unchanged `mk.model.reference`). Both models read the bf16
# model's greedy tokens (teacher forcing), and are compared at each of `accuracy_steps`
# positions: relative RMS of the logits and the fraction of steps whose argmax agrees ("mix"
# is this run's `dense_format`, `expert_format` and `lm_head_format`). The
# free-running common prefix is shown too: once one token differs the sequences part. These
# are random weights, whose logits are flatter than a trained model's, so argmax flips more
# easily; `tests/test_quant.py` measures the same on a transformers-written checkpoint.

# %%
prompt = np.random.default_rng(run.seed).integers(0, run.config.vocab, (2, 8))
accuracy_rows, measured = [], {}
for label, fmt in tqdm(TABLE_FORMATS.items(), desc="accuracy"):
    if label == "bf16":
        continue
    q = mk.quantize(run.config, params, **schemes(run.config, *fmt))
    a = measured[label] = quant.accuracy(run.config, params, q, prompt, accuracy_steps)
    accuracy_rows.append({"format": label, "relative RMS of logits": f"{a.rel_rms:.4f}",
                          "greedy agreement": f"{a.agreement:.3f}",
                          "free-running common prefix": list(a.prefix)})
display(plots.table(accuracy_rows))

# %% [markdown]
# ## Bytes per step and HBM floors, per format and preset
#
# `mk.cost.perf.predict(..., formats=)` counts what one step streams with packed weights: each
# tile's packed data and its scale block (`quant.tile_bytes`, the bytes the kernel's DMAs
# move, held equal to them by tests/test_plan.py), every dense projection and the lm_head,
# the touched experts (uniform routing), the router and norms (unquantised), the gathered
# embedding rows and the KV cache (bf16). The HBM floor is those bytes over the chip's
# bandwidth: a lower bound, not a prediction of a kernel. Each format is applied to every
# family; "mix" is this run's choice per family. The hybrids (`qwen3.5-*`) are left out:
# `mk.model.quant` does not quantise their linear layers yet.

# %%
QUANTISABLE = [name for name in PRESET_NAMES if not mk.preset(name).is_hybrid]
step_rows, floors = [], {}
for name in QUANTISABLE:
    config = mk.preset(name)
    s = min(fit_context, config.max_position - run.rows)
    for fmt, families in TABLE_FORMATS.items():
        formats = {f: q for f, q in schemes(config, *families).items() if q}
        est = perf.predict(config, run.chip, batch=fit_batch, rows=run.rows, context=s,
                           formats=formats)
        floors.setdefault(fmt, []).append(est.hbm_floor_ms)
        kv = est.kv_read_bytes + est.kv_write_bytes
        step_rows.append({"preset": name, "format": fmt,
                          "step GB": f"{est.total_bytes / 1e9:.4g}",
                          "of which weights": f"{(est.total_bytes - kv) / 1e9:.4g}",
                          f"HBM floor on {run.chip}, ms": f"{est.hbm_floor_ms:.4g}"})
display(plots.table(step_rows))

# %%
fig = go.Figure([go.Bar(name=fmt, x=QUANTISABLE, y=ms) for fmt, ms in floors.items()])
fig.update_layout(title=f"HBM floor of one step on {run.chip} (B={fit_batch}, S up to "
                        f"{fit_context})", barmode="group", xaxis_title="preset",
                  yaxis=dict(title="HBM floor (ms, log scale)", type="log"))
plots.show(fig)

# %% [markdown]
# A caller's `formats` replace a preset's own: the bf16 row stores `kimi-k3-like`'s experts
# in bf16 too, though its preset stores them in fp4 (`formats={"experts": "fp4"}`).
#
# ## What fits which Colab chip
#
# Colab offers single-chip TPUs: v5e-1 and v6e-1. The megakernel's one capacity check,
# `DecodePlan.fits`, holds the weights as `prepare` lays them out (packed data and
# tile-major scales) plus the KV cache of `fit_batch` sequences of `fit_context` positions
# against the chip's HBM, and the plan's VMEM buffers (the packed ring slots among them)
# against its VMEM; with `prompt=` it counts a whole `generate` (its prefill, and the
# stored params while they are laid out, unless `donate=True` gives them up as it goes),
# which `megakernel.generate` checks before it allocates anything. Counted, not measured:
# on a v5e, qwen3-4b bf16 counted 10.0 GiB for a donating `generate` and peaked at 9.2,
# qwen3-8b int8 counted 11.6 GiB for a donating `generate` and peaked at 9.9, both exact
# (data/measured/v5e-models.json); without donating the 4b counts 15.9 and is refused.
# docs/colab.md's "Which preset" table lists the presets compiled ahead of time.

# %%
fit_rows = []
for name in QUANTISABLE:
    config = mk.preset(name)
    S = capacity(min(fit_context, config.max_position - 1))
    row = {"preset": name}
    for fmt, families in TABLE_FORMATS.items():
        formats = {f: q for f, q in schemes(config, *families).items() if q}
        plan = DecodePlan.make(config, batch=fit_batch, context=S, formats=formats)
        fits = [plan.fits(chip, prompt=8, donate=True) for chip in ("v5e", "v6e")]
        row[fmt] = (f"{fits[0].hbm_bytes / 2**30:.1f} GiB "
                    f"({'/'.join(f.chip for f in fits if f.ok) or 'neither'})")
    fit_rows.append(row)
display(Markdown(f"A donating `generate` of an 8-token prompt per core at B={fit_batch}, "
                 f"S={fit_context} (the Colab chips whose one core holds it, VMEM included):"))
display(plots.table(fit_rows))

# %% [markdown]
# ## The ring streams packed tiles
#
# A quantised segment of the ring's stream moves each tile as two DMAs on the tile's slot
# semaphore: its packed data (int4 and fp4: half the rows' bytes) and its scale block, both
# into that format's own slots. `prepare` lays data and scales out tile-major once
# (`quant.tile_major`: tile t's data and scale block at index t) so each is one contiguous
# DMA: Mosaic refuses the lane slice fp8's [I/128, O/128] scales would need. A quantised
# weight is never stored transposed (its packing runs along I), so its tiles cut it as it
# is. An int8 or int4 tile's codes go straight into the dot and its scales multiply the
# product; an fp8 or fp4 tile is dequantised in VMEM right before its product or, fed fp8
# (below), its codes go to the MXU as e4m3 and the scales multiply the products:

# %%
plots.show_source(Ring._copies, Ring._weights, Ring._product, unpack.scaled_product)

# %% [markdown]
# One streamed matrix, the stage-01 kernel (`stream_matmul`) in each format, with every DMA
# it starts recorded (`dma_log`): the bytes on the wire per tile are the packed data and the
# scales, what `quant.tile_bytes` and the byte counts above say. The log is interpret
# mode's (host callbacks where a DMA starts); on a TPU the products are still checked.

# %%
w = np.random.default_rng(run.seed).standard_normal((512, 512)).astype(np.float32)
x = jnp.asarray(np.random.default_rng(run.seed + 1).standard_normal((8, 512)), jnp.float32)
tile = BlockSizes(slots=3, tile_rows=256, tile_cols=256)
counting = mk.kernels.backend.resolve(run.backend) == "interpret"  # the DMA log runs there only
wire_rows = []
for fmt in FORMATS:
    q = jnp.asarray(w, jnp.bfloat16) if fmt == "bf16" else quant.quantize_weight(w, fmt)
    with (dma_log() if counting else contextlib.nullcontext([])) as log, \
            mk.kernels.backend.use(run.backend):
        y = stream_matmul(x, q, block=tile)
    if fmt in ("int8", "int4"):  # codes times bf16 activations, scales on the product
        want = np.asarray(ops.matmul(x, unpack.scaled_weight(fmt, q.data, q.scale,
                                                             jnp.bfloat16)))
    else:
        values = q if fmt == "bf16" else unpack.dequantize_tile(fmt, q.data, q.scale)
        want = np.asarray(x.astype(jnp.bfloat16), np.float32) @ np.asarray(
            jnp.asarray(values, jnp.bfloat16), np.float32)
    wire_rows.append({"format": fmt, "DMAs": len(log) if counting else "not counted",
                      "bytes per tile": sum(n for _, n in log) // 4 if counting else "-",
                      "max |kernel - reference|": f"{np.abs(np.asarray(y) - want).max():.2g}"})
display(plots.table(wire_rows))

# %% [markdown]
# The whole model: the megakernel decodes a few tokens of the run's quantised model and the
# reference decodes the same from the dequantised weights. In float32, so only summation
# order differs (tests/test_megakernel.py runs 64 tokens per format, race detector on).

# %%
config32 = dataclasses.replace(run.config, dtype="float32")
params32 = {n: q if isinstance(q, quant.QuantWeight) else q.astype(jnp.float32)
            for n, q in qparams.items()}
start = prompt[:1, :5]
kernel_tokens = megakernel.generate(config32, params32, start, 4, backend=run.backend,
                                    max_context=64, steps_per_call=4)  # one dispatch
reference_tokens = mk.model.reference.generate(config32, quant.dequantize(params32), start, 4,
                                         max_context=64)
print(f"megakernel {np.asarray(kernel_tokens).tolist()}, reference "
      f"{np.asarray(reference_tokens).tolist()}")

# %% [markdown]
# On a TPU the ring moves fewer bytes and the vector unit does a few more integer operations
# per value. What a tile becomes for the MXU (its feed) is chosen per chip from what its
# MXU takes beside bf16 activations (`mxu_feeds` in `data/chips.csv`, from JAX's
# `tpu_info`): TPU7x multiplies bf16 by fp8 e4m3, so there the plan feeds fp8 tiles as
# they are and fp4 tiles moved into e4m3 at value / 64 (`unpack.fp8_feed_tile`), one
# product per 128 rows, the tile's product times 64; v5e, v6e and v5p take bf16 only.
# int8 and int4 are never dequantised: their codes go straight into the dot (each is a bf16
# value) and their scales multiply the float32 product, per column (int8) or per 128-row
# group's product (int4; `unpack.int_product`), and their reference multiplies the same
# way (`quant.dequantize` gives it codes and scales, `mk.model.ops.Scaled`; an int8 MXU wants
# int8 activations too). Whether the vector work stays hidden under the shorter DMAs is for
# the bundle dumps (`mk.cost.bundles`, notebook 11) and a real chip to say.
#
# ## Takeaway
#
# A format is codes plus scales. Packed as plain bytes and decoded with shifts, masks and
# powers of two, each one runs in interpret mode and lowers on every TPU generation, its
# bytes, scales included, are what the ring moves and the HBM floor counts, and the
# megakernel decodes the reference's tokens from them. The last cell checks this run.

# %% [markdown]
# ## Questions
#
# 1. Why is a quantised weight never stored transposed in the ring?
#    <details><summary>Answer</summary>Its packing (and its scale blocks) run along K, the contraction; a
#    transposed tile would cut across them (`BlockSizes.cut`).</details>

# %%
for name in quantised:
    counted = quant.storage_bytes(qparams[name].shape, qparams[name].scheme)
    assert counted == {"data": qparams[name].data.nbytes,
                       "scales": qparams[name].scale.nbytes}, name
    quant.check_error(name, params[name], qparams[name])
# Every format is near the bf16 model but not it, and 4 bits err more than 8 bits.
rms = {label: a.rel_rms for label, a in measured.items()}
assert all(0 < r < 1 for r in rms.values()), rms
assert max(rms["int8"], rms["fp8"]) < min(rms["int4"], rms["fp4"]), rms
# Fewer bits per weight, fewer bytes per step.
for i, name in enumerate(QUANTISABLE):
    assert floors["int4"][i] < floors["int8"][i] < floors["bf16"][i], name
# The ring moved each format's tiles (two DMAs each when packed) and multiplied right.
for row in wire_rows:
    fmt = row["format"]
    r, c = tile.tile_rows, tile.tile_cols
    assert not counting or row["bytes per tile"] == (r * c * 2 if fmt == "bf16" else
                                                     quant.tile_bytes(fmt, r, c)), row
    assert float(row["max |kernel - reference|"]) < 1e-3, row
np.testing.assert_array_equal(kernel_tokens, reference_tokens)
print(f"{len(quantised)} quantised weights: bytes as counted, every element within bound; "
      "accuracy and bytes ordered by bits; the ring and the megakernel decode them")
