"""Ahead-of-time compiles for real TPU generations, with no TPU present.

libtpu ships the whole XLA:TPU + Mosaic compiler. Given a topology name it describes
compile-only devices; `jax.jit(...).lower(...).compile()` against them runs the real
lowering, the VMEM and HBM capacity checks, and reports memory and code size. Nothing runs.

Here: `compile_for_chip(fn, args, chip)` -> `CompileReport`, `step_compiler` (preparing's
steps compiled for a chip: `mk.step.preparation.peak`), and `compile_megakernel`, the
whole decode step of a model on one TPU core or, tensor-parallel, on tp cores of a
multi-chip topology (`topology_for(chip, chips)` names one): one path and one report for
both. Not here: running kernels (`mk.kernels.backend`), the capacity check (`DecodePlan.fits`: the
project-side VMEM budget, which catches the scoped-limit problems the compiler does not
enforce, and HBM).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mk.step import megakernel, tensor_parallel
from mk.model import quant, reference
from mk.model.chips import ChipSpec, spec_of
from mk.kernels.jax_private import MosaicError
from mk.kernels.collectives import AXIS
from mk.kernels.common import VmemBudget
from mk.step.plan import DecodePlan, plan_chip


# What libtpu and Mosaic raise for a kernel they refuse (capacity, lowering, verification).
COMPILER_ERRORS = (jax.errors.JaxRuntimeError, pltpu.LoweringException, MosaicError)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """The outcome of one ahead-of-time compile (on one core, or on tp cores)."""

    name: str
    chip: str
    ok: bool
    error: str  # the compiler's message, or the capacity check's, when not ok
    compile_seconds: float
    argument_bytes: int = 0  # HBM for the inputs (per core), as the compiler reports it
    output_bytes: int = 0
    temp_bytes: int = 0  # HBM scratch XLA allocates around the kernel
    code_bytes: int = 0  # generated code size
    vmem: VmemBudget | None = None
    tp: int = 1  # cores the step is split over
    hbm_bytes: int = 0  # one core's weights and KV cache (`DecodePlan.fits`)

    def summary(self) -> str:
        cores = f" on {self.tp} cores" if self.tp > 1 else ""
        if not self.ok:
            return (f"{self.name} on {self.chip}{cores}: FAILED in "
                    f"{self.compile_seconds:.2f} s: "
                    f"{self.error.splitlines()[0] if self.error else ''}")
        vmem = (f", VMEM {self.vmem.total_bytes / 2**20:.1f} of "
                f"{self.vmem.limit_bytes / 2**20:.0f} MiB") if self.vmem else ""
        hbm = f", HBM per core {self.hbm_bytes / 2**30:.2f} GiB" if self.hbm_bytes else ""
        return (f"{self.name} on {self.chip}{cores}: compiled in "
                f"{self.compile_seconds:.2f} s, HBM args "
                f"{self.argument_bytes / 2**20:.1f} MiB, code "
                f"{self.code_bytes / 1024:.0f} KiB{hbm}{vmem}")


@functools.cache
def devices(topology: str) -> tuple:
    """Compile-only devices of a libtpu topology (e.g. "v5e:1x1", "tpu7x:2x2x1")."""
    bounds = {}
    shape = topology.partition(":")[2].split("x")
    if not all(d.isdigit() and int(d) > 0 for d in shape):
        raise ValueError(f"topology={topology!r} must be a libtpu name with its shape, "
                         "e.g. 'v5e:2x2' or 'tpu7x:2x2x1'")
    dims = [int(d) for d in shape]
    if np.prod(dims) == 1:
        # A single chip is smaller than libtpu's default host (2x2x1): say it is one.
        bounds = dict(chips_per_host_bounds=[1, 1, 1])
    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **bounds)
    return tuple(desc.devices)


def topology_for(chip: str | ChipSpec, chips: int) -> str:
    """The libtpu topology name of `chips` chips of `chip`'s generation: its own
    single-chip name for 1; otherwise 2 x 2 chips per tray, stacked (a 3-D torus, e.g.
    "tpu7x:2x2x4" for 16 chips) or the 2 x 2 slice of a 2-D one ("v6e:2x2"). Raises
    ValueError for a count with no such name; the name is checked against libtpu's devices
    by `devices` when a compile asks for it."""
    spec = _tpu(chip)
    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 1:
        raise ValueError(f"chips={chips!r} must be a positive integer")
    if chips == 1:
        return spec.topology
    family, _, shape = spec.topology.partition(":")
    three_d = shape.count("x") == 2
    if chips % 4 or (not three_d and chips != 4):
        raise ValueError(f"chips={chips} on {spec.name}: a topology here is 2 x 2 chips"
                         + (" times a depth (a multiple of 4)" if three_d else " (4 chips)"))
    return f"{family}:2x2x{chips // 4}" if three_d else f"{family}:2x2"


def compile_for_chip(fn, args, chip: str | ChipSpec, *, name: str = "",
                     vmem: VmemBudget | None = None, mesh: Mesh | None = None,
                     in_shardings=None, donate: tuple[int, ...] = ()) -> CompileReport:
    """Compile `fn(*args)` for one core of `chip` (or for `mesh`'s cores with
    `in_shardings`, a pytree like args); args are pytrees of arrays or ShapeDtypeStructs;
    donate: the positions of args the caller gives up (updated in place, not copied).

    A compiler error is returned in the report (ok=False), not raised, so a notebook can
    show it; an unknown chip or a GPU raises ValueError.
    """
    spec = _tpu(chip)
    name = name or getattr(fn, "__name__", "kernel")
    if mesh is None:
        mesh = Mesh(np.array(devices(spec.topology)[:1]), ("core",))
        in_shardings = NamedSharding(mesh, PartitionSpec())
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), list(args))
    start = time.perf_counter()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(fn, in_shardings=in_shardings,
                               donate_argnums=donate).lower(*shapes).compile()
    except COMPILER_ERRORS as err:  # the compiler's verdict is the result
        return CompileReport(name, spec.name, False, f"{type(err).__name__}: {err}",
                             time.perf_counter() - start, vmem=vmem)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return CompileReport(name, spec.name, True, "", seconds,
                         argument_bytes=mem.argument_size_in_bytes,
                         output_bytes=mem.output_size_in_bytes,
                         temp_bytes=mem.temp_size_in_bytes,
                         code_bytes=mem.generated_code_size_in_bytes, vmem=vmem)


def step_compiler(chip: str | ChipSpec):
    """A `mk.step.preparation.peak` compile_step: each step compiled for one core of `chip`
    (its arguments ShapeDtypeStructs placed there), so the replayed peak is that
    compiler's: the CPU's keeps other temporaries than a TPU's."""
    core = Mesh(np.array(devices(_tpu(chip).topology)[:1]), ("core",))
    on = NamedSharding(core, PartitionSpec())
    return lambda fn, args: fn.lower(*jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), args)).compile()


CACHE_ARGS = (1,)  # the cache (a KVCache or HybridCache) in the compiled step's arguments


def _tpu(chip: str | ChipSpec) -> ChipSpec:
    spec = spec_of(chip)
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}; only TPUs compile here")
    return spec


def compile_megakernel(plan: DecodePlan, *, topology: str | None = None) -> CompileReport:
    """Compile the whole-model decode step of `plan` for the chip it was made for
    (`DecodePlan.make(config, chip=, tp=, batch=, rows=, context=, block=, formats=,
    feeds=)`: without a block, the chip's tiling, its ring sized by Little's law; feeds
    default to the chip's): the megakernel on one core (tp=1), or its tensor-parallel step
    on tp cores of `topology` (a libtpu name, e.g. "tpu7x:2x2x1"; default the chip's own
    single-chip topology).

    The KV cache is donated, as `generate`'s device loop donates it: updated in place, HBM
    holds it once. A plan that does not fit the core (`DecodePlan.fits`: VMEM or HBM) is
    reported (ok=False, with the numbers), not compiled. The plan's formats: the mk.model.quant
    scheme of each weight family stored quantised (`mk.model.quant.abstract_weight`).
    """
    spec = _tpu(plan_chip(plan, "compile the plan"))
    config, batch, rows, context = plan.config, plan.batch, plan.rows, plan.context
    cores = f" TP{plan.tp}" if plan.tp > 1 else ""
    name = f"megakernel {config.name}{cores} B={batch} T={rows} S={context}"
    fit = plan.fits(spec)
    if not fit.ok:
        return CompileReport(name, spec.name, False, fit.error, 0.0, vmem=fit.vmem,
                             tp=plan.tp, hbm_bytes=fit.hbm_bytes)
    params = quant.abstract_params(config, plan.formats)
    # One device's cache; with tp > 1 stacked [tp, ...] (`mk.step.shards.shard_cache`).
    cache = jax.eval_shape(lambda: reference.init_cache(plan.local, batch, context))
    tokens = jax.ShapeDtypeStruct((batch, rows), jnp.int32)
    positions = jax.ShapeDtypeStruct((batch,), jnp.int32)
    weights = jax.eval_shape(lambda p: megakernel.prepare(plan, p), params)  # tp > 1: [tp, ...]
    if plan.tp == 1:
        report = compile_for_chip(
            lambda w, c, t, p: megakernel.traced_step(plan, w, c, t, p),
            [weights, cache, tokens, positions], spec, name=name, vmem=fit.vmem,
            donate=CACHE_ARGS)
        return dataclasses.replace(report, hbm_bytes=fit.hbm_bytes)
    available = devices(topology or spec.topology)
    if len(available) < plan.tp:
        raise ValueError(f"topology={topology or spec.topology!r} has {len(available)} "
                         f"cores, fewer than tp={plan.tp}")
    mesh = Mesh(np.array(available[:plan.tp]), (AXIS,))
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct((plan.tp, *a.shape), a.dtype), cache)
    sharded, replicated = NamedSharding(mesh, PartitionSpec(AXIS)), NamedSharding(
        mesh, PartitionSpec())
    shardings = [jax.tree.map(lambda _: sharded, weights),
                 jax.tree.map(lambda _: sharded, cache), replicated, replicated]
    report = compile_for_chip(
        lambda w, c, t, p: tensor_parallel.compile_target(plan, mesh, w, c, t, p),
        [weights, cache, tokens, positions], spec, name=name, vmem=fit.vmem,
        mesh=mesh, in_shardings=shardings, donate=CACHE_ARGS)
    return dataclasses.replace(report, tp=plan.tp, hbm_bytes=fit.hbm_bytes)
