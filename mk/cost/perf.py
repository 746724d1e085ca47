"""Bytes, FLOPs and time floors of one decode step, the collectives of tensor parallelism,
and the conventional one-kernel-per-op execution.

Here: `predict(config, chip, ...)` -> `StepEstimate` (HBM bytes and FLOPs of one step,
the floors t >= bytes / bandwidth and t >= FLOPs / peak, the all-reduces over ICI);
`experts_touched`, `attainable_flops`, `roofline_curve`; `allreduce_s`;
`conventional(...)` -> `ConventionalEstimate` (one kernel per op, each paying a launch
gap); `tile_floor_ms` (the weights at the measured tile cost table, `mk.cost.feed_costs`),
`mxu_floor_ms` (a labelled bound at the bf16 MXU rule, `mxu_flops`), `modelled_step_ms`
(max(HBM floor, tile floor + the collectives): a LOWER bound, not a simulation);
`resident_bytes` / `min_chips` (capacity).

Not here: each layer kind's share of the step (the cost section of its class in
`mk.kinds`, which this module sums), the megakernel's own schedule and its bubbles
(`mk.cost.sim`), the published numbers (`mk.cost.published`, `mk.cost.ledger`), anything measured.
Every assumption (bytes as the kernel moves them, storage, routing, peaks, collectives, the
launch gap) with its source: docs/design/mk.cost.perf.md.
"""

from __future__ import annotations

import dataclasses
from numbers import Real

import numpy as np

from mk.cost import feed_costs
from mk.model.cache import bytes_per_position, state_bytes_per_sequence
from mk.model.chips import ChipSpec, spec_of
from mk.model.config import DTYPE_BITS, ModelConfig, check_config, check_formats, positive_int
from mk.kernels.collectives import (PARTIAL_SUM_BYTES, all_reduce_bytes, allreduce_s,
                                    choose_algorithm, ici_bandwidth, round_s,
                                    rounds as rounds_of)
from mk.step.one_layer import model_block
from mk.step.plan import capacity, packed_formats, padded_vocab, shard_config
from mk.step.shards import check_tp
from mk.kinds.base import ROLES
from mk.kinds.layers import kind_at, layer_kinds
from mk.model.quant import stored_bytes
from mk.cost.routing_trace import RoutingTrace, expected_distinct
from mk.step.step_bytes import (QUANT_FAMILY, kv_step_bytes, shard_weight_bytes,
                           shard_weight_elements)
from mk.model.unpack import choose_feeds

ROUTINGS = ("uniform", "shared", "disjoint")
COMPUTES = ("bf16", "fp8")  # which peak bounds the matmuls (fp8 = int8 on v5e/v6e/v5p)
KERNEL_GAP_S = 1.3e-6  # launch gap of one kernel in the conventional execution
ACTIVATION_BYTES = 2  # bf16 activations between kernels and on the wire (one kernel per op)


def check_choice(field, value, choices):
    """Raise ValueError unless `value` is one of `choices` (a parameter of this module's,
    mk.cost.sim's or mk.course.review's functions, a field of `mk.cost.published`'s rows)."""
    if value not in choices:
        raise ValueError(f"{field}={value!r} must be one of {choices}")


# -- Collectives ---------------------------------------------------------------------------
def collectives_per_step(config: ModelConfig) -> int:
    """All-reduces of one tensor-parallel step: two per layer, one for the lm_head."""
    return 2 * config.layers + 1


# -- Roofline --------------------------------------------------------------------------
def peak_flops(spec: ChipSpec, compute: str = "bf16") -> float:
    """Dense peak FLOP/s of one chip for the matmul dtype `compute`."""
    check_choice("compute", compute, COMPUTES)
    return spec.bf16_flops if compute == "bf16" else spec.fp8_flops


def attainable_flops(spec: ChipSpec, intensity, compute: str = "bf16"):
    """Roofline of one chip: min(peak, intensity * HBM bandwidth), FLOP/s.

    `intensity` (FLOP per HBM byte) is a number or an array; negative values are an error.
    """
    x = np.asarray(intensity, dtype=float)
    if np.any(x < 0) or np.any(np.isnan(x)):
        raise ValueError(f"intensity={intensity!r} must be >= 0 FLOP/byte")
    y = np.minimum(peak_flops(spec, compute), x * spec.hbm_bw)
    return float(y) if y.ndim == 0 else y


def roofline_curve(spec: ChipSpec, compute: str = "bf16", *, lo: float = 0.1,
                   hi: float = 1e4, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """(intensity FLOP/byte, attainable FLOP/s per chip) on a log grid with the ridge
    point included, for plotting."""
    if not 0 < lo < hi:
        raise ValueError(f"lo={lo} and hi={hi} must satisfy 0 < lo < hi")
    ridge = peak_flops(spec, compute) / spec.hbm_bw
    x = np.unique(np.append(np.geomspace(lo, hi, points), np.clip(ridge, lo, hi)))
    return x, attainable_flops(spec, x, compute)


# -- Mixture of experts -----------------------------------------------------------------
def experts_touched(experts: int, per_token: int, tokens: int,
                    routing: str | RoutingTrace = "uniform") -> float:
    """Distinct experts one MoE layer reads when `tokens` tokens each pick `per_token`
    of `experts`: the expected number for "uniform" routing and for a measured
    `mk.cost.routing_trace.RoutingTrace` (its mean over layers), the bounds for "shared" and
    "disjoint" (see the module docstring)."""
    for field, value in (("experts", experts), ("per_token", per_token), ("tokens", tokens)):
        positive_int(field, value)
    if per_token > experts:
        raise ValueError(f"per_token={per_token} exceeds experts={experts}")
    check_routing(routing)
    if routing == "shared":
        return float(per_token)
    if routing == "disjoint":
        return float(min(experts, per_token * tokens))
    if isinstance(routing, RoutingTrace):
        return routing.experts_touched(experts, per_token, tokens)
    return float(expected_distinct(np.full((1, experts), per_token / experts), tokens)[0])


def check_routing(routing, config: ModelConfig | None = None) -> None:
    """Raise ValueError unless `routing` is one of `ROUTINGS` or a `RoutingTrace` (of
    `config`'s routers, if given: `RoutingTrace.check_model`)."""
    if not isinstance(routing, RoutingTrace):
        check_choice("routing", routing, ROUTINGS)
    elif config is not None:
        routing.check_model(config)


# -- One decode step ----------------------------------------------------------------------
class _Throughput:
    """Tokens per second of a step estimate with `accepted`, `batch` and `step_ms`."""

    @property
    def tokens_per_s_per_user(self) -> float:
        return self.accepted / (self.step_ms / 1e3)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate over the batch."""
        return self.batch * self.tokens_per_s_per_user


@dataclasses.dataclass(frozen=True)
class StepEstimate(_Throughput):
    """Bytes, FLOPs and floors of one decode step. Bytes and FLOPs are summed over all tp
    devices; times are per step (the devices run in parallel)."""

    # What was estimated
    config_name: str
    chip_name: str
    batch: int  # B sequences
    rows: int  # T query rows per sequence (1, or the verification rows of speculation)
    context: int  # S cached positions each sequence reads
    tp: int  # devices sharing the step
    accepted: float  # tokens each sequence keeps per step (<= rows)
    routing: str | RoutingTrace
    compute: str
    # HBM bytes of one step, all devices
    attention_bytes: float  # q/k/v/o projections (and Qwen3.5's output gate), full layers
    dense_mlp_bytes: float  # dense SwiGLU layers
    router_bytes: float  # routers of MoE layers
    expert_bytes: float  # the experts touched, in their format
    embed_bytes: float  # the B*T gathered embedding rows (an XLA gather before the kernel)
    lm_head_bytes: float  # the [D, V] output projection, padded to whole tiles
    kv_read_bytes: float  # each sequence's whole KV tiles (a sliding layer's in its window)
    kv_write_bytes: float  # each written tile's aligned window (`write_back_rows` >= T rows)
    experts_touched: float  # distinct experts per MoE layer
    # FLOPs of one step, all devices
    matmul_flops: float  # 2 * (params a token multiplies by) * B*T
    attention_flops: float  # q.k and p.v over the cache and the causal new rows
    # Floors, collectives and the step time: max(HBM floor, compute floor + collective_ms)
    hbm_floor_ms: float
    compute_floor_ms: float
    step_ms: float
    attainable_flops_per_chip: float  # where the step sits on its chip's roofline
    collective_ms: float = 0.0  # the tp all-reduces, on the compute lane's critical path
    formats: tuple[tuple[str, str], ...] = ()  # the format groups stored quantised
    norm_bytes: float = 0.0  # every norm vector (float32), the final norm included
    linear_bytes: float = 0.0  # the linear layers' weights (DeltaNet, KDA), every one
    state_read_bytes: float = 0.0  # their conv and recurrent states, B sequences, once
    state_write_bytes: float = 0.0  # the states after every one of the T rows (rollback)

    @property
    def weight_bytes(self) -> float:
        """Weight bytes read this step (not `mk.model.quant.stored_bytes`, the stored total)."""
        return (self.attention_bytes + self.norm_bytes + self.dense_mlp_bytes
                + self.router_bytes + self.expert_bytes + self.embed_bytes
                + self.lm_head_bytes + self.linear_bytes)

    @property
    def kv_bytes(self) -> float:
        return self.kv_read_bytes + self.kv_write_bytes

    @property
    def state_bytes(self) -> float:
        """The linear layers' state traffic: fixed per sequence, whatever the context."""
        return self.state_read_bytes + self.state_write_bytes

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.state_bytes

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes_per_device(self) -> float:
        return self.total_bytes / self.tp

    @property
    def flops_per_device(self) -> float:
        return self.flops / self.tp

    @property
    def intensity_flop_per_byte(self) -> float:
        return self.flops / self.total_bytes

    @property
    def bound(self) -> str:
        """Which floor is larger: "hbm" or "compute"."""
        return "hbm" if self.hbm_floor_ms >= self.compute_floor_ms else "compute"

    @property
    def dominant(self) -> str:
        """What bounds step_ms: "hbm" (the HBM floor), else the larger part of the compute
        lane's path, "compute" or "collective"."""
        return critical_term(self.hbm_floor_ms, self.compute_floor_ms, self.collective_ms,
                             "compute")


def _validate_step(config, batch, rows, context, tp, accepted, routing, compute):
    check_config(config)
    for field, value in (("batch", batch), ("rows", rows), ("tp", tp)):
        positive_int(field, value)
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 0:
        raise ValueError(f"context={context!r} must be a non-negative integer")
    if context + rows > config.max_position:
        raise ValueError(f"context+rows={context + rows} exceeds {config.name}'s "
                         f"max_position={config.max_position}")
    if isinstance(accepted, bool) or not isinstance(accepted, Real) or not 0 < accepted <= rows:
        # A step verifies T rows, so a sequence keeps at most T tokens of it.
        raise ValueError(f"accepted={accepted!r} must be in (0, rows={rows}]")
    check_routing(routing, config)
    check_choice("compute", compute, COMPUTES)


def seen_positions(config: ModelConfig, context: int) -> float:
    """Cached positions a full layer reads at `context`, on average over the full layers:
    `context`, or a sliding layer's window where it is shorter (gpt-oss). Exact
    positions: the kernel reads whole KV tiles (`predict`'s `kv_read_bytes`,
    `mk.step.step_bytes.kv_step_bytes`)."""
    full = config.full_layers
    if not config.sliding_layers or not full:
        return context
    return sum(min(context, config.window(layer) or context) for layer in full) / len(full)


def predict(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1, rows: int = 1,
            context: int | None = None, tp: int = 1, accepted: float | None = None,
            routing: str | RoutingTrace = "uniform", compute: str = "bf16",
            collectives: bool = True, formats=None,
            ici_latency_s: float | None = None) -> StepEstimate:
    """Floors and collectives of one decode step of `config` on `tp` devices of `chip`.

    `context` defaults to config.max_context; `accepted` (tokens each sequence keeps per
    step, e.g. a speculative acceptance length) defaults to `rows`;
    `collectives=False` leaves the all-reduces out (a pure floor); `formats`
    ({"dense": "int8", ...}; default `config.formats`, {} for none) stores those groups
    in mk.model.quant's schemes, packed data plus scales per tile of the default tiling
    (`mk.step.step_bytes.shard_weight_bytes`); `ici_latency_s`: one message round of a
    collective (`allreduce_s`; None: the chip's, `mk.kernels.collectives.round_s`).
    """
    spec = spec_of(chip)
    context = config.max_context if context is None else context
    accepted = rows if accepted is None else accepted
    _validate_step(config, batch, rows, context, tp, accepted, routing, compute)
    formats = check_formats(config, config.formats if formats is None else formats)
    m = batch * rows  # M activation rows
    wb = DTYPE_BITS[config.dtype] / 8
    kinds = layer_kinds(config)
    touched = _touched(kinds, m, routing)
    packed = packed_formats(config, formats)  # tiled as the chip's plan tiles them
    local = shard_config(config, tp, packed)
    # the plan's tiling of a step at `context` (`DecodePlan.make(position=)`: its cache
    # just holds the rows, `capacity`, which sets the KV tile)
    block = model_block(local, context=capacity(context + rows), formats=packed,
                        feeds=choose_feeds(packed, chip=spec))
    vocab = padded_vocab(local, block)
    family = {f: tp * b for f, b in shard_weight_bytes(local, vocab, touched, formats,
                                                       block).items()}
    embed_bytes = min(m, config.vocab) * config.hidden * wb
    kv = kv_step_bytes(local, batch, rows, context, block.kv_tile)  # kv heads replicated
    kv_read_bytes, kv_write_bytes = tp * kv["kv_read"], tp * kv["kv_write"]  # when tp > K
    state_read_bytes = batch * state_bytes_per_sequence(config)  # split by heads over tp
    state_write_bytes = rows * state_read_bytes

    # Matmul parameters one token multiplies by (each kind's `params`; norms are
    # elementwise and left out), and each kind's token mixing (attention, the delta rule).
    per_token = (sum(len(k.layers) * k.params() for k in kinds)
                 + config.hidden * config.vocab)
    matmul_flops = 2.0 * per_token * m
    attention_flops = sum(len(k.layers) * k.mixing_flops(batch, rows, context)
                          for k in kinds)

    total_bytes = (sum(family.values()) + embed_bytes + kv_read_bytes + kv_write_bytes
                   + state_read_bytes + state_write_bytes)
    flops = matmul_flops + attention_flops
    device_bw = spec.device_hbm_bw
    device_peak = peak_flops(spec, compute) / spec.cores_per_chip
    hbm_floor_ms = 1e3 * total_bytes / tp / device_bw
    compute_floor_ms = 1e3 * flops / tp / device_peak
    collective_ms = (1e3 * (collectives_per_step(config)
                            * allreduce_s(m * config.hidden * PARTIAL_SUM_BYTES, tp, spec,
                                          latency_s=ici_latency_s)
                            + sum(len(k.layers) * k.collectives_s(m, spec, ici_latency_s)
                                  for k in layer_kinds(local)))
                     if collectives else 0.0)
    return StepEstimate(
        config_name=config.name, chip_name=spec.name, batch=batch, rows=rows,
        context=context, tp=tp, accepted=float(accepted), routing=routing, compute=compute,
        attention_bytes=family["attention"], dense_mlp_bytes=family["dense_mlp"],
        router_bytes=family["router"], expert_bytes=family["experts"],
        embed_bytes=embed_bytes, lm_head_bytes=family["lm_head"],
        norm_bytes=family["norms"], kv_read_bytes=kv_read_bytes,
        kv_write_bytes=kv_write_bytes, experts_touched=touched,
        matmul_flops=matmul_flops, attention_flops=attention_flops,
        hbm_floor_ms=hbm_floor_ms, compute_floor_ms=compute_floor_ms,
        step_ms=max(hbm_floor_ms, compute_floor_ms + collective_ms),
        attainable_flops_per_chip=attainable_flops(spec, flops / total_bytes, compute),
        collective_ms=collective_ms, formats=tuple(sorted(formats.items())),
        linear_bytes=family["linear"],
        state_read_bytes=state_read_bytes, state_write_bytes=state_write_bytes)


def _touched(kinds, m: int, routing: str | RoutingTrace) -> float:
    """Distinct experts each routed layer reads (0 without one)."""
    return sum(experts_touched(*k.routes, m, routing) for k in kinds if k.routes)


# -- The MXU floor ----------------------------------------------------------------------
def mxu_flops(rows: float, elements: float, mxu_rows: float) -> float:
    """The MXU rule, its one spelling (`mxu_floor_ms` and `mk.cost.sim` charge it): a TPU's MXU
    is weight-stationary, so loading an R x R weight block (R = `mxu_rows`) takes as long
    as streaming R activation rows through it, and one pass of `rows` < R rows over
    `elements` weights costs what R rows cost: 2 max(rows, R) elements FLOPs at peak."""
    return 2.0 * max(rows, mxu_rows) * elements


def mxu_floor_ms(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1, rows: int = 1,
                 context: int | None = None, tp: int = 1, routing: str | RoutingTrace = "uniform",
                 compute: str = "bf16") -> float:
    """The compute floor of one decode step with the MXU rule that `mk.cost.sim` charges, ms.

    By the MXU rule (`mxu_flops`: one pass of M < R rows costs what R rows cost), every
    weight a step reads is one pass of the step's M = B*T rows (the lm_head's, and each
    layer kind's `mxu_passes`: its projections or dense MLP; an MoE layer's router, its
    touched experts sharing the M*X routed rows, at least R rows each; attention per
    sequence and kv head, G*T query rows padded to 8 sublanes against the S + T positions,
    twice; the delta rule). Perfect sharding over tp devices, as `predict`. On a GPU (no
    mxu_rows) it is `predict`'s FLOP floor. The HBM floor stays `predict(...).hbm_floor_ms`.
    """
    spec = spec_of(chip)
    context = config.max_context if context is None else context
    _validate_step(config, batch, rows, context, tp, rows, routing, compute)
    if spec.mxu_rows is None:
        return predict(config, spec, batch=batch, rows=rows, context=context, tp=tp,
                       routing=routing, compute=compute).compute_floor_ms
    R, m = spec.mxu_rows, batch * rows
    kinds = layer_kinds(config)
    touched = _touched(kinds, m, routing)
    flops = mxu_flops(m, config.hidden * config.vocab, R) + sum(
        mxu_flops(rows_, len(k.layers) * elements, loads * R) for k in kinds
        for rows_, elements, loads in k.mxu_passes(batch, rows, context, touched))
    return 1e3 * flops / tp / (peak_flops(spec, compute) / spec.cores_per_chip)


# -- The tile floor: the measured cost table ---------------------------------------------
def tile_floor_ms(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1,
                  rows: int = 1, tp: int = 1, routing: str | RoutingTrace = "uniform", formats=None,
                  rate_end: str = "slow") -> float:
    """The compute floor of one decode step from the tile cost table (`mk.cost.feed_costs`), ms:
    every weight element one device multiplies (`shard_weight_elements`: its shard, the
    touched experts, the lm_head's padded vocab; the router's too; not the norms) at the
    table's bundles per element for its storage (its group's scheme of `formats`, default
    the config's, else plain), its feed (the chip's default, `mk.model.unpack.choose_feeds`) and
    M = B*T rows, over the chip's bundle rate at `rate_end` ("slow" or "fast") for M's
    bucket (`mk.model.chips.ChipSpec.bundle_rate`: the MXU-bound rate at a large M).
    Attention's products and vector work are not in it (`mk.cost.sim` has them): the
    issue time of the weights alone."""
    spec = spec_of(chip)
    _validate_step(config, batch, rows, 0, tp, rows, routing, "bf16")
    formats = check_formats(config, config.formats if formats is None else formats)
    m = batch * rows
    packed = packed_formats(config, formats)
    local = shard_config(config, tp, packed)
    feeds = choose_feeds(packed, chip=spec)  # the plan's default: what each group is fed
    block = model_block(local, formats=packed, feeds=feeds)
    elements = shard_weight_elements(local, padded_vocab(local, block),
                                     _touched(layer_kinds(config), m, routing))
    bundles = sum(n * feed_costs.bundles_per_element(
        spec.name, feed_costs.weight_dtype(config.dtype, formats.get(QUANT_FAMILY.get(f))),
        m, feeds.get(QUANT_FAMILY.get(f), "bf16"))
        for f, n in elements.items() if f != "norms" and n)
    return 1e3 * bundles / spec.bundle_rate(rate_end, feed_costs.bucket(m))


def modelled_step_ms(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1,
                     rows: int = 1, context: int | None = None, tp: int = 1,
                     routing: str | RoutingTrace = "uniform", compute: str = "bf16", formats=None,
                     rate_end: str = "slow", ici_latency_s: float | None = None) -> float:
    """The modelled step (`mk.cost.ledger.TERMS`): max(HBM floor, compute lane + the collectives
    of tensor parallelism), ms: HBM streams beside the compute lane, whose weight tiles and
    all-reduces are serial. The lane is, on a TPU, the tile floor (`tile_floor_ms`, at the
    `rate_end` of the bundle rate); on a GPU (no tile table) `predict`'s FLOP floor at
    `compute`'s rate."""
    spec = spec_of(chip)
    kw = dict(batch=batch, rows=rows, tp=tp, routing=routing, formats=formats)
    e = predict(config, spec, context=context, compute=compute, ici_latency_s=ici_latency_s,
                **kw)
    lane = (tile_floor_ms(config, spec, rate_end=rate_end, **kw) if spec.kind == "tpu"
            else e.compute_floor_ms)
    return max(e.hbm_floor_ms, lane + e.collective_ms)


def critical_term(hbm_ms: float, compute_ms: float, collective_ms: float,
                  compute: str = "mxu") -> str:
    """What bounds max(hbm_ms, compute_ms + collective_ms): "hbm", else the larger part
    of the compute lane's path (`compute`, the name of its floor, or "collective")."""
    if hbm_ms >= compute_ms + collective_ms:
        return "hbm"
    return "collective" if collective_ms > compute_ms else compute


# -- The conventional execution: one kernel per op ----------------------------------------
@dataclasses.dataclass(frozen=True)
class Kernel:
    """One op of the conventional execution, per device."""

    name: str
    layer: int | None  # None outside the layers
    bytes: float  # HBM bytes per device: its weights, KV, and activations in and out
    flops: float  # per device
    seconds: float  # max(bytes / bandwidth, flops / peak), or the all-reduce time


@dataclasses.dataclass(frozen=True)
class ConventionalEstimate(_Throughput):
    """A decode step as one kernel per op, each followed by a launch gap (HBM idle)."""

    config_name: str
    chip_name: str
    batch: int
    rows: int
    tp: int
    accepted: float
    gap_s: float
    kernels: tuple[Kernel, ...]

    @property
    def work_ms(self) -> float:
        return 1e3 * sum(k.seconds for k in self.kernels)

    @property
    def gap_ms(self) -> float:
        return 1e3 * self.gap_s * len(self.kernels)

    @property
    def step_ms(self) -> float:
        return self.work_ms + self.gap_ms



def conventional(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1, rows: int = 1,
                 context: int | None = None, tp: int = 1, accepted: float | None = None,
                 routing: str | RoutingTrace = "uniform", compute: str = "bf16", formats=None,
                 gap_s: float = KERNEL_GAP_S) -> ConventionalEstimate:
    """The step of `predict` run as one kernel per op: per layer norm, QKV, QK-norm+RoPE,
    attention, output projection (a linear layer: its projections, the conv, the delta
    rule over its states, the gated norm, out_proj), residual+norm, then gate+up, SwiGLU,
    down (dense) or
    router, top-k, expert gate+up, SwiGLU, expert down, combine (MoE), a residual add, and
    two all-reduces when tp > 1; then the final norm, lm_head and argmax. Bytes and FLOPs
    are `predict`'s, split over ops; each op also reads and writes its activations."""
    spec = spec_of(chip)
    e = predict(config, spec, batch=batch, rows=rows, context=context, tp=tp,
                accepted=accepted, routing=routing, compute=compute, formats=formats)
    if not gap_s >= 0:
        raise ValueError(f"gap_s={gap_s!r} must be >= 0 seconds")
    bw = spec.device_hbm_bw
    peak = peak_flops(spec, compute) / spec.cores_per_chip
    m, D, L = batch * rows, config.hidden, config.layers
    act = m * ACTIVATION_BYTES / tp  # bytes of one activation column per device

    def op(name, layer, weight_bytes, flops, widths):
        nbytes = weight_bytes / tp + act * sum(widths)
        return Kernel(name, layer, nbytes, flops / tp, max(nbytes / bw, flops / tp / peak))

    allreduce = allreduce_s(m * D * ACTIVATION_BYTES, tp, spec, "recursive")
    kinds = layer_kinds(config)
    ops = {k.name: k.conventional(e) for k in kinds}  # each kind's ops of one layer
    kernels = [op("embed", None, e.embed_bytes, 0, [D])]
    for layer in range(L):
        mixer, mlp = (kind_at(kinds, role, layer)[0] for role in ROLES)
        kernels.append(op("attn_norm", layer, 0, 0, [D, D]))
        kernels += [op(name, layer, *cost) for name, *cost in ops[mixer.name]]
        if tp > 1:
            kernels.append(Kernel("all_reduce", layer, 0.0, 0.0, allreduce))
        kernels.append(op("residual_norm", layer, 0, 0, [3 * D]))
        kernels += [op(name, layer, *cost) for name, *cost in ops[mlp.name]]
        if tp > 1:
            kernels.append(Kernel("all_reduce", layer, 0.0, 0.0, allreduce))
        kernels.append(op("residual", layer, 0, 0, [3 * D]))
    kernels += [op("final_norm", None, 0, 0, [2 * D]),
                op("lm_head", None, e.lm_head_bytes, 2 * m * D * config.vocab,
                   [D, config.vocab]),
                op("argmax", None, 0, 0, [config.vocab])]
    if tp > 1:
        kernels.append(Kernel("all_gather", None, 0.0, 0.0,
                              allreduce_s(8 * m, tp, spec, "recursive")))
    return ConventionalEstimate(config.name, spec.name, batch, rows, tp, e.accepted,
                                float(gap_s), tuple(kernels))


# -- Capacity -----------------------------------------------------------------------------
def resident_bytes(config: ModelConfig, *, batch: int = 1, context: int | None = None) -> int:
    """Stored weights plus a KV cache of `context` positions for `batch` sequences; no
    activations, workspace or replication."""
    context = config.max_context if context is None else context
    _validate_step(config, batch, 1, context, 1, 1, "uniform", "bf16")
    return stored_bytes(config) + batch * context * bytes_per_position(config)


def cache_bytes(config: ModelConfig, *, batch: int = 1, context: int | None = None
                ) -> dict[str, int]:
    """The caches of `batch` sequences at `context` positions: "kv" (K and V rows, or for
    MLA the latent rows, R + Hr values per token and MLA layer:
    `mk.model.cache.bytes_per_position`), and "linear" (the linear layers' conv and recurrent
    states, fixed per sequence)."""
    context = config.max_context if context is None else context
    _validate_step(config, batch, 1, context, 1, 1, "uniform", "bf16")
    return {"kv": batch * context * bytes_per_position(config),
            "linear": batch * state_bytes_per_sequence(config)}


def min_chips(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1,
              context: int | None = None, limit: int = 1 << 16) -> int:
    """Smallest power-of-two number of chips whose HBM holds `resident_bytes`."""
    spec = spec_of(chip)
    need = resident_bytes(config, batch=batch, context=context)
    chips = 1
    while chips * spec.hbm_bytes < need:
        chips *= 2
        if chips > limit:
            raise ValueError(f"{config.name} needs {need / 1e9:.0f} GB, more than "
                             f"limit={limit} {spec.name} chips hold")
    return chips


# -- What the collectives cost ------------------------------------------------------------
def collective_terms(config: ModelConfig, tp: int, chip: str, *, batch: int = 8,
                     rows: int = 1, collective: str | None = None) -> dict:
    """The in-kernel collectives of one TP step on `chip` by the `collective` algorithm
    (default the plan's, `choose_algorithm`), by the `mk.cost.perf` model (the chip's message
    round, `round_s`, and one device's one-way bandwidth, `ici_bandwidth`): bytes, rounds
    and the latency and bandwidth terms, next to `mk.cost.perf.predict`'s own collective term
    (the default algorithm's) and HBM floor for the same step. The kernel all-reduces
    float32 partial sums."""
    check_tp(config, tp)
    spec = spec_of(chip)
    algorithm = choose_algorithm(tp, collective)
    M, rounds = batch * rows, rounds_of(algorithm, tp)
    message = M * config.hidden * 4
    reduces = 2 * config.layers if tp > 1 else 0
    sent = reduces * all_reduce_bytes(message, tp) + (tp - 1) * M * 128 * 4
    messages = reduces * 2 * rounds + rounds  # and the argmax's gather
    estimate = predict(config, spec, batch=batch, rows=rows, tp=tp)
    return dict(
        tp=tp, algorithm=algorithm, all_reduces=reduces, all_reduce_KiB=message / 1024,
        sent_MiB_per_device=sent / 2**20, message_rounds=messages,
        latency_ms=messages * round_s(spec) * 1e3,
        bandwidth_ms=sent / ici_bandwidth(spec) * 1e3,
        perf_model_collective_ms=estimate.collective_ms,
        hbm_floor_ms=estimate.hbm_floor_ms)
