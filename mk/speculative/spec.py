"""Speculative decoding on the megakernel: a drafter proposes gamma tokens, the target
verifies gamma + 1 rows in one call (one pass over its weights), and the longest agreeing
prefix plus one bonus token is kept.

Here: `generate(config, params, prompt, steps, drafter=..., gamma=...)` -> (tokens,
`SpecStats`); the drafters by name (`make_drafter`: "model", "self", "ngram", "forced");
the verifiers by name ("megakernel", "reference") or any `mk.speculative.runners.Runner`; `Sampling`
(temperature / top-p), greedy acceptance and exact speculative rejection sampling; the
acceptance statistics (`SpecStats`, `fit_rate`), the expected-length formula and
tokens/s per user.

Not here: the drafters themselves (`mk.speculative.drafters`), the models a step runs and their
shape buckets and linear-state rollback (`mk.speculative.runners`); a tree of drafts (one chain per
step), drafting on the megakernel, per-sequence gamma, paged caches. Why no rejected row
of the KV cache is ever read: docs/design/mk.speculative.spec.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mk.model import decode_checks
from mk.step import megakernel
from mk.cost import perf, sim
from mk.model.config import MAX_ROWS, ModelConfig, check_seed, finite_number, positive_int
from mk.speculative.drafters import Drafter, Forced, ModelDrafter, NGram, draw
from mk.model.errors import shown
from mk.kernels.common import default_kv_tile
from mk.step.plan import DecodePlan
from mk.speculative.runners import XLA, Megakernel, Runner
from mk.model.weights import param_shapes

MAX_GAMMA = 7  # T = gamma + 1 <= 8 verification rows, as in the published runs
DRAFTERS = ("model", "self", "ngram", "forced")
VERIFIERS = ("megakernel", "reference")


# -- Sampling -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Temperature and nucleus (top-p) sampling; `None` in place of a Sampling is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not _real(self.temperature) or not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature={shown(self.temperature)} must be a finite number "
                             "> 0 (None is greedy)")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={shown(self.top_p)} must be in (0, 1]")

    def probs(self, logits) -> np.ndarray:
        """logits [..., V] -> the sampling distribution [..., V] float64."""
        z = np.asarray(logits, np.float64) / self.temperature
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        if self.top_p < 1:
            # Keep the most likely tokens until their mass reaches top_p (ties: lower id).
            order = np.argsort(-p, axis=-1, kind="stable")
            ranked = np.take_along_axis(p, order, -1)
            keep = np.cumsum(ranked, axis=-1) - ranked < self.top_p
            mask = np.zeros_like(keep)
            np.put_along_axis(mask, order, keep, -1)
            p = np.where(mask, p, 0.0)
            p /= p.sum(axis=-1, keepdims=True)
        return p


def _real(value) -> bool:
    return not isinstance(value, (bool, np.bool_)) and isinstance(
        value, (int, float, np.integer, np.floating))


# -- Drafters by name -----------------------------------------------------------------------
def first_layers(config: ModelConfig, params, n: int):
    """(config, params) of the target's first n layers with its embedding, final norm and
    lm_head: the self-drafter's model."""
    cut = config.first_layers(n)
    shapes = param_shapes(cut)
    # Every stack (per layer, per full or linear layer, per dense or MoE layer) is in layer
    # order: the cut keeps its first rows, as many as the cut's stack has.
    out = {name: value if name in ("embed", "lm_head", "final_norm")
           else value[:shapes[name][0][0]] for name, value in params.items() if name in shapes}
    got = {k: tuple(v.shape) for k, v in out.items()}
    if got != {k: s for k, (s, _) in shapes.items()}:
        raise ValueError(f"params do not fit {config.name}: first {n} layers give {got}")
    return cut, out


def noisy_copy(config: ModelConfig, params, *, layers: int = 1, noise: float = 0.1,
               seed: int = 1):
    """A stand-in for a trained draft model of a random target (no draft was trained for
    the tiny presets): the target's first `layers` layers, embedding and head, every weight
    plus Gaussian noise of `noise` x its tensor's RMS. A separate model sharing the vocab."""
    noise, seed = finite_number("noise", noise), check_seed(seed)  # nan: a draft of nan
    cut, cut_params = first_layers(config, params, layers)
    keys = jax.random.split(jax.random.key(seed), len(cut_params))
    out = {}
    for key, (name, w) in zip(keys, sorted(cut_params.items())):
        w32 = w.astype(jnp.float32)
        rms = jnp.sqrt(jnp.mean(w32 * w32))
        out[name] = (w32 + noise * rms * jax.random.normal(key, w.shape)).astype(w.dtype)
    return dataclasses.replace(cut, name=f"{config.name}-draft"), out


def check_drafter(name: str, gamma: int, acceptance_length: int | None) -> None:
    """The drafter's name and options, checked before any model is touched."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter={name!r} must be one of {DRAFTERS}")
    if (acceptance_length is not None) != (name == "forced"):
        raise ValueError(f"acceptance_length={acceptance_length!r} is for drafter='forced' "
                         f"only, and drafter='forced' needs it (drafter={name!r})")
    L = acceptance_length
    if name == "forced" and (isinstance(L, bool) or not isinstance(L, int)
                             or not 1 <= L <= gamma + 1):
        raise ValueError(f"acceptance_length={L!r} must be an integer in [1, gamma + 1 "
                         f"= {gamma + 1}]: a step keeps at most gamma + 1 tokens")


def make_drafter(name: str, config: ModelConfig, params, *, gamma: int,
                 acceptance_length: int | None = None, draft=None,
                 self_layers: int | None = None, batch: int | None = None) -> Drafter:
    """The drafter called `name` (one of DRAFTERS) for the target (config, params).

    "model" drafts with `draft` = (config, params) (default `noisy_copy` of the target);
    "self" with the target's first `self_layers` layers (default ceil(L / 2)); "forced"
    needs `acceptance_length` in [1, gamma + 1]. `batch` is the XLA bucket's batch."""
    check_drafter(name, gamma, acceptance_length)
    if name == "forced":
        # The oracle runs the reference verifier's shape (one compile for both); >= L rows.
        return Forced(config, params, acceptance_length, batch=batch,
                      rows=MAX_GAMMA + 1 if batch else gamma + 1)
    if name == "ngram":
        return NGram()
    if name == "self":
        n = (config.layers + 1) // 2 if self_layers is None else self_layers
        drafter = ModelDrafter(*first_layers(config, params, n), batch=batch)
        drafter.name = "self"
        return drafter
    _check_draft(draft)
    draft_config, draft_params = draft or noisy_copy(config, params)
    if draft_config.vocab != config.vocab:
        raise ValueError(f"draft vocab={draft_config.vocab} must equal the target's "
                         f"vocab={config.vocab}")
    return ModelDrafter(draft_config, draft_params, batch=batch)


def _check_draft(draft) -> None:
    if draft is not None and not (isinstance(draft, tuple) and len(draft) == 2
                                  and isinstance(draft[0], ModelConfig)):
        raise ValueError(f"draft={shown(draft)} must be (config, params) of a draft model "
                         "(a ModelConfig and its params), or None")


# -- Acceptance -------------------------------------------------------------------------------
def accept_greedy(drafts, target):
    """drafts [B, g], the target's greedy tokens target [B, g + 1] -> (kept drafts n [B],
    the bonus token [B]): the longest prefix of drafts equal to the target's tokens."""
    n = np.cumprod(drafts == target[:, :-1], axis=1).sum(axis=1)
    return n, target[np.arange(len(n)), n]


def accept_sampled(drafts, q, p, rng):
    """Speculative rejection sampling. drafts [B, g] drawn from q [B, g, V] (None: the
    one-hot of each draft), target distributions p [B, g + 1, V] -> (n [B], bonus [B]).

    Draft i is kept with probability min(1, p_i(d) / q_i(d)); the first rejected one is
    replaced by a draw from max(p_i - q_i, 0) normalised, and when all are kept the bonus
    is drawn from p_g. The kept tokens are distributed exactly as the target's samples."""
    B, g = drafts.shape
    if q is None:
        q = np.zeros_like(p[:, :g])
        np.put_along_axis(q, drafts[..., None], 1.0, -1)
    rows = np.arange(B)[:, None], np.arange(g)[None], drafts
    ratio = p[:, :g][rows] / q[rows]
    n = np.cumprod(rng.random((B, g)) < ratio, axis=1).sum(axis=1)
    at = np.arange(B), n
    residual = p[at] - np.concatenate([q, np.zeros_like(q[:, :1])], axis=1)[at]
    residual = np.maximum(residual, 0.0)
    empty = residual.sum(-1) <= 0  # p == q to rounding: draw from p itself
    residual[empty] = p[at][empty]
    return n, draw(residual / residual.sum(-1, keepdims=True), rng)


# -- Statistics -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpecStats:
    """What a speculative run measured. A "step" is one sequence in one verification;
    steps of sequences that already had their tokens are not counted."""

    drafter: str
    verifier: str
    gamma: int
    batch: int
    histogram: tuple[int, ...]  # [k - 1]: steps that kept k tokens, k = 1 .. gamma + 1
    verifier_calls: int  # target calls with gamma + 1 rows (prefill not counted)
    drafter_calls: int  # drafter forward passes (prefill not counted; 0 for ngram)

    @property
    def steps(self) -> int:
        return sum(self.histogram)

    @property
    def acceptance_length(self) -> float:
        """tau: tokens kept per step, the bonus token included."""
        return sum(k * c for k, c in enumerate(self.histogram, 1)) / max(self.steps, 1)

    @property
    def position_rate(self) -> tuple[float, ...]:
        """[i - 1]: the share of steps that kept draft i among those that kept drafts
        1 .. i - 1 (nan when no step got that far)."""
        reached = np.cumsum(self.histogram[::-1])[::-1]  # steps keeping >= k tokens
        return tuple(float(reached[i] / reached[i - 1]) if reached[i - 1] else math.nan
                     for i in range(1, self.gamma + 1))

    @property
    def per_token_rate(self) -> float:
        """alpha: the per-draft acceptance probability that best explains the histogram."""
        return fit_rate([self])


def fit_rate(runs) -> float:
    """The per-draft acceptance probability alpha that best explains the histograms of
    `runs` (SpecStats; maximum likelihood with drafts accepted independently: kept drafts
    over kept drafts plus steps that ended in a rejection). ValueError for runs that are
    not SpecStats or hold no step (no alpha to fit)."""
    if isinstance(runs, (str, bytes)) or not hasattr(runs, "__iter__"):
        raise ValueError(f"runs={shown(runs)} must be a list of SpecStats")
    runs = list(runs)
    for i, s in enumerate(runs):
        if not isinstance(s, SpecStats):
            raise ValueError(f"runs[{i}]={shown(s)} is a {type(s).__name__}, not a SpecStats "
                             "(what generate returns)")
    kept = sum((k - 1) * c for s in runs for k, c in enumerate(s.histogram, 1))
    rejected = sum(sum(s.histogram[:-1]) for s in runs)
    if not kept + rejected:
        raise ValueError(f"runs hold no verification step ({len(runs)} runs): no "
                         "acceptance rate to fit")
    return kept / (kept + rejected)


def expected_length(alpha, gamma: int):
    """Leviathan et al.: E[tokens per step] = (1 - alpha^(gamma + 1)) / (1 - alpha), for
    alpha (a number or an array of them) in [0, 1] and gamma >= 1 drafts."""
    gamma = positive_int("gamma", gamma)
    a = np.asarray(alpha)
    if a.dtype.kind not in "iuf" or not np.all((a >= 0) & (a <= 1)):  # nan fails too
        raise ValueError(f"alpha={shown(alpha)} must be a probability (a number in [0, 1]) "
                         "or an array of them")
    a = a.astype(float)
    safe = np.where(a == 1, 0.5, a)
    return np.where(a == 1, gamma + 1.0, (1 - safe ** (gamma + 1)) / (1 - safe))


# -- generate ---------------------------------------------------------------------------------
def check_gamma(gamma) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not (
            1 <= gamma <= MAX_GAMMA):
        raise ValueError(f"gamma={gamma!r} must be an integer in [1, {MAX_GAMMA}]: the "
                         f"verifier checks gamma + 1 <= {MAX_GAMMA + 1} rows per step")


def generate(config: ModelConfig, params, prompt, steps: int, *, drafter, gamma: int,
             sampling: Sampling | None = None, verifier="megakernel", backend: str = "auto",
             seed: int = 0, max_context: int | None = None, bucket: int | None = None,
             progress: bool = False, **drafter_options):
    """Speculative decoding: prompt [B, P] -> (the next `steps` tokens [B, steps] int32,
    `SpecStats`). Greedy (`sampling=None`) gives exactly the target's greedy tokens.

    `drafter` is a name of DRAFTERS (options: `make_drafter`) or a `Drafter`; `verifier`
    "megakernel" (on `backend`), "reference" or a `Runner` with rows = gamma + 1.
    `bucket`, for the XLA runs (the reference verifier, the drafters): the batch every call
    is padded to, rows padded to 8 (module docstring). The cache needs
    P + steps + gamma - 1 <= max_context (default config.max_context) positions.
    progress=True shows a `mk.step.megakernel.progress_bar` of the tokens every sequence has."""
    check_gamma(gamma)
    seed = check_seed(seed)
    prompt, S, steps = decode_checks.check_generate(config, prompt, steps, max_context,
                                                    gamma=gamma)
    prompt = np.asarray(prompt)
    B, P = prompt.shape
    bucket = _check_run(config, params, prompt, S, drafter, gamma, sampling, verifier,
                        bucket, drafter_options)
    drafter, verifier = _runners(config, params, drafter, verifier, gamma, backend, bucket,
                                 drafter_options)
    rng = np.random.default_rng(seed)

    def pick(logits):
        return (np.argmax(logits, -1).astype(np.int32) if sampling is None
                else draw(sampling.probs(logits), rng))

    seq = np.zeros((B, P + steps + gamma + 1), np.int32)
    seq[:, :P] = prompt
    last, cache = verifier.prefill(prompt, S)
    seq[:, P] = pick(last)
    length = np.full(B, P + 1)
    drafter.start(prompt, S)
    histogram, calls = np.zeros(gamma + 1, np.int64), (verifier.calls, drafter.calls)
    bar = megakernel.progress_bar(steps, progress, "speculative decoding")
    while (active := length - P < steps).any():
        # A finished sequence redoes a step within its tokens (it keeps the batch's shape
        # and its cache writes inside the capacity); its results are dropped.
        at = np.minimum(length, P + steps - 1)
        drafts, q = drafter.propose(seq, at, gamma, sampling, rng)
        rows = np.concatenate([seq[np.arange(B), at - 1][:, None], drafts], axis=1)
        before = cache
        target, logits, cache = verifier.step(cache, rows, at - 1)
        if isinstance(drafter, Forced):  # its count is exact whatever the verifier rounds
            drafts, target, cache = drafter.settle(verifier, before, cache, rows, at - 1,
                                                   target)
        if sampling is None:
            n, bonus = accept_greedy(drafts, target)
        else:
            n, bonus = accept_sampled(drafts, q, sampling.probs(logits), rng)
        for b in np.flatnonzero(active):
            seq[b, length[b]:length[b] + n[b]] = drafts[b, :n[b]]
            seq[b, length[b] + n[b]] = bonus[b]
        length = np.where(active, length + n + 1, length)
        histogram += np.bincount(n[active], minlength=gamma + 1)
        cache = verifier.keep(cache, n + 1)  # the last kept token and the accepted drafts
        bar.update(min(int((length - P).min()), steps) - bar.n)
    bar.close()
    stats = SpecStats(drafter=drafter.name, verifier=verifier.name, gamma=gamma,
                      batch=B, histogram=tuple(int(c) for c in histogram),
                      verifier_calls=verifier.calls - calls[0],
                      drafter_calls=drafter.calls - calls[1])
    return jnp.asarray(seq[:, P:P + steps]), stats


def _check_run(config: ModelConfig, params, prompt, S: int, drafter, gamma: int, sampling,
               verifier, bucket, drafter_options) -> int | None:
    """`generate`'s arguments checked before anything runs (prompt [B, P] and the cache's
    S positions checked already): the bucket, as a positive int or None."""
    B, P = prompt.shape
    if sampling is not None and not isinstance(sampling, Sampling):
        raise ValueError(f"sampling={shown(sampling)} must be a mk.speculative.spec.Sampling, or "
                         f"None "
                         "(greedy)")
    if not isinstance(drafter, (str, Drafter)):
        raise ValueError(f"drafter={shown(drafter)} must be one of {DRAFTERS} or a "
                         "mk.speculative.drafters.Drafter")
    if not isinstance(verifier, (str, Runner)):
        raise ValueError(f"verifier={shown(verifier)} must be one of {VERIFIERS} or a "
                         "mk.speculative.runners.Runner")
    if bucket is not None:
        bucket = positive_int("bucket", bucket)
    if sampling is not None and drafter == "forced":
        raise NotImplementedError("drafter='forced' is defined for greedy decoding only")
    if verifier == "megakernel" and B * (gamma + 1) > MAX_ROWS:
        raise ValueError(f"batch*(gamma+1)={B * (gamma + 1)} exceeds MAX_ROWS={MAX_ROWS} "
                         "activation rows of one megakernel step")
    if verifier == "megakernel":
        default_kv_tile(S, "max_context")  # the kernel's KV tiles must divide the cache
    if isinstance(verifier, str) and verifier not in VERIFIERS:
        raise ValueError(f"verifier={verifier!r} must be one of {VERIFIERS} or a Runner")
    if bucket is not None and bucket < B:
        raise ValueError(f"bucket={bucket} must be >= batch={B}")
    if isinstance(drafter, str):
        check_drafter(drafter, gamma, drafter_options.get("acceptance_length"))
        _check_draft(drafter_options.get("draft"))
    if not isinstance(verifier, str) and verifier.rows < gamma + 1:
        raise ValueError(f"the verifier's rows={verifier.rows} must be >= gamma + 1 = "
                         f"{gamma + 1}")
    decode_checks.check_params(config, params, "mk.speculative.spec.generate")
    return bucket


def _runners(config: ModelConfig, params, drafter, verifier, gamma: int, backend: str,
             bucket: int | None, drafter_options) -> tuple[Drafter, Runner]:
    """The drafter and the verifier a run calls, built from their names (a `Drafter` or a
    `Runner` given is used as it is)."""
    if isinstance(drafter, str):
        drafter = make_drafter(drafter, config, params, gamma=gamma, batch=bucket,
                               **drafter_options)
    if verifier == "megakernel":
        verifier = Megakernel(config, params, rows=gamma + 1, backend=backend)
    elif verifier == "reference":
        verifier = XLA(config, params, rows=MAX_GAMMA + 1 if bucket else gamma + 1,
                       batch=bucket)
    return drafter, verifier


# -- Throughput -------------------------------------------------------------------------------
TIMINGS = ("modelled", "sim", "conventional")


@dataclasses.dataclass(frozen=True)
class Throughput:
    verify_ms: float  # one target step of gamma + 1 rows
    draft_ms: float  # gamma drafter steps of one row (0 for free drafters)
    tokens_per_s_per_user: float
    timing: str  # one of TIMINGS


@functools.lru_cache(maxsize=4096)  # sweeps ask for the same step many times
def step_ms(config: ModelConfig, chip, *, batch: int, rows: int, context: int, tp: int,
            timing: str = "modelled") -> float:
    """One decode step of B x T rows: "modelled" the modelled step of `mk.cost.ledger.TERMS`
    (`mk.cost.perf.modelled_step_ms`: max(HBM floor, tile floor + the collectives), at the slow
    end of the bundle rate), "sim"
    `mk.cost.sim.simulate` (TPU chips; the plan's ring for the chip, as the "simulated" column
    of `mk.cost.ledger`'s published rows), "conventional" `mk.cost.perf.conventional` (one
    kernel per op, a launch gap each: the GPU baseline)."""
    kw = dict(batch=batch, rows=rows, context=context, tp=tp)
    if timing == "sim":  # the plan of a step at `context`, for the chip
        return sim.simulate(DecodePlan.make(config, chip=chip, batch=batch, rows=rows,
                                            position=context, tp=tp, kernel=False)).step_ms
    if timing == "conventional":
        return perf.conventional(config, chip, **kw).step_ms
    if timing != "modelled":
        raise ValueError(f"timing={timing!r} must be one of {TIMINGS}")
    return perf.modelled_step_ms(config, chip, **kw)


def throughput(config: ModelConfig, chip, *, gamma: int, acceptance_length: float,
               batch: int = 1, context: int = 0, tp: int = 1, draft: ModelConfig | None = None,
               timing: str = "modelled") -> Throughput:
    """tokens/s per user = tau / (t_verify(gamma + 1 rows) + gamma * t_draft(1 row)), both
    steps timed by `step_ms`; a draft model shares the target's chips."""
    check_gamma(gamma)
    if not 0 < acceptance_length <= gamma + 1:
        raise ValueError(f"acceptance_length={acceptance_length} must be in (0, gamma + 1 = "
                         f"{gamma + 1}]")
    kw = dict(batch=batch, context=context, tp=tp, timing=timing)
    verify = step_ms(config, chip, rows=gamma + 1, **kw)
    drafting = gamma * step_ms(draft, chip, rows=1, **kw) if draft is not None else 0.0
    return Throughput(verify, drafting, acceptance_length / ((verify + drafting) / 1e3),
                      timing)
