"""XLA's own decode step for a TPU, compiled ahead of time and read op by op.

What the megakernel is compared with on a TPU: the model in plain JAX
(`mk.model.reference.forward`, the step the compile-time benchmark calls "XLA unrolled") jitted
for one core of a chip on libtpu's compile-only devices (`mk.measure.tpu.devices`), and the entry
computation of the compiled program read instruction by instruction. XLA runs the
program's fusions one after another; each is one kernel on the TensorCore, reading its
operands and writing its results where the layout says (`S(1)` is VMEM, no memory space
is HBM), and XLA's own `copy-start`/`copy-done` pairs prefetch some operands into VMEM.

Here: `compile_step(config, chip, ...)` -> `XlaStep` (counts of the compiled entry
computation's instructions and the bytes its fusions touch) and `parse_entry` (the
instructions of an HLO text). XLA decides fusion and prefetch for the program as a whole,
so a cut of the first n layers does not scale linearly to the model (measured: qwen3-8b on
tpu7x gives 70, 98, 124 fusions for 2, 3, 4 layers): count the layers you report. Nothing
runs and nothing is timed: turning counts into time needs an assumed cost per fusion
boundary, which the notebook states where it uses one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mk.model import reference
from mk.measure import tpu
from mk.model.chips import ChipSpec, spec_of
from mk.model.config import ModelConfig, check_rows
from mk.model.weights import abstract_params

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction of the compiled entry computation."""

    name: str
    opcode: str  # "fusion", "copy-start", "custom-call", "dot", ...
    fusion_kind: str  # kLoop, kInput, kOutput, kCustom; "" for other ops
    operand_bytes: int  # bytes of the operands it reads
    result_bytes: int  # bytes of its results
    result_hbm_bytes: int  # of which laid out in HBM (no memory space in the layout)


@dataclasses.dataclass(frozen=True)
class XlaStep:
    """The instructions of one compiled XLA decode step."""

    config_name: str
    chip_name: str
    layers: int
    fusions: int  # fusion kernels run one after another
    async_copies: int  # copy-start instructions: XLA's own prefetches
    other_ops: int  # every other instruction but parameters, constants, tuples, bitcasts
    fusion_bytes: int  # operands read + results written by the fusions
    fusion_hbm_write_bytes: int  # fusion results laid out in HBM


_FREE = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-done")


def _array_bytes(shape: str) -> tuple[int, int]:
    """(all bytes, bytes laid out in HBM) of the arrays a shape string names."""
    total = hbm = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
        total += n
        hbm += 0 if "S(" in (layout or "") else n
    return total, hbm


def _split(rest: str) -> tuple[str, str, str]:
    """(shape, opcode, operand text) of the right-hand side of an HLO instruction."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):  # noqa: B007 - i is read after the break
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    depth, end = 1, 0
    for end, ch in enumerate(rest):  # noqa: B007 - end is read after the break
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return shape, opcode.strip(), rest[:end]


def parse_entry(hlo_text: str) -> list[Op]:
    """The instructions of the ENTRY computation of an HLO module's text."""
    lines = hlo_text[hlo_text.index("\nENTRY"):].splitlines()[1:]
    shapes: dict[str, int] = {}
    ops = []
    for line in lines:
        if line.startswith("}"):
            break
        match = _LINE.match(line)
        if not match:
            continue
        name, rest = match.groups()
        shape, opcode, operands = _split(rest)
        total, hbm = _array_bytes(shape)
        shapes[name] = total
        kind = re.search(r"kind=(k\w+)", rest)
        ops.append(Op(name, opcode, kind[1] if kind and opcode == "fusion" else "",
                      sum(shapes.get(o, 0) for o in re.findall(r"%([\w.\-]+)", operands)),
                      total, hbm))
    return ops


def _count(config: ModelConfig, spec: ChipSpec, ops: list[Op]) -> XlaStep:
    fusions = [o for o in ops if o.opcode == "fusion"]
    return XlaStep(config.name, spec.name, config.layers, len(fusions),
                   sum(o.opcode == "copy-start" for o in ops),
                   sum(o.opcode not in _FREE + ("fusion", "copy-start") for o in ops),
                   sum(o.operand_bytes + o.result_bytes for o in fusions),
                   sum(o.result_hbm_bytes for o in fusions))


def compile_step(config: ModelConfig, chip: ChipSpec | str, *, batch: int = 1, rows: int = 1,
                 context: int = 256) -> XlaStep:
    """Compile `mk.model.reference.forward` of `config` for one core of `chip` and count the
    instructions of its entry computation."""
    spec = spec_of(chip)
    if spec.kind != "tpu":
        raise ValueError(f"chip={spec.name!r} is a {spec.kind}; XLA:TPU compiles for TPUs")
    check_rows(batch, rows)
    params = abstract_params(config)
    kv = jax.ShapeDtypeStruct((config.layers, batch, config.kv_heads, context,
                               config.head_dim), config.dtype)  # [L, B, K, S, H]
    args = [params, reference.KVCache(kv, kv), jax.ShapeDtypeStruct((batch, rows), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32)]
    mesh = Mesh(np.array(tpu.devices(spec.topology)[:1]), ("core",))
    replicated = NamedSharding(mesh, PartitionSpec())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(functools.partial(reference.forward, config),
                           in_shardings=replicated, out_shardings=replicated
                           ).lower(*args).compile()
    return _count(config, spec, parse_entry(compiled.as_text()))
