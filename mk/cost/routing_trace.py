"""Measured routing: which experts a model's routers chose, counted per MoE layer.

`mk.cost.perf.experts_touched` turns routing into bytes: how many distinct experts a step of M
rows reads. Its assumed routings (`mk.cost.perf.ROUTINGS`) bound the answer; a real
checkpoint's routers are skewed, so M rows touch fewer distinct experts than uniform
routing says. A `RoutingTrace` is that skew measured: `record` runs the reference decoder
and counts, per MoE layer, how many tokens chose each expert; passed as `routing=` to
`mk.cost.perf` and `mk.cost.sim.simulate` it replaces the assumed routing (`shares`,
`expected_distinct`). `save` / `load` keep a trace as JSON; a trace file is untrusted
data, checked field by field and never evaluated (`mk.model.untrusted`'s limits).

Not here: an expert-parallel layout (the only one in which skew would set the busiest
device's load; mk shards every expert over every device). The expected-distinct formula
and why the busiest device is the mean: docs/design/mk.cost.routing_trace.md.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from mk.model import decode_checks, reference, untrusted
from mk.model.config import ModelConfig, check_config, positive_int
from mk.model.errors import shown

FIELDS = ("model", "tokens", "per_token", "counts")
MAX_NAME = 200  # characters of the model name a trace file may carry


@dataclasses.dataclass(frozen=True)
class RoutingTrace:
    """Expert choices counted over `tokens` tokens: counts[l][e] is how many of them chose
    expert e in MoE layer l; each token chose `per_token` distinct experts a layer."""

    model: str  # the config name it was recorded on (shown, never interpreted)
    tokens: int
    per_token: int
    counts: tuple[tuple[int, ...], ...]  # [MoE layers][experts]

    def __post_init__(self):
        _check(dataclasses.asdict(self))

    @property
    def experts(self) -> int:
        return len(self.counts[0])

    @property
    def shares(self) -> np.ndarray:
        """[MoE layers, experts] float64: the probability a token chooses each expert."""
        return np.asarray(self.counts, np.float64) / self.tokens

    def skew(self) -> float:
        """The most chosen expert's share over the mean share, the largest over layers
        (1 for perfectly even routing)."""
        shares = self.shares
        return float((shares.max(axis=1) / shares.mean(axis=1)).max())

    def experts_touched(self, experts: int, per_token: int, tokens: int) -> float:
        """The distinct experts `tokens` tokens touch in a MoE layer, on average over the
        trace's layers (`expected_distinct`), after checking that the layer's `experts`
        and `per_token` are the trace's (`mk.cost.perf.experts_touched` with this trace)."""
        for field, mine, asked in (("experts", self.experts, experts),
                                   ("per_token", self.per_token, per_token)):
            if mine != asked:
                raise ValueError(f"routing trace of {self.model!r}: {field}={mine}, not "
                                 f"the layer's {asked}")
        return float(expected_distinct(self.shares, tokens).mean())

    def check_model(self, config: ModelConfig) -> RoutingTrace:
        """Itself, after checking it describes `config`'s routers: its MoE layer count,
        experts and experts per token (a trace of another model is refused by field)."""
        check_config(config)
        for field, mine, theirs in (("MoE layers", len(self.counts), len(config.moe_layers)),
                                    ("experts", self.experts, config.experts),
                                    ("per_token", self.per_token, config.experts_per_token)):
            if mine != theirs:
                raise ValueError(f"routing trace of {self.model!r}: {field}={mine} but "
                                 f"{config.name} has {field}={theirs}")
        return self


def expected_distinct(shares: np.ndarray, tokens: int) -> np.ndarray:
    """sum_e 1 - (1 - q_e)^tokens per row of shares q [layers, E]: the expected distinct
    experts when each token chooses expert e with probability q_e, tokens independently
    (uniform routing: q_e = X / E). log1p/expm1, accurate when q and tokens * q are small;
    an expert every token chooses (q = 1) counts 1."""
    with np.errstate(divide="ignore"):  # log1p(-1) = -inf: expm1(-inf) = -1, exactly
        return -np.expm1(tokens * np.log1p(-np.asarray(shares, np.float64))).sum(axis=-1)


def _check(fields: dict) -> None:
    """Raise ValueError naming the field, its value and the limit unless `fields` make a
    trace: a name, positive tokens and per_token, counts a non-empty [layers][experts]
    table of integers in [0, tokens] whose rows sum to tokens x per_token."""
    model, tokens, per_token, counts = (fields[f] for f in FIELDS)
    if not isinstance(model, str) or len(model) > MAX_NAME or not model.isprintable():
        raise ValueError(f"routing trace: model must be a string of at most {MAX_NAME} "
                         "printable characters (no control character or lone surrogate), "
                         f"got {type(model).__name__} {shown(model)}")
    positive_int("tokens", tokens)
    positive_int("per_token", per_token)
    if not isinstance(counts, (list, tuple)) or not counts or not all(
            isinstance(row, (list, tuple)) and row for row in counts):
        raise ValueError("routing trace: counts must be a non-empty list of non-empty rows "
                         "(one per MoE layer, one count per expert)")
    experts = len(counts[0])
    if per_token > experts:
        raise ValueError(f"routing trace: per_token={per_token} exceeds its {experts} "
                         "experts")
    for layer, row in enumerate(counts):
        if len(row) != experts:
            raise ValueError(f"routing trace: counts[{layer}] has {len(row)} experts, "
                             f"counts[0] {experts}")
        for e, c in enumerate(row):
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not (
                    0 <= c <= tokens):
                raise ValueError(f"routing trace: counts[{layer}][{e}]={c!r} must be an "
                                 f"integer in [0, tokens={tokens}]")
        if sum(row) != tokens * per_token:
            raise ValueError(f"routing trace: counts[{layer}] sums to {sum(row)}, not "
                             f"tokens x per_token = {tokens * per_token}")


def record(config: ModelConfig, params, prompt, steps: int = 0) -> RoutingTrace:
    """The routing of `config`'s MoE layers over `prompt` [B, P] and `steps` greedy tokens
    after it (`mk.model.reference`): every row of every step counted, B x (P + steps) tokens."""
    moe = [(layer, config.mlp_index(layer)[1]) for layer in config.moe_layers]
    if not moe:
        raise ValueError(f"{config.name} has no MoE layers: no routing to record")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be a non-negative integer")
    # the cache holds the prompt and the `steps` tokens fed back after it
    tokens, _, _ = decode_checks.check_generate(config, prompt, steps + 1, None)
    batch, length = tokens.shape
    cache = reference.init_cache(config, batch, length + steps)
    positions = np.zeros(batch, np.int32)
    counts = np.zeros((len(moe), config.experts), np.int64)
    for _ in range(steps + 1):
        logits, cache, taps = reference.decode_step(config, params, cache, tokens, positions,
                                                    taps=True)
        for row, (layer, i) in enumerate(moe):
            h = reference.mlp_input(config, params, layer, taps["attn"][layer])
            _, chosen = reference.routes(config, params, i, h)
            counts[row] += np.bincount(np.asarray(chosen).ravel(), minlength=config.experts)
        positions = positions + tokens.shape[1]
        tokens = reference.greedy(logits[:, -1:])
    return RoutingTrace(config.name, batch * (length + steps), config.experts_per_token,
                        tuple(tuple(int(c) for c in row) for row in counts))


def save(trace: RoutingTrace, path: str | os.PathLike) -> None:
    """Write `trace` as JSON (`load` reads it back)."""
    if not isinstance(trace, RoutingTrace):
        raise ValueError(f"trace is a {type(trace).__name__}; save writes a RoutingTrace "
                         "(`record`'s)")
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(trace), f)


def load(path: str | os.PathLike, config: ModelConfig | None = None) -> RoutingTrace:
    """A trace `save` wrote, every field checked (untrusted data); with `config`, checked
    to describe its routers too (`RoutingTrace.check_model`)."""
    fields = untrusted.load_json(path, "routing trace")
    if not isinstance(fields, dict) or set(fields) != set(FIELDS):
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise ValueError(f"routing trace {os.fspath(path)!r}: fields {got} must be "
                         f"exactly {list(FIELDS)}")
    try:
        _check(fields)
    except ValueError as err:  # named by the file it came from
        raise ValueError(f"routing trace {os.fspath(path)!r}: "
                         f"{str(err).removeprefix('routing trace: ')}") from None
    trace = RoutingTrace(fields["model"], fields["tokens"], fields["per_token"],
                         tuple(tuple(row) for row in fields["counts"]))
    return trace if config is None else trace.check_model(config)
