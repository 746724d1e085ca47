"""Speculative decoding on the megakernel: a drafter proposes gamma tokens, the target
verifies gamma + 1 rows in one call (one pass over its weights), and the longest agreeing
prefix plus one bonus token is kept.

Here: `generate(config, params, prompt, steps, drafter=..., gamma=...)` -> (tokens,
`SpecStats`); the drafters behind one interface (`Drafter`): "model" (a separate model
with the target's vocab), "self" (the target's first layers and its lm_head), "ngram"
(prompt lookup) and "forced" (a benchmarking device, see `Forced`); the verifiers
(`Runner`): "megakernel" (`mk.megakernel.decode_step`, T = gamma + 1 rows) and "reference"
(the XLA oracle); greedy acceptance and exact speculative rejection sampling
(Leviathan et al. 2023, Chen et al. 2023) for temperature / top-p sampling; the
expected-length formula and tokens/s per user = tau / (t_verify(gamma + 1 rows) + t_draft).

Not here: a tree of drafts (one chain per step), drafting on the megakernel (drafters run
on the XLA reference), per-sequence gamma, paged caches.

Rejected rows of the KV cache. A step writes rows p .. p + gamma (p = the position of the
last kept token); when n drafts are kept, rows p + n + 1 .. p + gamma hold rejected tokens.
The next step starts at p' = p + n + 1 and writes rows p' .. p' + gamma, which covers every
rejected row before any row is read, and the causal mask hides rows past a row's own
position. So nothing rejected is ever read; tests/test_spec.py poisons every row at or past
p before each verification to check it.

Linear states (hybrid models: Qwen3.5's gated DeltaNet, Kimi's KDA) are not rows: every
row fed advances them. The verifier's step keeps the states after each row
(`mk.reference.LinearRows`) and `Runner.keep` rolls each sequence back to its last kept
row after acceptance; padded rows are rolled back at once (`Runner.step(..., real=)`); a
model drafter rewinds its own states to the position it re-feeds from
(`ModelDrafter._rewind`). tests/test_hybrid.py plants each missing.

Shape buckets. The XLA reference compiles once per input shape (~3 s on a 2-core CPU for
the tiny presets, against ~10 ms to run), so `XLA` pads every call to one [batch, rows]
shape: padded rows come after a sequence's real rows (causality keeps them out of the real
rows' outputs) and write cache rows the next call overwrites; padded sequences copy the
first one. The megakernel runs the exact [B, gamma + 1] shape: that shape is the point.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mk import backend as backends
from mk import megakernel, perf, reference, sim
from mk.config import MAX_ROWS, ModelConfig, check_seed
from mk.kernels.common import default_kv_tile
from mk.kernels.plan import DecodePlan
from mk.weights import param_shapes

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
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (None is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

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


def draw(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of p [..., V] (inverse CDF; each row's own uniform)."""
    u = rng.random(p.shape[:-1])[..., None]
    cdf = np.cumsum(p, axis=-1)
    return np.minimum((cdf < u * cdf[..., -1:]).sum(-1), p.shape[-1] - 1).astype(np.int32)


# -- Runners: a model stepped T rows at a time ------------------------------------------------
class Runner:
    """A model stepped `rows` rows at a time: `step(cache, tokens [B, T <= rows], positions
    [B], real=None) -> (greedy next tokens [B, T], logits [B, T, V] float32, cache)` as
    numpy, a chunked `prefill`, and `keep`. Subclasses implement `_init_cache` and `_call`
    (exactly [B, rows]; a hybrid model's `_call` also sets `last_rows`, the linear states
    after each row, `mk.reference.LinearRows`).

    Linear states (hybrid models): every row fed advances them, padded rows too. `step`
    leaves each sequence's states after its real[b] rows (default T); `keep(cache, kept)`
    rolls them back to its first kept[b] rows of the last step (`mk.reference.rollback`):
    what a verifier keeps of a step. A KV cache needs neither (module docstring)."""

    name = ""

    def __init__(self, config: ModelConfig, rows: int):
        self.config, self.rows, self.calls = config, rows, 0
        self.last_rows = None

    def prefill(self, prompt: np.ndarray, capacity: int):
        """prompt [B, P] in chunks of `rows` rows -> (logits of the last row [B, V], cache)."""
        B, P = prompt.shape
        cache = self._init_cache(B, capacity)
        for start in range(0, P, self.rows):
            chunk = prompt[:, start:start + self.rows]
            _, logits, cache = self.step(cache, chunk, np.full(B, start, np.int32))
        return logits[:, -1], cache

    def step(self, cache, tokens, positions, real=None):
        tokens = np.asarray(tokens, np.int32)
        B, T = tokens.shape
        pad = np.repeat(tokens[:, -1:], self.rows - T, axis=1)  # rows after the real ones
        nxt, logits, cache = self._call(cache, np.concatenate([tokens, pad], axis=1),
                                        np.asarray(positions, np.int32))
        self.calls += 1
        cache = self.keep(cache, np.full(B, T) if real is None else real)
        return np.asarray(nxt)[:B, :T], np.asarray(logits)[:B, :T], cache

    def keep(self, cache, kept):
        """`cache` after the last step with each sequence's linear states after its first
        kept[b] rows (class docstring); a KV cache as it is."""
        if not self.config.is_hybrid:
            return cache
        kept = np.asarray(kept, np.int32)
        extra = self.last_rows.state.shape[1] - len(kept)  # a bucket's padded sequences
        return reference.rollback(cache, self.last_rows, np.pad(kept, (0, extra),
                                                                constant_values=1))


class XLA(Runner):
    """The XLA reference (`mk.reference.decode_step`), padded to a [batch, rows] bucket
    (module docstring); `batch=None` runs the caller's batch. Its cache holds `rows` spare
    positions past the capacity asked for, where padded rows land."""

    name = "reference"

    def __init__(self, config: ModelConfig, params, *, rows: int, batch: int | None = None):
        super().__init__(config, rows)
        self.params, self.batch = params, batch

    def _init_cache(self, batch, capacity):
        if self.batch is not None and batch > self.batch:
            raise ValueError(f"batch={batch} exceeds the XLA bucket's batch={self.batch}")
        return reference.init_cache(self.config, self.batch or batch, capacity,
                                    spare=self.rows)

    def _call(self, cache, tokens, positions):
        # padded sequences copy the first one; every cache is [layers, B, ...]
        extra = jax.tree.leaves(cache)[0].shape[1] - tokens.shape[0]
        tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra, 0)])
        positions = np.concatenate([positions, np.repeat(positions[:1], extra)])
        if not self.config.is_hybrid:
            logits, cache = reference.decode_step(self.config, self.params, cache, tokens,
                                                  positions)
        else:
            logits, cache, self.last_rows = reference.decode_step(
                self.config, self.params, cache, tokens, positions, row_states=True)
        return reference.greedy(logits), logits, cache


class Megakernel(Runner):
    """The decode megakernel (`mk.megakernel.decode_step`) on `backend`, T = rows."""

    name = "megakernel"

    def __init__(self, config: ModelConfig, params, *, rows: int, backend: str = "auto",
                 block=None):
        super().__init__(config, rows)
        self.backend = backends.resolve(backend)
        self.tiling, self.params = block, params  # None: each plan's default
        self.block = self.weights = None  # set by `_init_cache` from the step's plan

    def _init_cache(self, batch, capacity):
        plan = DecodePlan.make(self.config, batch=batch, rows=self.rows,
                                    context=capacity, block=self.tiling)
        if self.block is None or plan.block.tile_cols != self.block.tile_cols:
            self.weights = megakernel.prepare(self.config, self.params, plan.block)
        self.block = plan.block
        return reference.init_cache(self.config, batch, capacity)

    def _call(self, cache, tokens, positions):
        with backends.use(self.backend):
            out = megakernel.decode_step(self.config, self.weights, cache, tokens, positions,
                                         block=self.block, row_states=self.config.is_hybrid)
        if self.config.is_hybrid:
            *out, self.last_rows = out
        return tuple(out)


# -- Drafters ---------------------------------------------------------------------------------
class Drafter:
    """Proposes gamma tokens per sequence. `start(prompt, capacity)` once, then
    `propose(seq [B, W], length [B], gamma, sampling, rng) -> (drafts [B, gamma] int32,
    q [B, gamma, V] or None)`: seq[b, :length[b]] are sequence b's kept tokens, q the
    distributions the drafts were drawn from (None: deterministic drafts). `cost` is the
    model whose steps t_draft counts (None: free), `calls` its forward passes."""

    name = ""
    cost: ModelConfig | None = None
    calls = 0

    def start(self, prompt: np.ndarray, capacity: int) -> None:
        pass

    def propose(self, seq, length, gamma, sampling, rng):
        raise NotImplementedError


class ModelDrafter(Drafter):
    """Drafts with a model of the target's vocab, one row per draft token, keeping its own
    KV cache: rows that disagree with the kept tokens are re-fed (at most 2 per step: the
    last draft when all were kept, and the bonus token)."""

    name = "model"

    def __init__(self, config: ModelConfig, params, *, batch: int | None = None,
                 rows: int = 2):
        self.runner = XLA(config, params, rows=rows, batch=batch)
        self.cost = config

    @property
    def calls(self):
        return self.runner.calls

    def start(self, prompt, capacity):
        self.fed = np.array(prompt, np.int32)  # the tokens whose K/V rows the cache holds
        _, self.cache = self.runner.prefill(self.fed, capacity)
        # A hybrid drafter's linear states after position first + j - 1, j = 0, 1, ...: the
        # states a later re-feed from position first + j starts from.
        self.saved, self.first = [self.cache], np.full(len(prompt), prompt.shape[1])

    def _rewind(self, start):
        """The drafter's cache with sequence b's linear states after position start[b] - 1
        (`saved`; its KV rows from there on are overwritten by the re-feed)."""
        j = start - self.first[:len(start)]
        j = np.pad(j, (0, self.cache.state.shape[1] - len(j)))  # padded sequences: any
        b = np.arange(len(j))

        def pick(*versions):  # [Ll, B, ...] each -> sequence b's from version j[b]
            return jnp.moveaxis(jnp.stack(versions)[j, :, b], 0, 1)

        return self.cache._replace(conv=pick(*(c.conv for c in self.saved)),
                                   state=pick(*(c.state for c in self.saved)))

    def propose(self, seq, length, gamma, sampling, rng):
        B, V = len(length), self.runner.config.vocab
        width = min(self.fed.shape[1], seq.shape[1])
        same = np.cumprod(self.fed[:, :width] == seq[:, :width], axis=1).sum(1)
        start = np.minimum(same, length - 1)  # re-feed at least the last kept token
        if self.runner.config.is_hybrid:
            self.cache = self._rewind(start)
        feed = [seq[b, start[b]:length[b]] for b in range(B)]
        T = max(len(f) for f in feed)
        tokens = np.stack([np.pad(f, (0, T - len(f)), mode="edge") for f in feed])
        _, logits, self.cache = self.runner.step(self.cache, tokens, start,
                                                 [len(f) for f in feed])
        self.saved, self.first = [self.cache], length.copy()
        logits = logits[np.arange(B), length - start - 1]
        drafts, qs = [], []
        for i in range(gamma):
            if sampling is None:
                d = np.argmax(logits, axis=-1).astype(np.int32)
            else:
                qs.append(sampling.probs(logits))
                d = draw(qs[-1], rng)
            drafts.append(d)
            if i + 1 < gamma:
                _, logits, self.cache = self.runner.step(self.cache, d[:, None], length + i)
                self.saved.append(self.cache)
                logits = logits[:, 0]
        drafts = np.stack(drafts, axis=1)
        self.fed = np.zeros((B, seq.shape[1] + gamma), np.int32)
        for b in range(B):
            kept = np.concatenate([seq[b, :length[b]], drafts[b, :gamma - 1]])
            self.fed[b, :len(kept)] = kept
            self.fed[b, len(kept):] = -1  # never matches a token
        return drafts, (np.stack(qs, axis=1) if qs else None)


class NGram(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n = max_n .. 1) and propose what followed it; with no match, repeat the last token.
    Proposals shorter than gamma are padded with their last token. Free: no model runs."""

    name = "ngram"

    def __init__(self, max_n: int = 3):
        self.max_n = max_n

    def propose(self, seq, length, gamma, sampling, rng):
        drafts = np.zeros((len(length), gamma), np.int32)
        for b, n_kept in enumerate(length):
            h = seq[b, :n_kept]
            found = h[-1:]
            for n in range(min(self.max_n, n_kept - 1), 0, -1):
                windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
                hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
                if hits.size:
                    found = h[hits[-1] + n:hits[-1] + n + gamma]
                    break
            drafts[b] = np.pad(found, (0, gamma - len(found)), mode="edge")
        return drafts, None


class Forced(ModelDrafter):
    """A benchmarking device, not a drafter: an oracle that knows the target's greedy
    continuation and spoils draft number L, so every step keeps exactly L - 1 drafts plus
    the bonus token: tau = L. (The published runs state a mean acceptance length; whether
    their drafts were real or forced is not stated.) Its oracle's cost is not draft time
    (cost None). Greedy only: no drafter can force acceptance under sampling and stay exact.

    The oracle drafts with the target on the XLA reference (as a `ModelDrafter`), whose
    rounding can differ from the verifier's (the bf16 megakernel): `settle` then replaces
    the first draft the verifier disagrees with by the verifier's own token and verifies
    again, so the count is exact whatever the verifier. Those extra verifications (usually
    none, at most L - 1 per step) are counted in `settled`, and in the verifier's calls.
    Its runner takes `rows` >= L rows: after a replaced draft it re-feeds up to L tokens."""

    name = "forced"

    def __init__(self, config, params, acceptance_length: int, *, batch=None, rows: int):
        if rows < acceptance_length:
            raise ValueError(f"rows={rows} must be >= acceptance_length={acceptance_length}")
        super().__init__(config, params, batch=batch, rows=rows)
        self.cost = None
        self.L = acceptance_length
        self.settled = 0  # extra verifier calls made by `settle`

    def propose(self, seq, length, gamma, sampling, rng):
        drafts, _ = super().propose(seq, length, gamma, None, rng)
        if self.L <= gamma:
            drafts[:, self.L - 1] = (drafts[:, self.L - 1] + 1) % self.runner.config.vocab
        return drafts, None

    def settle(self, verifier: Runner, before, cache, rows, positions, target):
        """After `verifier.step(before, rows, positions) -> (target, _, cache)`: -> (drafts,
        target, cache) with drafts [B, gamma] whose first L - 1 equal the verifier's own
        greedy tokens and whose L-th (if any) does not, so `accept_greedy` keeps exactly L.
        Target token i depends on drafts before i only: each pass fixes the first wrong
        draft of each sequence and verifies again from `before` (the same rows)."""
        rows = np.array(rows, np.int32)
        must = self.L - 1  # drafts every step keeps

        def wrong():
            return rows[:, 1:must + 1] != target[:, :must]

        for _ in range(must):
            if not wrong().any():
                break
            b = np.flatnonzero(wrong().any(axis=1))
            i = wrong()[b].argmax(axis=1)
            rows[b, i + 1] = target[b, i]
            target, _, cache = verifier.step(before, rows, positions)
            self.settled += 1
        if wrong().any():
            raise RuntimeError(f"verifier {verifier.name!r} changed an earlier row's token "
                               "when a later row changed: its rows are not causal")
        drafts = rows[:, 1:]
        if must < drafts.shape[1]:  # spoil draft L against the verifier's token (no re-run:
            hit = drafts[:, must] == target[:, must]  # target[:, must] precedes it)
            drafts[hit, must] = (target[hit, must] + 1) % self.runner.config.vocab
        return drafts, target, cache


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
    draft_config, draft_params = draft or noisy_copy(config, params)
    if draft_config.vocab != config.vocab:
        raise ValueError(f"draft vocab={draft_config.vocab} must equal the target's "
                         f"vocab={config.vocab}")
    return ModelDrafter(draft_config, draft_params, batch=batch)


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
    over kept drafts plus steps that ended in a rejection)."""
    kept = sum((k - 1) * c for s in runs for k, c in enumerate(s.histogram, 1))
    rejected = sum(sum(s.histogram[:-1]) for s in runs)
    return kept / (kept + rejected) if kept + rejected else math.nan


def expected_length(alpha, gamma: int):
    """Leviathan et al.: E[tokens per step] = (1 - alpha^(gamma + 1)) / (1 - alpha)."""
    a = np.asarray(alpha, dtype=float)
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
    progress=True shows a `mk.megakernel.progress_bar` of the tokens every sequence has."""
    check_gamma(gamma)
    seed = check_seed(seed)
    prompt, S, steps = reference.check_generate(config, prompt, steps, max_context,
                                                gamma=gamma)
    prompt = np.asarray(prompt)
    B, P = prompt.shape
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
    if not isinstance(verifier, str) and verifier.rows < gamma + 1:
        raise ValueError(f"the verifier's rows={verifier.rows} must be >= gamma + 1 = "
                         f"{gamma + 1}")
    reference.check_params(config, params, "mk.spec.generate")
    if isinstance(drafter, str):
        drafter = make_drafter(drafter, config, params, gamma=gamma, batch=bucket,
                               **drafter_options)
    if verifier == "megakernel":
        verifier = Megakernel(config, params, rows=gamma + 1, backend=backend)
    elif verifier == "reference":
        verifier = XLA(config, params, rows=MAX_GAMMA + 1 if bucket else gamma + 1,
                       batch=bucket)
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
    """One decode step of B x T rows: "modelled" the modelled step of `mk.ledger.TERMS`
    (`mk.perf.modelled_step_ms`: max(HBM floor, MXU floor + the collectives)), "sim"
    `mk.sim.simulate` (TPU chips; the plan's ring for the chip, as the "simulated" column
    of `mk.ledger`'s published rows), "conventional" `mk.perf.conventional` (one
    kernel per op, a launch gap each: the GPU baseline)."""
    kw = dict(batch=batch, rows=rows, context=context, tp=tp)
    if timing == "sim":
        return sim.simulate(config, chip, **kw).step_ms
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
