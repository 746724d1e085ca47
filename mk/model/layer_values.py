"""Params as a layer of `mk.model.reference` reads them (`LayerValues`): each stacked weight's
row sliced when its layer is reached, a quantised weight dequantised where it is read (a
layer's row; of experts, `EXPERT_SLICE` at a time: `experts_of`), so the prefill never
holds a dequantised copy of the model nor every layer's slices at once, on a TPU or on
XLA:CPU (tests/test_prefill_memory.py). Not here: the layers themselves (`mk.model.reference`),
the formats (`mk.model.quant`, `mk.model.unpack`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from mk.model.unpack import INT_SCHEMES, dequantize_tile, scaled_weight

EXPERT_SLICE = 4  # experts a quantised MoE layer dequantises at a time (`experts_of`)


class LayerValues(Mapping):
    """Params as the layers read them: a quantised weight (an `mk.model.quant.QuantWeight`,
    known by its scheme: mk.model.quant imports mk.model.reference, which imports this module)
    dequantised where it is read, a stacked one a layer's row at a time (`w[i]`), a 2-D
    one (the lm_head) whole, each rounded once to the embedding's dtype (int8 and int4:
    codes and scales, `mk.model.unpack.scaled_weight`): `mk.model.quant.dequantize`'s values, inside
    the traced forward; a stacked plain weight's row sliced when its layer is reached
    (`_Tied`)."""

    def __init__(self, params, after=None):
        self.params, self.dtype, self.after = params, params["embed"].dtype, after

    def __getitem__(self, name):
        p = self.params[name]
        if not hasattr(p, "scheme"):
            return _Tied(p, self.after) if p.ndim > 2 and self.after is not None else p
        rows = _Rows(p, self.dtype, self.after)
        return rows if len(p.shape) > 2 else rows.whole

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


def _tied(arrays, after):
    """`arrays` tied to `after` by an optimization barrier: a 2-D quantised weight (the
    lm_head) is dequantised once the last layer's output exists. A stack's row is read
    by `_layer_index` instead: on XLA:CPU a barrier around a bf16 stack did not hold (its
    bf16 normalisation widened whole stacks to float32 ahead of the first layer)."""
    return arrays if after is None else lax.optimization_barrier((arrays, after))[0]


def _layer_index(i: int, after) -> jax.Array:
    """i, as a value of `after` (the layer's input): no float exceeds +inf, so it is i for
    every value `after` holds, but no compiler can know it before `after` exists, nor
    slice, widen or dequantise a row it indexes up front (without it, the reference's
    prefill on XLA:CPU held every layer's float32 weights from its start: qwen3-8b's
    temporaries grew 0.72 GiB a layer; issue 60)."""
    x = after.reshape(-1)[0]
    return jnp.where(x > jnp.inf, 0, jnp.int32(i))


def _row(w, j):
    """w[j], j traced (`_layer_index`); w an array or a pytree of them (`mk.model.ops.Scaled`)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, keepdims=False), w)


class _Tied:
    """A stacked plain weight whose row i is sliced after `after` exists."""

    def __init__(self, w, after):
        self.w, self.after = w, after

    def __getitem__(self, i):
        return _row(self.w, _layer_index(i, self.after))


class _Rows:
    """A stacked quantised weight whose row i is dequantised when it is read, after the
    value `after` (the layer's input) exists: its row is read at `_layer_index`, so the
    compiler cannot make every layer's values up front."""

    def __init__(self, q, dtype, after=None):
        self.q, self.dtype, self.after = q, dtype, after

    def _values(self, index):
        if index is ... or self.after is None:
            data, scale = _tied((self.q.data, self.q.scale), self.after)
            return self._decoded(data[index], scale[index])
        j = _layer_index(index, self.after)
        return self._decoded(_row(self.q.data, j), _row(self.q.scale, j))

    def _decoded(self, data, scale):
        """`mk.model.quant.dequantize`'s value: int8's and int4's codes and scales, multiplied
        as their kernels do (`scaled_weight`); the others' values in the model's dtype."""
        if self.q.scheme in INT_SCHEMES:
            return scaled_weight(self.q.scheme, data, scale, self.dtype)
        return dequantize_tile(self.q.scheme, data, scale).astype(self.dtype)

    def __getitem__(self, i):
        return self._values(i)

    def experts(self, i: int, start, size: int):
        """Layer i's experts start .. start + size (start traced), dequantised."""
        j = i if self.after is None else _layer_index(i, self.after)
        data, scale = (lax.dynamic_slice_in_dim(_row(a, j), start, size)
                       for a in (self.q.data, self.q.scale))
        return self._decoded(data, scale)

    @property
    def whole(self):
        return self._values(...)


def experts_of(outputs, params, names, i, h, *args) -> jax.Array:
    """outputs(h, *layer i's weights `names`, *args) for every expert -> [M, E, D]: at once
    from plain weights; from quantised ones (`LayerValues`) a slice of `EXPERT_SLICE`
    experts at a time, each dequantised as it is used, so no layer's worth of values is
    alive (the same bits: each expert is its own batch of the dots, `expert_outputs`)."""
    stacks = [params[n] for n in names]
    if not any(isinstance(s, _Rows) for s in stacks):
        return outputs(h, *(s[i] for s in stacks), *args)
    E = next(s for s in stacks if isinstance(s, _Rows)).q.shape[1]
    size = math.gcd(E, EXPERT_SLICE)

    def one(start):
        return outputs(h, *(s.experts(i, start, size) if isinstance(s, _Rows)
                            else lax.dynamic_slice_in_dim(s[i], start, size)
                            for s in stacks), *args)
    out = lax.map(one, jnp.arange(0, E, size))  # [E / size, M, size, D]
    return jnp.moveaxis(out, 0, 1).reshape(h.shape[0], E, -1)
