"""Laying weights out one tensor at a time, so that preparing never holds two copies.

A layout (`layout(params) -> {name: array or QuantWeight}`, a hashable pure function:
`mk.step.megakernel.Layout`) run whole is one program whose inputs all live until it ends: the
params and their laid-out copy are on the device together (qwen3-4b's 8 GB twice is over
a v5e's 15.7 GiB). `lay_out` runs it one output at a time instead: each output is its own
jitted program of the inputs it reads (found by walking the layout's jaxpr back from that
output), and with `donate=True` each input is donated at the last step that reads it, so
the device frees it there. While output i is made the device holds the outputs made so
far, the inputs not yet freed and output i's own transient: at most the laid-out weights
plus the largest tensor, when no output is smaller than what it frees. `peak` replays
that sequence from each step's compiled memory analysis (no arrays: shapes only), which
is what tests/test_preparation.py holds for qwen3-4b.

Not here: the layout itself (`mk.step.megakernel`, `mk.kernels.ring.tile_major`,
`mk.model.quant.tile_major`), the fit check that counts its peak (`DecodePlan.fits`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Literal


@dataclasses.dataclass(frozen=True)
class Step:
    """One output of a layout: its name, the inputs it reads and those it reads last."""

    name: str
    reads: tuple[str, ...]
    frees: tuple[str, ...]


def signature(params: dict) -> tuple:
    """A hashable description of params' names, pytree structures, shapes and dtypes."""
    out = []
    for name in sorted(params):
        leaves, tree = jax.tree.flatten(params[name])
        out.append((name, tree, tuple((tuple(a.shape), jnp.dtype(a.dtype).name)
                                      for a in leaves)))
    return tuple(out)


def abstract(sig: tuple) -> dict:
    """The params `signature` describes, as ShapeDtypeStructs."""
    return {name: jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(s, d) for s, d in leaves])
            for name, tree, leaves in sig}


def _leaf_names(tree: dict) -> list[str]:
    """The top-level name of each leaf of a dict pytree, in flattening order."""
    return [name for name in sorted(tree) for _ in jax.tree.leaves(tree[name])]


@functools.lru_cache(maxsize=64)
def steps(layout: Callable, sig: tuple) -> tuple[Step, ...]:
    """The layout's outputs as steps, in output order, each with the inputs its value
    depends on (a dead-code walk of the traced layout: an equation is needed when one of
    its results is) and the inputs no later step reads."""
    closed, out = jax.make_jaxpr(layout, return_shape=True)(abstract(sig))
    jaxpr, names = closed.jaxpr, _leaf_names(abstract(sig))
    out_names = _leaf_names(out)
    reads = {}
    for name in sorted(out):
        needed = {v for v, n in zip(jaxpr.outvars, out_names)
                  if n == name and not isinstance(v, Literal)}
        for eqn in reversed(jaxpr.eqns):
            if any(v in needed for v in eqn.outvars):
                needed |= {v for v in eqn.invars if not isinstance(v, Literal)}
        reads[name] = tuple(sorted({n for v, n in zip(jaxpr.invars, names) if v in needed}))
    last = {n: name for name in sorted(out) for n in reads[name]}
    return tuple(Step(name, reads[name], tuple(n for n in reads[name] if last[n] == name))
                 for name in sorted(out))


@functools.lru_cache(maxsize=512)
def _program(layout: Callable, sig: tuple, name: str, donate: bool):
    """The jitted step making output `name` from (kept inputs, donated inputs); the inputs
    it does not read enter as zeros, which the compiler drops."""
    params = abstract(sig)

    def one(kept: dict, freed: dict):
        full = {n: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), p)
                for n, p in params.items()} | kept | freed
        return layout(full)[name]

    return jax.jit(one, donate_argnums=(1,) if donate else ())


def _arguments(step: Step, params: dict, donate: bool) -> tuple[dict, dict]:
    freed = step.frees if donate else ()
    return ({n: params[n] for n in step.reads if n not in freed},
            {n: params[n] for n in freed})


def lay_out(layout: Callable, params: dict, *, donate: bool = False) -> dict:
    """`layout(params)`, made one output at a time (module docstring). donate=True gives
    the params up: each is deleted at the step that reads it last (pass params no one
    else holds); donate=False keeps them, so the device holds both copies at the end."""
    sig, out = signature(params), {}
    for s in steps(layout, sig):
        kept, freed = _arguments(s, params, donate)
        with warnings.catch_warnings():  # an input of another size is freed, not reused
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            out[s.name] = _program(layout, sig, s.name, donate)(kept, freed)
        for leaf in jax.tree.leaves(freed):  # given up even where not reused
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
    return out


def nbytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs."""
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def peak(layout: Callable, params: dict, *, donate: bool = True,
         compile_step=lambda fn, args: fn.lower(*args).compile()) -> dict[str, int]:
    """Device bytes `lay_out(layout, params, donate=donate)` holds, replayed from each
    step's compiled `memory_analysis()` (params may be ShapeDtypeStructs; compile_step(fn,
    args) compiles a step, by default for the default backend): "peak" (the most at once:
    the outputs made, the inputs not freed and the step's outputs and temporaries, less
    what it aliases), "params", "prepared" (the outputs) and "largest" (the largest
    input or output)."""
    sig = signature(params)
    shapes = abstract(sig)
    held, made, worst, largest = nbytes(shapes), 0, 0, max(map(nbytes, shapes.values()))
    for s in steps(layout, sig):
        args = _arguments(s, shapes, donate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            compiled = compile_step(_program(layout, sig, s.name, donate), args)
        mem = compiled.memory_analysis()
        out = mem.output_size_in_bytes
        worst = max(worst, held + made + out + mem.temp_size_in_bytes
                    - mem.alias_size_in_bytes)
        made, largest = made + out, max(largest, out)
        held -= nbytes(args[1])
    return dict(peak=worst, params=nbytes(shapes), prepared=made, largest=largest)
