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
# # 10 · Tensor parallelism: one megakernel on tp devices, collectives inside the kernel
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/10_tensor_parallel.ipynb)
#
# The same megakernel runs on every device of a `tp` mesh axis, each on its shard of the
# weights, and the devices talk by remote DMA from inside the kernel. This notebook answers:
#
# - How is a decode step split over tp devices, and what does each device hold?
# - Which collectives does the step need, and who sends what to whom in each round?
# - What do they cost (bytes, message rounds) next to the step's HBM floor?
# - Do tp devices produce exactly the single-device reference's greedy tokens?
# - Do real models compile for multi-chip TPU topologies, and how much VMEM/HBM per core?
#
# **You will** read the all-reduce as 30 lines of array code over n stand-in devices
# (`mk.course.teach.all_reduce`, bit-equal to the kernel's tree order), then the kernel's remote
# DMAs, and run the megakernel on tp virtual devices. **You will be able to** say who sends
# what to whom in each round and why every device gets bit-identical sums.
# **Prerequisites:** 06 (the megakernel), 07 (compiling for a TPU).

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
tp: int = 2  # devices of the token check (virtual CPU devices)
steps: int = 4  # greedy tokens of the token check
draw_devices: int = 8  # devices in the collective pictures
collective_layer: int = 4  # the 27B TP8 layer whose all-reduce after the MLP is drawn in time
compiles: int = 5  # how many of the multi-chip compile targets run, from the first (5: all)
exercise_drop_all_reduce: bool = False  # the exercise: True skips the in-kernel all-reduce

# %%
# Virtual CPU devices must be asked for before jax starts its CPU backend; twice the devices
# used, because a device blocked on a semaphore in interpret mode holds one of XLA's CPU
# threads (`interpret_devices`). Importing the module starts no backend.
import mk.course.run
from mk.kernels.collectives import check_devices, interpret_devices

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
check_devices(tp)  # a power of two >= 1, checked before anything uses it
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={interpret_devices(tp)}")
import jax
import numpy as np
import plotly.graph_objects as go
from IPython.display import display
from tqdm.auto import tqdm

import mk
import mk.kernels.backend
from mk.course import course, teach
from mk import plots, sim_plots
from mk.model import reference
from mk.cost import perf, sim
from mk.measure import tpu
from mk.step import tensor_parallel as tpar
from mk.kernels import collectives
from mk.step.plan import DecodePlan, shard_config
from mk.kinds.layers import layer_kinds
from mk.model.quant import stored_bytes

run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
config, spec = run.config, mk.chip(run.chip)
cpus = jax.devices("cpu")
accelerator = jax.default_backend()
elsewhere = "" if accelerator == "cpu" else f" (this runtime's {accelerator} is not used)"
print(f"{config.name}, tp={tp}: the token check runs on {len(cpus)} virtual CPU devices in "
      f"TPU interpret mode, a simulation{elsewhere}")

# %% [markdown]
# ## How the step is split
#
# Every matrix of a layer is cut over `tp` devices, the residual stream [M, D] is not:
# query heads, FFN width, each expert's width and the vocabulary are split; kv heads are
# split when tp <= K and replicated when tp > K (each device keeps the one kv head its
# query heads share). `wo` and `w_down` then hold rows of the split dimension, so their
# products are partial sums: one all-reduce after attention, one after the MLP, per layer.
# The lm_head's shards end in a cross-shard argmax. Each device runs the single-device
# megakernel on a smaller `ModelConfig`, the shard:

# %%
def split_rows(config, tps):
    out = []
    for t in tps:
        local = shard_config(config, t)
        out.append(dict(model=config.name, tp=t, heads=local.heads, kv_heads=local.kv_heads,
                        ffn=local.ffn if config.dense_layers else "-",
                        expert_ffn=local.expert_ffn or "-", vocab=local.vocab,
                        weights_GiB_per_device=f"{stored_bytes(config) / t / 2**30:.3g}"))
    return out


display(plots.table(split_rows(config, [1, tp]) +
                    split_rows(mk.preset("qwen3.5-27b"), [1, 8]) +
                    split_rows(mk.preset("kimi-k3-like"), [8, 32])))

# %% [markdown]
# ## Who sends what to whom
#
# The all-reduce is a reduce-scatter by recursive halving followed by an all-gather by
# recursive doubling: log2(n) rounds each, one partner per round (device XOR d). In round
# d of the reduce-scatter a device sends the half of its current chunk range that does not
# hold its own chunk and adds what its partner sent; after log2(n) rounds device i holds the
# whole sum of chunk i, summed in one fixed tree order, and the all-gather copies it to
# everyone, so every device ends with bit-identical values. `collectives.exchanges` is the
# schedule as data (the kernel computes the same partner and range from its index).
#
# That is the "recursive" algorithm. The kernel also has a "two_phase" one
# (`collectives.ALGORITHMS`), the plan's default from n = 4: the same bytes, but one round a
# phase, every peer at once. In the reduce-scatter each device sends chunk p of its partial
# straight to device p, which stores the n partials of its chunk side by side and adds them
# with the same `tree_sum`; in the all-gather each device sends its sum to every peer. The
# same tree, so the same bits as "recursive", in 2 message rounds instead of 2 log2(n).

# %%
plots.show_source(teach.all_reduce)
parts = np.random.default_rng(run.seed).standard_normal((max(tp, 2), 8, 256), np.float32)
summed = np.asarray(teach.all_reduce(jax.numpy.asarray(parts)))
same = all(np.array_equal(d, np.asarray(collectives.tree_sum(parts))) for d in summed)
print(f"{len(parts)} stand-in devices: every copy bit-equal to the kernel's tree_sum: {same}")

# %% [markdown]
# The teaching version above, with each device's rounds done for it; the kernel's own
# `all_reduce_body` does one device's share, its partner reached by remote DMA:

# %%
teach.excerpt(collectives.all_reduce_body, [
    ("for i in range(n):", "stage[i] = x[:, i * c:(i + 1) * c]",
     "This device's partial, cut into n chunks (the teaching `held[me]`)."),
    ('if check_algorithm(algorithm) == "two_phase"', "return jnp.concatenate(",
     '"two_phase": chunk p to device p, each landing at the sender\'s index of `recv` '
     "(`_direct`: n-1 remote DMAs in flight at once, then every send and every matching "
     "receive waited for), the n partials of this device's chunk summed by `tree_sum`, the "
     "sum sent to every peer (`_gather_direct`)."),
    ("for r in reversed(range(", "offset += d",
     "Reduce-scatter: per round d, keep the half holding chunk `me`, send the other half "
     "to `me XOR d` (`_exchange`: a remote DMA, then waits on both semaphores), add what "
     "the partner sent."),
    ("gathered[pl.ds(me, 1)] = stage[pl.ds(me, 1)]", "return jnp.concatenate(",
     "All-gather by recursive doubling (`_gather_rounds`), then the chunks side by side."),
])

# %% [markdown]
# The kernel's all-reduce above, from `mk.kernels.collectives`: per round a remote DMA
# (`make_async_remote_copy`) to the partner `me XOR d`, a wait on the receive semaphore,
# an add; then the all-gather rounds copy the finished chunks back. Its schedule, drawn:

# %%
def draw_exchanges(n, algorithm="recursive"):
    fig, x, rows = go.Figure(), 0, collectives.exchanges(n, algorithm)
    for phase in ("reduce-scatter", "all-gather"):
        for r in sorted({e["round"] for e in rows}):
            for e in [e for e in rows if e["phase"] == phase and e["round"] == r]:
                fig.add_annotation(x=x + 0.9, y=e["partner"], ax=x, ay=e["device"],
                                   xref="x", yref="y", axref="x", ayref="y", arrowhead=2,
                                   showarrow=True, opacity=0.6)
                last = e["first"] + e["count"] - 1
                fig.add_trace(go.Scatter(
                    x=[x], y=[e["device"]], mode="markers", showlegend=False,
                    hovertext=f"{phase} round {r}: device {e['device']} sends chunks "
                              f"{e['first']}..{last} to {e['partner']}"))
            x += 1
    fig.update_layout(title=f"All-reduce on {n} devices, {algorithm}: reduce-scatter then "
                            "all-gather (hover: which chunks)", xaxis_title="round (index)",
                      yaxis_title="device (index)", height=380)
    return fig


for algorithm in collectives.ALGORITHMS:
    plots.show(draw_exchanges(draw_devices, algorithm))
display(plots.table([e for e in collectives.exchanges(4) if e["device"] == 0]))

# %% [markdown]
# Two buffer slots: a device cannot finish collective k+1 before every peer has sent its
# data for k+1, which a peer does only after finishing k; so no device runs more than one
# collective ahead, and writes of k+1 land in the other slot than the reads of k
# (`mk.kernels.collectives` has the argument in full; tests/test_collectives.py shows the race
# detector flagging one slot).
#
# ## What the collectives cost
#
# Per step: 2 L all-reduces of the [M, D] float32 partial sums (each device sends 2(n-1)/n
# of it, in 2 log2(n) message rounds by "recursive", 2 by "two_phase"), one small gather
# for the argmax, and where the plan splits a router by experts (below) one gather of the
# router's logits per MoE layer. Below, by the model of `mk.cost.perf` (a message round and one
# device's one-way bandwidth as the chip measured them where it did: TPU7x's 4.1 µs and
# 134 GB/s, the release's; else 1 µs and the datasheet's ICI), next to that model's own
# collective term (the plan's algorithm) and the step's HBM floor per device:

# %%
terms = [perf.collective_terms(mk.preset("qwen3.5-27b"), t, "tpu7x", batch=8, collective=a)
         for t in (2, 4, 8) for a in collectives.ALGORITHMS]
display(plots.table([{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in t.items()}
                     for t in terms]))
for t8 in terms[-2:]:
    print(f"TP8 {t8['algorithm']}: {t8['message_rounds']} message rounds cost "
          f"{t8['latency_ms']:.2f} ms of latency vs {t8['bandwidth_ms']:.2f} ms of bandwidth; "
          f"the HBM floor is {t8['hbm_floor_ms']:.2f} ms")

# %% [markdown]
# At batch 8 the messages are small (160 KiB), so the latency term (the number of rounds)
# dominates the collectives, not the bytes: that is why the all-reduce uses log2(n)-round
# algorithms rather than a ring's n-1 rounds, and from n = 4 the two-round one. What the
# model leaves out, and a TPU would charge: a direct send to a peer several ICI hops away
# shares links with the others' sends, and n-1 DMAs in flight at once cost n-1 descriptor
# issues; the latency of one round (1 µs here) is an assumption nothing here measured.
#
# ## The weight ring during an all-reduce (simulated)
#
# While the compute lane waits on an all-reduce, no tile is consumed, so the ring can only
# fill: the DMA engine keeps loading the next tiles into the free slots, then HBM idles
# until the collective returns. `mk.cost.sim` replays the kernel's own schedule for the same
# 27B TP8 shard at batch 8 (its plan's ring; the all-reduce timed by the ICI model above;
# a simulation, not a TPU measurement). Below, the all-reduce after layer
# `collective_layer`'s MLP: the compute lane blocked on it, the DMA lane's transfers (hover:
# which matrix, how many tiles), and the HBM idle it causes.

# %%
big = mk.preset("qwen3.5-27b")
shard = sim.simulate(DecodePlan.make(big, chip="tpu7x", batch=8, position=4096, tp=8,
                                     kernel=False))
found = [e for e in shard.events if e.what == "collective"]
index = max(i for i, e in enumerate(found) if e.layer == collective_layer)  # after the MLP
plots.show(sim_plots.collective_timeline(shard, index=index))
c = found[index]
during = [e for e in shard.events
          if e.lane == "dma" and e.end_s > c.start_s and e.start_s < c.end_s]
display(plots.table([{
    "DMA": e.what, "layer": e.layer, "transfers": e.count, "MiB": f"{e.bytes / 2**20:.3g}",
    "from (µs into the all-reduce)": f"{(e.start_s - c.start_s) * 1e6:+.2f}",
    "to (µs)": f"{(e.end_s - c.start_s) * 1e6:+.2f}"} for e in during]))
last = max((e.end_s for e in during), default=c.start_s) - c.start_s
length = c.end_s - c.start_s
print(f"all-reduce {length * 1e6:.2f} µs; the tiles its {shard.block.slots}-slot ring had "
      f"issued before it land until {min(last, length) * 1e6:.2f} µs into it"
      + (f", then HBM idles {(length - last) * 1e6:.2f} µs" if last < length else ""))
idle = shard.bubble_share().get("collective", 0.0)
print(f"over the step: HBM idle on collectives {idle * 1e3:.3f} ms of a "
      f"{shard.step_ms:.3f} ms step (simulated)")

# %% [markdown]
#
# ## The token check on virtual devices
#
# The prompt is prefilled by the XLA reference on one device; each later token comes from
# tp copies of the megakernel exchanging partial sums by remote DMA (TPU interpret mode on
# CPU devices: a simulation; its time says nothing about a TPU). **Exercise:** set
# `exercise_drop_all_reduce = True`: `mk.course.course.planted("dropped_all_reduce")` makes the
# all-reduce return each device's own partial sum, and the token check below fails.

# %%
params = mk.init_params(config, run.seed)
prompt = jax.random.randint(jax.random.key(run.seed), (run.batch, 5), 0, config.vocab)
want = reference.generate(config, params, prompt, steps)
with (course.planted("dropped_all_reduce" if exercise_drop_all_reduce else None),
      mk.kernels.backend.use("interpret", detect_races=True)):
    got = tpar.generate(config, params, prompt, steps, tp=tp,
                        mesh=collectives.tp_mesh(tp, cpus), progress=True)
    races = mk.kernels.backend.races_found()
print("reference       :", np.asarray(want).tolist())
print(f"tp={tp}, device 0 :", np.asarray(got[0]).tolist(), "; races:", mk.kernels.backend.races_text(races))

# %% [markdown]
# ## Compiling for multi-chip TPUs
#
# The whole TP step (every layer, the collectives inside) compiled ahead of time by libtpu
# for every core of a topology, with no TPU present, batch 8, 4096 cached positions. VMEM
# is the project's budget of the kernel's buffers per core; HBM is one core's weights and
# KV cache (the compiler's count of the arguments beside it). A shard that cannot fit is
# reported with its numbers before compiling.

# %%
targets = [("qwen3-30b-a3b", "v5e:2x2", "v5e", {}),  # TP4: 4 chips
           ("qwen3-30b-a3b", "v5e:2x4", "v5e", {}),  # TP8: 8 chips
           ("qwen3.5-27b", "tpu7x:2x2x1", "tpu7x", {}),  # TP8: 4 chips, 8 TensorCores
           ("kimi-k2-shaped", "tpu7x:2x2x4", "tpu7x", {}),  # TP32: 16 chips, 32 TensorCores
           ("kimi-k2-shaped", "tpu7x:2x2x4", "tpu7x", None)]  # the same, its FP4 experts packed
# bf16 weights (formats={}) but for the last: the preset's own formats (None), FP4 experts
if not 1 <= compiles <= len(targets):
    raise ValueError(f"{compiles=} must be 1 to {len(targets)}, the targets listed")
reports = [tpu.compile_megakernel(DecodePlan.make(
    mk.preset(name), chip=chip_name, tp=len(tpu.devices(topology)), batch=8, context=4096,
    formats=formats), topology=topology)
    for name, topology, chip_name, formats in tqdm(targets[:compiles], desc="compiles")]
for report in reports:
    print(report.summary())

# %% [markdown]
# Reading the reports: a shard's split MLP widths are padded with zeros to whole 128-lane
# tiles, and where an expert's gate and up shares each fit half a tile they stream side by
# side in one (notebook 05c). The widths and bytes behind the failures:

# %%
for name, t in (("qwen3-30b-a3b", 4), ("kimi-k2-shaped", 32)):
    full, local = mk.preset(name), shard_config(mk.preset(name), t)
    moe = next(kind for kind in layer_kinds(local) if kind.name == "moe")
    packed = stored_bytes(full) / t  # the stored bytes (FP4 packed), split evenly
    print(f"{name} TP{t}: expert width {full.expert_ffn}/{t} = {full.expert_ffn // t}"
          f"{moe.layout_note()}; stored weights / tp = {packed / 2**30:.1f} GiB")

# %% [markdown]
# `qwen3-30b-a3b` in bf16 does not fit four 16 GiB v5e chips once its split experts are
# padded (with the KV cache and the replicated embedding); on eight it fits.
# `kimi-k2-shaped`: `tpu7x:2x2x4` is a topology libtpu accepts (32 TensorCores); each expert's
# width split 32 ways leaves 64 columns a device of gate and of up, joined in one tile.
# Its router (7168 x 896 bf16, 12.25 MiB a layer) is split too, by experts: a device
# computes the logits of its 28 experts (the router held transposed, 28 rows, not a
# lane-padded 128 columns) and the devices all-gather them, one message round a layer.
# The plan splits a router where the bytes a device no longer loads take longer than that
# round at the fastest HBM mk knows (`mk.kinds.mlp.routing.router_columns`); every other
# preset's router is small enough to stay whole.
# With bf16 experts the shard is far over a core's HBM; with its FP4 experts packed (half
# a byte a value, a scale byte per 32) the whole shard fits and compiles.
#
# **Takeaway:** tensor parallelism is the same kernel on a smaller model plus its
# in-kernel collectives; a fixed summation order makes every device's residual stream
# bit-identical, so routing and the greedy token agree with no extra exchange (a split
# router's gather only copies each device's logits).

# %% [markdown]
# ## Questions
#
# 1. n = 8: how many rounds does the all-reduce take, and how many bytes does one device
#    send for an array of b bytes? <details><summary>Answer</summary>3 reduce-scatter
#    rounds and 3 all-gather rounds; 2 (n - 1)/n b = 1.75 b (`all_reduce_bytes`), the
#    bandwidth optimum, in 6 latency terms where a ring would take 14 ("recursive";
#    "two_phase": 1 round each, 2 latency terms, the same bytes).</details>
# 2. Why must every device's sum be bit-identical, and what makes it so?
#    <details><summary>Answer</summary>Routing and the greedy token are computed on every
#    device from the summed stream: a last-bit difference could pick another expert or
#    token on one device. Chunk c is summed on device c alone, in one fixed tree order,
#    then copied.</details>

# %%
assert same, "the teaching all-reduce differs from the kernel's tree order"
L27 = mk.preset("qwen3.5-27b").layers  # TP8: 2 L all-reduces of 2 phases, then the gather
assert [t["message_rounds"] for t in terms[-2:]] == [4 * L27 * 3 + 3, 4 * L27 + 1], \
    "TP8's message rounds per step: log2(8) = 3 a phase (recursive), 1 (two_phase)"
for device in range(tp):
    course.check_tokens(f"tp={tp} device {device}", got[device], want)
course.check_race_free("TP megakernel", races)
fits = [False, True, True, False, True]  # per target: compiles, or is refused by HBM
for report, fit in zip(reports, fits):
    refused = not report.ok and "of HBM, over" in report.error
    assert report.ok if fit else refused, report.summary()
print("checks passed")
