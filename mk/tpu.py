"""Ahead-of-time compiles for real TPU generations, with no TPU present.

libtpu ships the whole XLA:TPU + Mosaic compiler. Given a topology name it describes
compile-only devices; `jax.jit(...).lower(...).compile()` against them runs the real
lowering, the VMEM and HBM capacity checks, and reports memory and code size. Nothing runs.

Here: `compile_for_chip(fn, args, chip)` -> `CompileReport`, and `compile_megakernel`, the
whole decode step of a model on one TPU core. Not here: running kernels
(`mk.backend`), the project-side VMEM budget (`mk.kernels.common.vmem_budget`, which
catches the scoped-limit problems this path does not enforce).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np
from jax.experimental import topologies
from jax._src.pallas.mosaic.error_handling import MosaicError
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mk import megakernel
from mk.chips import ChipSpec, chip as chip_spec
from mk.config import check_rows
from mk.kernels.common import VmemBudget, vmem_budget
from mk.kernels.one_layer import layer_block


# What libtpu and Mosaic raise for a kernel they refuse (capacity, lowering, verification).
COMPILER_ERRORS = (jax.errors.JaxRuntimeError, pltpu.LoweringException, MosaicError)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """The outcome of one ahead-of-time compile."""

    name: str
    chip: str
    ok: bool
    error: str  # the compiler's message when not ok
    compile_seconds: float
    argument_bytes: int = 0  # HBM for the inputs
    output_bytes: int = 0
    temp_bytes: int = 0  # HBM scratch XLA allocates around the kernel
    code_bytes: int = 0  # generated code size
    vmem: VmemBudget | None = None

    def summary(self) -> str:
        if not self.ok:
            return f"{self.name} on {self.chip}: FAILED in {self.compile_seconds:.2f} s: " \
                   f"{self.error.splitlines()[0] if self.error else ''}"
        vmem = (f", VMEM {self.vmem.total_bytes / 2**20:.1f} of "
                f"{self.vmem.limit_bytes / 2**20:.0f} MiB") if self.vmem else ""
        return (f"{self.name} on {self.chip}: compiled in {self.compile_seconds:.2f} s, "
                f"HBM args {self.argument_bytes / 2**20:.1f} MiB, code "
                f"{self.code_bytes / 1024:.0f} KiB{vmem}")


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


def compile_for_chip(fn, args, chip: str | ChipSpec, *, name: str = "",
                     vmem: VmemBudget | None = None) -> CompileReport:
    """Compile `fn(*args)` for one core of `chip`; args are pytrees of arrays or
    ShapeDtypeStructs.

    A compiler error is returned in the report (ok=False), not raised, so a notebook can
    show it; an unknown chip or a GPU raises ValueError.
    """
    spec = chip_spec(chip) if isinstance(chip, str) else chip
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}; only TPUs compile here")
    name = name or getattr(fn, "__name__", "kernel")
    mesh = Mesh(np.array(devices(spec.topology)[:1]), ("core",))
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), list(args))
    start = time.perf_counter()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(fn, in_shardings=replicated,
                               out_shardings=replicated).lower(*shapes).compile()
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


def compile_megakernel(config, chip: str | ChipSpec, *, batch: int = 8, rows: int = 1,
                       context: int = 4096, block_sizes=None) -> CompileReport:
    """Compile the whole-model megakernel of `config` for one core of `chip`.

    A model whose weights and cache do not fit the core's share of HBM, or whose buffers
    do not fit VMEM, is reported (ok=False, with the numbers), not raised.
    """
    spec = chip_spec(chip) if isinstance(chip, str) else chip
    name = f"megakernel {config.name} B={batch} T={rows} S={context}"
    M = check_rows(batch, rows)
    block = block_sizes or dataclasses.replace(layer_block(config),
                                               kv_tile=min(256, context))
    megakernel.check_block(block, context, M)  # what the runtime refuses, refused here too
    params = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in config.param_shapes().items()}
    weights = jax.eval_shape(lambda p: megakernel.prepare(config, p, block), params)
    cache = jax.ShapeDtypeStruct((config.layers, batch, config.kv_heads, context,
                                  config.head_dim), config.dtype)
    hbm = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(weights)) + 2 * (
        cache.size * cache.dtype.itemsize)
    per_core = spec.hbm_bytes // spec.cores_per_chip
    if hbm > per_core:
        return CompileReport(name, spec.name, False, f"weights and KV cache need "
                             f"{hbm / 2**30:.1f} GiB of HBM, over {spec.name}'s "
                             f"{per_core / 2**30:.1f} GiB per core", 0.0)
    try:
        budget = vmem_budget("megakernel", megakernel.megakernel_buffers(
            config, batch, rows, block), spec)
    except ValueError as err:
        return CompileReport(name, spec.name, False, str(err), 0.0)
    tokens = jax.ShapeDtypeStruct((batch, rows), jax.numpy.int32)
    positions = jax.ShapeDtypeStruct((batch,), jax.numpy.int32)
    return compile_for_chip(
        lambda w, k, v, t, p: megakernel.compile_target(config, block, w, k, v, t, p),
        [weights, cache, cache, tokens, positions], spec, name=name, vmem=budget)
