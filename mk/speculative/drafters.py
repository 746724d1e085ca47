"""The drafters of speculative decoding, behind one interface (`Drafter`: propose gamma
tokens per sequence): `ModelDrafter` (a model of the target's vocab stepped on the XLA
reference, `mk.speculative.runners.XLA`: the "model" and "self" drafters), `NGram` (prompt lookup)
and `Forced` (a benchmarking device that forces the acceptance length); and `draw`, the
inverse-CDF draw of one token per row that sampled drafts and the verifier's rejection
sampling share.

Not here: choosing a drafter by name and building a draft model (`mk.speculative.spec.make_drafter`,
`first_layers`, `noisy_copy`), the verifier (`mk.speculative.runners`), acceptance, the loop and its
statistics (`mk.speculative.spec`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mk.model.cache import has_states, state_fields
from mk.model.config import ModelConfig
from mk.speculative.runners import XLA, Runner


def draw(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of p [..., V] (inverse CDF; each row's own uniform)."""
    u = rng.random(p.shape[:-1])[..., None]
    cdf = np.cumsum(p, axis=-1)
    return np.minimum((cdf < u * cdf[..., -1:]).sum(-1), p.shape[-1] - 1).astype(np.int32)


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
        j = np.pad(j, (0, self.cache.batch - len(j)))  # padded sequences: any
        b = np.arange(len(j))

        def pick(*versions):  # [Ll, B, ...] each -> sequence b's from version j[b]
            return jnp.moveaxis(jnp.stack(versions)[j, :, b], 0, 1)

        return self.cache._replace(**{name: pick(*(getattr(c, name) for c in self.saved))
                                      for name in state_fields(self.cache)})

    def propose(self, seq, length, gamma, sampling, rng):
        B = len(length)
        width = min(self.fed.shape[1], seq.shape[1])
        same = np.cumprod(self.fed[:, :width] == seq[:, :width], axis=1).sum(1)
        start = np.minimum(same, length - 1)  # re-feed at least the last kept token
        if has_states(self.cache):
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
