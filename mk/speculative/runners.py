"""The models speculative decoding steps: a `Runner` is a model stepped `rows` rows at a
time (numpy in and out, a chunked `prefill`, `keep` to roll linear states back); `XLA`
runs the reference (`mk.model.reference.decode_step`) padded to a shape bucket, `Megakernel`
the decode megakernel (`mk.step.megakernel.decode_step`) at the exact [B, gamma + 1] shape. A
verifier is a Runner of T = gamma + 1 rows; a model drafter (`mk.speculative.drafters.ModelDrafter`)
drives an `XLA` one.

Not here: the drafters (`mk.speculative.drafters`), acceptance, the loop and its statistics
(`mk.speculative.spec`). How linear states are rolled back and why the reference is padded to shape
buckets: docs/design/mk.speculative.runners.md.
"""

from __future__ import annotations

import numpy as np

from mk.kernels import backend as backends
from mk.step import megakernel
from mk.model import quant, reference
from mk.model.cache import has_states, rollback
from mk.model.config import ModelConfig
from mk.step.plan import DecodePlan


class Runner:
    """A model stepped `rows` rows at a time: `step(cache, tokens [B, T <= rows], positions
    [B], real=None) -> (greedy next tokens [B, T], logits [B, T, V] float32, cache)` as
    numpy, a chunked `prefill`, and `keep`. Subclasses implement `_init_cache` and `_call`
    (exactly [B, rows]; on a cache with linear states (`mk.model.cache.has_states`) `_call` also
    sets `last_rows`, the states after each row, `mk.model.cache.LinearRows`; else None).

    Linear states (hybrid models): every row fed advances them, padded rows too. `step`
    leaves each sequence's states after its real[b] rows (default T); `keep(cache, kept)`
    rolls them back to its first kept[b] rows of the last step (`mk.model.cache.rollback`):
    what a verifier keeps of a step. A KV cache needs neither (`mk.speculative.spec`'s module
    docstring)."""

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
        kept[b] rows (class docstring); a cache without states as it is."""
        if self.last_rows is None:
            return cache
        kept = np.asarray(kept, np.int32)
        extra = self.last_rows.state.shape[1] - len(kept)  # a bucket's padded sequences
        return rollback(cache, self.last_rows, np.pad(kept, (0, extra), constant_values=1))


class XLA(Runner):
    """The XLA reference (`mk.model.reference.decode_step`), padded to a [batch, rows] bucket
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
        extra = cache.batch - tokens.shape[0]  # padded sequences copy the first one
        tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra, 0)])
        positions = np.concatenate([positions, np.repeat(positions[:1], extra)])
        logits, cache, *rows = reference.decode_step(self.config, self.params, cache, tokens,
                                                     positions, row_states=has_states(cache))
        self.last_rows = rows[0] if rows else None
        return reference.greedy(logits), logits, cache


class Megakernel(Runner):
    """The decode megakernel (`mk.step.megakernel.decode_step`) on `backend`, T = rows."""

    name = "megakernel"

    def __init__(self, config: ModelConfig, params, *, rows: int, backend: str = "auto",
                 block=None):
        super().__init__(config, rows)
        self.backend = backends.resolve(backend)
        self.tiling, self.params = block, params  # None: each plan's default
        self.plan = self.block = self.weights = None  # set by `_init_cache`: the step's

    def _init_cache(self, batch, capacity):
        plan = DecodePlan.make(self.config, batch=batch, rows=self.rows, context=capacity,
                               block=self.tiling, formats=quant.formats_of(self.params))
        if self.block is None or plan.block.tile_cols != self.block.tile_cols:
            self.weights = megakernel.prepare(plan, self.params)
        self.plan, self.block = plan, plan.block
        return reference.init_cache(self.config, batch, capacity)

    def _call(self, cache, tokens, positions):
        with backends.use(self.backend):
            nxt, logits, cache, *rows = megakernel.decode_step(
                self.plan, self.weights, cache, tokens, positions,
                row_states=has_states(cache))
        self.last_rows = rows[0] if rows else None
        return nxt, logits, cache
