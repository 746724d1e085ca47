"""Bytes, FLOPs and time floors of one decode step, and the published numbers they bound.

Here: `predict(config, chip, ...)` -> `StepEstimate` (HBM bytes and FLOPs of one step of B
sequences x T query rows over S cached positions, split tp ways, and the two floors
t >= bytes / bandwidth and t >= FLOPs / peak); `experts_touched`, `attainable_flops` and
`roofline_curve` (the roofline itself); `resident_bytes` / `min_chips` (capacity);
`published()` and `published_bound()` (data/published.csv against the floor).

Not here yet: interconnect and collective time, kernel launch and synchronisation latency,
the megakernel's own schedule, anything measured. So `step_ms` is the larger floor, a
LOWER bound on a real step under the assumptions below, never a prediction of one.

Assumptions, each stated where it is used:
- Perfect sharding: each of the tp devices moves bytes / tp and computes FLOPs / tp. Real
  tensor parallelism replicates some bytes (KV heads when tp > K, norms, the router).
- Every byte crosses HBM once per step: weights and the S cached K/V positions are read
  once; the T new K/V rows are written once and attended from on-chip copies.
- Routing: each of the B*T tokens picks X of E experts; "uniform" assumes independent,
  uniformly random choices (expected distinct experts E * (1 - (1 - X/E)^(B*T))),
  "shared" that all tokens pick the same X (the fewest bytes), "disjoint" that they
  overlap as little as possible (min(E, X*B*T), the most).
- Datasheet peaks (mk.chips); a chip's bandwidth and FLOP/s are split evenly over its
  cores_per_chip devices.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from numbers import Real

import numpy as np

from mk.chips import DATA, ChipSpec, chip as named_chip
from mk.config import ModelConfig, preset as named_preset

PUBLISHED_CSV = DATA / "published.csv"
ROUTINGS = ("uniform", "shared", "disjoint")
COMPUTES = ("bf16", "fp8")  # which peak bounds the matmuls (fp8 = int8 on v5e/v6e/v5p)
METRICS = ("per_user", "aggregate_as_published")


def _positive_int(field, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{field}={value!r} must be a positive integer")


def _choice(field, value, choices):
    if value not in choices:
        raise ValueError(f"{field}={value!r} must be one of {choices}")


# -- Roofline --------------------------------------------------------------------------
def peak_flops(spec: ChipSpec, compute: str = "bf16") -> float:
    """Dense peak FLOP/s of one chip for the matmul dtype `compute`."""
    _choice("compute", compute, COMPUTES)
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
                    routing: str = "uniform") -> float:
    """Distinct experts one MoE layer reads when `tokens` tokens each pick `per_token`
    of `experts` (the expected number for "uniform" routing; see the module docstring)."""
    for field, value in (("experts", experts), ("per_token", per_token), ("tokens", tokens)):
        _positive_int(field, value)
    if per_token > experts:
        raise ValueError(f"per_token={per_token} exceeds experts={experts}")
    _choice("routing", routing, ROUTINGS)
    if routing == "shared":
        return float(per_token)
    if routing == "disjoint":
        return float(min(experts, per_token * tokens))
    if per_token == experts:
        return float(experts)  # log1p(-1) is a domain error; every expert is picked
    # E * (1 - (1 - X/E)^n) with log1p/expm1, accurate when X/E and n*X/E are small.
    return experts * -math.expm1(tokens * math.log1p(-per_token / experts))


# -- One decode step ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepEstimate:
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
    routing: str
    compute: str
    # HBM bytes of one step, all devices
    attention_bytes: float  # q/k/v/o projections and the norms, every layer
    dense_mlp_bytes: float  # dense SwiGLU layers
    router_bytes: float  # router and mlp_norm of MoE layers
    expert_bytes: float  # the experts touched, at config.expert_bits
    embed_bytes: float  # the B*T gathered embedding rows
    lm_head_bytes: float  # final norm and the [D, V] output projection
    kv_read_bytes: float  # B * S cached positions
    kv_write_bytes: float  # B * T new positions
    experts_touched: float  # distinct experts per MoE layer
    # FLOPs of one step, all devices
    matmul_flops: float  # 2 * (params a token multiplies by) * B*T
    attention_flops: float  # q.k and p.v over the cache and the causal new rows
    # Floors and the step time (the larger floor, until a later model adds more terms)
    hbm_floor_ms: float
    compute_floor_ms: float
    step_ms: float
    attainable_flops_per_chip: float  # where the step sits on its chip's roofline

    @property
    def weight_bytes(self) -> float:
        """Weight bytes read this step (not config.weight_bytes, the stored total)."""
        return (self.attention_bytes + self.dense_mlp_bytes + self.router_bytes
                + self.expert_bytes + self.embed_bytes + self.lm_head_bytes)

    @property
    def kv_bytes(self) -> float:
        return self.kv_read_bytes + self.kv_write_bytes

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

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
        """Which floor sets step_ms: "hbm" or "compute"."""
        return "hbm" if self.hbm_floor_ms >= self.compute_floor_ms else "compute"

    @property
    def tokens_per_s_per_user(self) -> float:
        return self.accepted / (self.step_ms / 1e3)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate over the batch."""
        return self.batch * self.tokens_per_s_per_user


def _validate_step(config, batch, rows, context, tp, accepted, routing, compute):
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config={config!r} must be a ModelConfig")
    for field, value in (("batch", batch), ("rows", rows), ("tp", tp)):
        _positive_int(field, value)
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 0:
        raise ValueError(f"context={context!r} must be a non-negative integer")
    if context + rows > config.max_position:
        raise ValueError(f"context+rows={context + rows} exceeds {config.name}'s "
                         f"max_position={config.max_position}")
    if (isinstance(accepted, bool) or not isinstance(accepted, Real)
            or not 0 < accepted <= rows):
        # A step verifies T rows, so a sequence keeps at most T tokens of it.
        raise ValueError(f"accepted={accepted!r} must be in (0, rows={rows}]")
    _choice("routing", routing, ROUTINGS)
    _choice("compute", compute, COMPUTES)


def predict(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1, rows: int = 1,
            context: int | None = None, tp: int = 1, accepted: float | None = None,
            routing: str = "uniform", compute: str = "bf16") -> StepEstimate:
    """Floors of one decode step of `config` on `tp` devices of `chip`.

    `context` defaults to config.max_context; `accepted` (tokens each sequence keeps per
    step, e.g. a speculative acceptance length) defaults to `rows`.
    """
    spec = named_chip(chip) if isinstance(chip, str) else chip
    context = config.max_context if context is None else context
    accepted = rows if accepted is None else accepted
    _validate_step(config, batch, rows, context, tp, accepted, routing, compute)
    m = batch * rows  # M activation rows
    wb, eb = config.weight_bits / 8, config.expert_bits / 8
    n_dense, n_moe = len(config.dense_layers), len(config.moe_layers)
    touched = (experts_touched(config.experts, config.experts_per_token, m, routing)
               if config.is_moe else 0.0)

    attention_bytes = config.layers * config.attention_params * wb
    dense_mlp_bytes = n_dense * config.dense_mlp_params * wb
    router_bytes = n_moe * config.router_params * wb
    expert_bytes = n_moe * touched * config.expert_params * eb
    embed_bytes = min(m, config.vocab) * config.hidden * wb
    lm_head_bytes = (config.vocab + 1) * config.hidden * wb  # tied or not: V*D, + norm
    kv_read_bytes = batch * context * config.kv_bytes_per_token
    kv_write_bytes = m * config.kv_bytes_per_token

    # Matmul parameters one token multiplies by; norms are elementwise and left out.
    proj = config.hidden * (2 * config.q_width + 2 * config.kv_width)
    per_token = (config.layers * proj + n_dense * 3 * config.hidden * config.ffn
                 + n_moe * (config.hidden * config.experts
                            + config.experts_per_token * config.expert_params)
                 + config.hidden * config.vocab)
    matmul_flops = 2.0 * per_token * m
    # Row t of T attends to S cached positions plus new rows 0..t: T*S + T(T+1)/2 pairs,
    # each 2 FLOPs per head dim for q.k and 2 for p.v.
    pairs = batch * (rows * context + rows * (rows + 1) / 2)
    attention_flops = 4.0 * config.layers * config.heads * config.head_dim * pairs

    total_bytes = (attention_bytes + dense_mlp_bytes + router_bytes + expert_bytes
                   + embed_bytes + lm_head_bytes + kv_read_bytes + kv_write_bytes)
    flops = matmul_flops + attention_flops
    device_bw = spec.hbm_bw / spec.cores_per_chip
    device_peak = peak_flops(spec, compute) / spec.cores_per_chip
    hbm_floor_ms = 1e3 * total_bytes / tp / device_bw
    compute_floor_ms = 1e3 * flops / tp / device_peak
    return StepEstimate(
        config_name=config.name, chip_name=spec.name, batch=batch, rows=rows,
        context=context, tp=tp, accepted=float(accepted), routing=routing, compute=compute,
        attention_bytes=attention_bytes, dense_mlp_bytes=dense_mlp_bytes,
        router_bytes=router_bytes, expert_bytes=expert_bytes, embed_bytes=embed_bytes,
        lm_head_bytes=lm_head_bytes, kv_read_bytes=kv_read_bytes,
        kv_write_bytes=kv_write_bytes, experts_touched=touched,
        matmul_flops=matmul_flops, attention_flops=attention_flops,
        hbm_floor_ms=hbm_floor_ms, compute_floor_ms=compute_floor_ms,
        step_ms=max(hbm_floor_ms, compute_floor_ms),
        attainable_flops_per_chip=attainable_flops(spec, flops / total_bytes, compute))


# -- Capacity -----------------------------------------------------------------------------
def resident_bytes(config: ModelConfig, *, batch: int = 1, context: int | None = None) -> int:
    """Stored weights plus a KV cache of `context` positions for `batch` sequences; no
    activations, workspace or replication."""
    context = config.max_context if context is None else context
    _validate_step(config, batch, 1, context, 1, 1, "uniform", "bf16")
    return config.weight_bytes + batch * context * config.kv_bytes_per_token


def min_chips(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1,
              context: int | None = None, limit: int = 1 << 16) -> int:
    """Smallest power-of-two number of chips whose HBM holds `resident_bytes`."""
    spec = named_chip(chip) if isinstance(chip, str) else chip
    need = resident_bytes(config, batch=batch, context=context)
    chips = 1
    while chips * spec.hbm_bytes < need:
        chips *= 2
        if chips > limit:
            raise ValueError(f"{config.name} needs {need / 1e9:.0f} GB, more than "
                             f"limit={limit} {spec.name} chips hold")
    return chips


# -- Published measurements ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Published:
    """One row of data/published.csv; empty cells are None (batch and acceptance length
    None: not stated / no speculation)."""

    model: str
    preset: str
    system: str
    chips: int | None
    cores: int | None
    tp: int | None
    batch: int | None
    acceptance_length: float | None
    tokens_per_s: float
    metric: str  # "per_user" or "aggregate_as_published"
    step_ms: float | None  # derived from tokens_per_s, see the row's notes
    source: str
    notes: str

    def __post_init__(self):
        _choice("metric", self.metric, METRICS)
        if not self.source.strip():
            raise ValueError(f"published row {self.model} on {self.system} has no source")


def published(path=PUBLISHED_CSV) -> tuple[Published, ...]:
    """Every row of data/published.csv, in file order."""
    def num(text, kind):
        return kind(text) if text.strip() else None

    with open(path, newline="", encoding="utf-8") as f:
        return tuple(Published(
            model=r["model"], preset=r["preset"], system=r["system"],
            chips=num(r["chips"], int), cores=num(r["cores"], int), tp=num(r["tp"], int),
            batch=num(r["batch"], int), acceptance_length=num(r["acceptance_length"], float),
            tokens_per_s=float(r["tokens_per_s"]), metric=r["metric"],
            step_ms=num(r["step_ms"], float), source=r["source"], notes=r["notes"])
            for r in csv.DictReader(f))


def published_bound(row: Published, *, context: int = 0, routing: str = "uniform",
                    compute: str = "bf16") -> StepEstimate | None:
    """The floor step of a published configuration, under the assumptions that give the
    shortest step; None when the system is not a row of data/chips.csv.

    Batch defaults to 1 when not stated (per-user tokens/s is largest at batch 1); a
    speculative row verifies T = ceil(acceptance length) rows (a step keeps at most T
    tokens) and keeps `acceptance_length`; all chips * cores_per_chip devices share it.
    """
    try:
        spec = named_chip(row.system)
    except ValueError:
        return None
    if row.chips is None:
        raise ValueError(f"published row {row.model} on {row.system}: chips is empty")
    devices = row.chips * spec.cores_per_chip
    if row.tp is not None and row.tp != devices:
        raise ValueError(f"published row {row.model} on {row.system}: tp={row.tp} is not "
                         f"chips*cores_per_chip={devices}")
    a = row.acceptance_length
    return predict(named_preset(row.preset), spec, batch=row.batch or 1,
                   rows=math.ceil(a) if a else 1, accepted=a or 1, context=context,
                   tp=devices, routing=routing, compute=compute)


def bound_tokens_per_s(row: Published, estimate: StepEstimate) -> float:
    """The floor-based upper bound in the row's own metric."""
    if row.metric == "per_user":
        return estimate.tokens_per_s_per_user
    return estimate.tokens_per_s
