"""In-kernel collectives over remote DMA: barrier, all-reduce, all-gather, greedy argmax.

Tensor parallelism splits every matrix of a step over the `n` devices of one mesh axis
("tp"); the residual stream stays replicated, so the step needs, inside the kernel, an
all-reduce after each row-parallel matmul and a cross-shard argmax after the
vocab-parallel lm_head. Two algorithms (`ALGORITHMS`) move the same bytes in different
message rounds: "recursive" (log2(n) rounds a phase, partner me XOR d) and "two_phase"
(one round a phase, every peer at once). Every device's result is bit-identical: one
fixed summation tree (`tree_sum`) for every chunk.

Here: `check_devices`, `tp_mesh`, `ALGORITHMS`, `rounds`, `choose_algorithm`,
`exchanges` (the schedule as data), `all_reduce_bytes`, `CollectiveScratch`, `barrier`,
`all_reduce_body`, `all_gather_body`, `argmax_body`, `tree_sum`, the time model
(`allreduce_s`, `allgather_s`, `round_s`, `ICI_LATENCY_S`, `ici_bandwidth`), and the
standalone kernels `all_reduce`, `all_gather`, `greedy_argmax` (inside `jax.shard_map`).
Not here:
meshes with more than one axis, non-power-of-two device counts, overlap of a collective
with the next matmul. Each algorithm round by round, why the results are bit-identical
and why two buffer slots suffice: docs/design/mk.kernels.collectives.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from mk.model.chips import ChipSpec
from mk.model.config import positive_int
from mk.kernels.common import Buffer

AXIS = "tp"  # the mesh axis the tensor-parallel shards live on
COLLECTIVE_IDS = {"all_reduce": 1, "all_gather": 2, "argmax": 3, "megakernel": 4}
MAX_INDEX = 2 ** 24  # token ids travel as float32 next to their logit: exact below 2^24
# One message step of a collective on a chip with no measured round (`round_s`): the
# per-link latency ASTRA-sim uses for TPUs "as per the TPU research team"
# (astra-sim.github.io/astra-sim-docs/validation/hardware/tpu-validation.html).
ICI_LATENCY_S = 1e-6
PARTIAL_SUM_BYTES = 4  # the megakernel all-reduces float32 partial sums


ALGORITHMS = ("recursive", "two_phase")  # module docstring


def rounds(algorithm: str, n: int) -> int:
    """Message rounds of one phase (a reduce-scatter, an all-gather) of `algorithm` over n
    devices: ceil(log2 n) ("recursive"), 1 ("two_phase"), 0 for n = 1."""
    check_algorithm(algorithm)
    positive_int("n", n)
    if n == 1:
        return 0
    return math.ceil(math.log2(n)) if algorithm == "recursive" else 1


def check_algorithm(algorithm) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"collective algorithm={algorithm!r} must be one of {ALGORITHMS}")
    return algorithm


def choose_algorithm(n: int, algorithm: str | None = None) -> str:
    """`algorithm` checked, or by default the one of fewer message rounds over n devices
    ("recursive" where they tie: n <= 2, the same single exchange)."""
    if algorithm is not None:
        return check_algorithm(algorithm)
    return "two_phase" if rounds("two_phase", n) < rounds("recursive", n) else "recursive"


def allreduce_s(nbytes: float, tp: int, spec: ChipSpec, algorithm: str | None = None,
                latency_s: float | None = None) -> float:
    """Seconds of one all-reduce of `nbytes` per device over `tp` devices, as
    `all_reduce_body` runs it with `algorithm` (default `choose_algorithm(tp)`'s): a
    reduce-scatter then an all-gather, `rounds` each of one `latency_s` (default
    `round_s(spec)`), each device sending 2 (tp - 1) / tp of the message at its one-way
    bandwidth (`ici_bandwidth`). 0 for tp = 1. A model of time over measured or datasheet
    numbers."""
    positive_int("tp", tp)
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    phases = 2 * rounds(choose_algorithm(tp, algorithm), tp)
    return phases * round_s(spec, latency_s) + 2 * (tp - 1) / tp * nbytes / ici_bandwidth(
        spec)


def allgather_s(nbytes: float, n: int, spec: ChipSpec, algorithm: str | None = None,
                latency_s: float | None = None) -> float:
    """Seconds of one all-gather of an `nbytes` item from each of `n` devices, as
    `all_gather_body` runs it: `rounds` of one `latency_s` (default `round_s(spec)`), each
    device receiving the other n - 1 items at its one-way bandwidth. 0 for n = 1."""
    positive_int("n", n)
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    phases = rounds(choose_algorithm(n, algorithm), n)
    return phases * round_s(spec, latency_s) + (n - 1) * nbytes / ici_bandwidth(spec)


def round_s(spec: ChipSpec, latency_s: float | None = None) -> float:
    """One message round of a collective on `spec`: `latency_s` where given, else the
    chip's measured round (`ChipSpec.collective_round_s`: TPU7x's, the release's), else
    ICI_LATENCY_S."""
    if latency_s is None:
        return spec.collective_round_s or ICI_LATENCY_S
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not (
            0 <= latency_s < float("inf")):
        raise ValueError(f"latency_s={latency_s!r} must be >= 0 seconds, and finite")
    return latency_s


def ici_bandwidth(spec: ChipSpec) -> float:
    """One device's one-way bandwidth to its collective peers, bytes/s: as measured
    (`ChipSpec.link_bw`: TPU7x's three links at 134 GB/s, the release's), else the
    datasheet's ici_bw / 2 (one direction) / cores_per_chip (the two TensorCores of a
    TPU7x chip are ICI peers)."""
    return spec.link_bw or spec.ici_bw / 2 / spec.cores_per_chip


def tp_mesh(n: int, devices=None) -> jax.sharding.Mesh:
    """A one-axis mesh ("tp",) over the first n devices (default: `jax.devices()`)."""
    n = 1 << check_devices(n)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        raise ValueError(f"tp={n} needs {n} devices; this process has {len(devices)} (on "
                         f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{interpret_devices(n)} before importing jax)")
    mesh = jax.sharding.Mesh(np.array(devices[:n]), (AXIS,))
    check_interpret_devices(mesh)
    return mesh


def interpret_devices(n: int) -> int:
    """CPU devices a process needs to run an n-device collective kernel in TPU interpret
    mode: 2n. XLA's CPU client sizes its thread pool by the device count, and a device
    blocked on a semaphore (or allocating its buffers in a host callback) holds a pool
    thread; with every device in the mesh nothing is left to run the others, and the
    kernel deadlocks (tp=2 on exactly 2 CPU devices: no output in 420 s)."""
    return 2 * n if n > 1 else 1


def check_interpret_devices(mesh: jax.sharding.Mesh) -> None:
    """Refuse, with what to set, a CPU mesh whose collective kernels would deadlock in
    interpret mode (`interpret_devices`); TPU meshes and tp=1 pass."""
    n = mesh.shape.get(AXIS, 1)
    platform = mesh.devices.flat[0].platform
    if platform == "cpu" and n > 1 and len(jax.devices("cpu")) < interpret_devices(n):
        raise ValueError(
            f"tp={n} on CPU (TPU interpret mode) needs >= {interpret_devices(n)} CPU devices "
            f"in the process; it has {len(jax.devices('cpu'))}, and with every device in the "
            "mesh the kernel deadlocks (XLA's CPU thread pool has one thread per device). "
            f"Set XLA_FLAGS=--xla_force_host_platform_device_count={interpret_devices(n)} "
            "before importing jax")


def check_devices(n: int, field: str = "tp") -> int:
    """n devices on the axis: a power of two >= 1 (a Python or numpy integer); returns
    log2(n)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1 \
            or n & (n - 1):
        raise ValueError(f"{field}={n!r} must be a power of two >= 1")
    return int(n).bit_length() - 1


def tree_sum(parts: jax.Array) -> jax.Array:
    """The all-reduce's summation order on parts [n, ...]: halve and add, n/2 then n/4..."""
    while parts.shape[0] > 1:
        half = parts.shape[0] // 2
        parts = parts[:half] + parts[half:]
    return parts[0]


def exchanges(n: int, algorithm: str = "recursive") -> list[dict]:
    """The all-reduce's schedule as data (the kernel derives the same from its traced
    index): one row per (phase, round, device, partner) with the chunk range
    [first, first + count) it sends, in units of 1/n of the array."""
    check_devices(n, "n")
    rows = []
    if check_algorithm(algorithm) == "two_phase":
        for phase in ("reduce-scatter", "all-gather"):
            for me in range(n):
                for k in range(1, n):  # chunk p to device p; then my sum to every peer
                    p = (me + k) % n
                    rows.append(dict(phase=phase, round=0, device=me, partner=p,
                                     first=p if phase == "reduce-scatter" else me, count=1))
        return rows
    for phase, distances in (("reduce-scatter", [1 << r for r in reversed(range(
            check_devices(n, "n")))]), ("all-gather", [1 << r for r in range(
            check_devices(n, "n"))])):
        for step, d in enumerate(distances):
            for me in range(n):
                if phase == "reduce-scatter":  # give the half not holding chunk `me`
                    first = (me & ~(2 * d - 1)) + (d - (me & d))
                else:  # send the aligned block of d chunks gathered so far
                    first = me & ~(d - 1)
                rows.append(dict(phase=phase, round=step, device=me, partner=me ^ d,
                                 first=first, count=d))
    return rows


def all_reduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one device sends in one all-reduce of an nbytes array: 2 (n-1)/n of it."""
    return 2 * (n - 1) * nbytes // n


# -- Scratch -------------------------------------------------------------------------------
class CollectiveScratch(NamedTuple):
    """The scratch refs of one collective of [R, C] float32 values over n devices, by the
    names `collective_scratch` gives them."""

    gathered: Any  # [2, n, R, C/n] f32 (all-reduce) or [2, n, R, C] (all-gather)
    sems: Any  # DMA semaphores [2, 2, 2, rounds]: (slot, send/recv, phase, round), with
    #            "two_phase" (slot, send/recv, phase, peer offset k - 1)
    stage: Any = None  # [n, R, C/n] f32: this device's partial, chunked (all-reduce only)
    recv: Any = None  # reduce-scatter receive regions per slot, f32: [2, n-1, R, C/n]
    #                   ("recursive"), [2, n, R, C/n] ("two_phase": device j's at j)


def collective_buffers(name: str, rows: int, cols: int, n: int, *, reduce: bool,
                       algorithm: str = "recursive") -> list[Buffer]:
    """The VMEM buffers of one collective called `name` (its group; each buffer is
    "name.field" of `CollectiveScratch`, semaphores aside); reduce=False is an all-gather,
    which needs no staging or reduce-scatter regions."""
    check_algorithm(algorithm)
    if not reduce:
        return [Buffer(f"{name}.gathered", (2, n, rows, cols), "float32", name)]
    if cols % n:
        raise ValueError(f"{name}: cols={cols} must be a multiple of the devices n={n}")
    c = cols // n
    regions = n if algorithm == "two_phase" else max(n - 1, 1)
    return [Buffer(f"{name}.stage", (n, rows, c), "float32", name),
            Buffer(f"{name}.recv", (2, regions, rows, c), "float32", name),
            Buffer(f"{name}.gathered", (2, n, rows, c), "float32", name)]


def collective_semaphores(n: int, algorithm: str = "recursive"):
    """The DMA semaphores of one collective over n devices: one per (slot, send/recv,
    phase, round) ("recursive") or per peer offset ("two_phase")."""
    check_devices(n, "n")
    last = n - 1 if check_algorithm(algorithm) == "two_phase" else rounds(algorithm, n)
    return pltpu.SemaphoreType.DMA((2, 2, 2, max(last, 1)))


def collective_scratch(rows: int, cols: int, n: int, *, reduce: bool,
                       algorithm: str = "recursive") -> dict:
    """The pallas scratch of one collective by `CollectiveScratch` field:
    `CollectiveScratch(**refs)`."""
    return {b.name.partition(".")[2]: pltpu.VMEM(b.shape, b.dtype)
            for b in collective_buffers("c", rows, cols, n, reduce=reduce,
                                        algorithm=algorithm)} | {
        "sems": collective_semaphores(n, algorithm)}


# -- Kernel-side helpers -------------------------------------------------------------------
def _peer(me, d: int):
    return (lax.bitwise_xor(me, jnp.int32(d)),)


def _offset_peer(me, k: int, n: int):
    return (lax.rem(me + jnp.int32(k), jnp.int32(n)),)


def barrier(n: int, axis: str = AXIS, algorithm: str = "recursive"):
    """Wait until each partner (me XOR 2^r; with "two_phase" every peer) has entered the
    kernel; the kernel must be compiled with a `collective_id` (`compiler_params`)."""
    if n == 1:
        return
    me = lax.axis_index(axis)
    sem = pltpu.get_barrier_semaphore()
    check_devices(n, "n")
    peers = ([_offset_peer(me, k, n) for k in range(1, n)]
             if check_algorithm(algorithm) == "two_phase"
             else [_peer(me, 1 << r) for r in range(rounds(algorithm, n))])
    for peer in peers:
        pl.semaphore_signal(sem, 1, device_id=peer, device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(sem, len(peers))


def _exchange(src, dst, sems, slot, phase: int, r: int, peer):
    """Send src to dst on `peer` and wait both for it and for the peer's matching send."""
    copy = pltpu.make_async_remote_copy(src, dst, sems.at[slot, 0, phase, r],
                                        sems.at[slot, 1, phase, r], device_id=peer,
                                        device_id_type=pl.DeviceIdType.MESH)
    copy.start()
    copy.wait_send()
    copy.wait_recv()  # the peer's copy has the same shape and semaphores


def _direct(src_of, dst_of, sems, slot, me, n: int, phase: int):
    """One "two_phase" round: send src_of(peer) to dst_of(k) on each peer = me + k mod n
    (k = 1 .. n-1), all in flight at once, then wait for every send and for the n-1
    matching sends into this device (from me - k, same shape, same semaphores)."""
    copies = []
    for k in range(1, n):
        peer = _offset_peer(me, k, n)
        copy = pltpu.make_async_remote_copy(src_of(peer[0]), dst_of(k),
                                            sems.at[slot, 0, phase, k - 1],
                                            sems.at[slot, 1, phase, k - 1], device_id=peer,
                                            device_id_type=pl.DeviceIdType.MESH)
        copy.start()
        copies.append(copy)
    for copy in copies:
        copy.wait_send()
    for copy in copies:
        copy.wait_recv()


def _gather_direct(gathered, sems, slot, me, n: int, phase: int):
    """"two_phase" all-gather on gathered [n, ...] (this slot's view): item `me` is in
    place; send it to position `me` of every peer."""
    mine = gathered.at[pl.ds(me, 1)]
    _direct(lambda peer: mine, lambda k: mine, sems, slot, me, n, phase)


def _gather_rounds(gathered, sems, slot, me, n: int, phase: int):
    """Recursive doubling on gathered [n, ...] (this slot's view): item `me` is in place;
    after round d every device holds the 2d items of its aligned block."""
    for r in range(check_devices(n, "n")):
        d = 1 << r
        start = pl.multiple_of(lax.bitwise_and(me, jnp.int32(~(d - 1))), d)
        block = gathered.at[pl.ds(start, d)]
        _exchange(block, block, sems, slot, phase, r, _peer(me, d))


def _gather(algorithm: str):
    return _gather_direct if check_algorithm(algorithm) == "two_phase" else _gather_rounds


def all_gather_body(x, s: CollectiveScratch, *, n: int, slot=0, axis: str = AXIS,
                    algorithm: str = "recursive"):
    """x [R, C] on every device -> [n, R, C] value (device i's x at i); s.gathered is
    [2, n, R, C]; `slot` (int or traced) alternates between consecutive collectives."""
    if n == 1:
        return x[None]
    me = lax.axis_index(axis)
    gathered = s.gathered.at[slot]
    gathered[pl.ds(me, 1)] = x[None].astype(gathered.dtype)
    _gather(algorithm)(gathered, s.sems, slot, me, n, phase=1)
    return gathered[...]


def all_reduce_body(x, s: CollectiveScratch, *, n: int, slot=0, axis: str = AXIS,
                    algorithm: str = "recursive"):
    """x [R, C] f32 partial on every device -> the [R, C] sum over devices, bit-identical
    on every device and summed in `tree_sum` order by either `algorithm` (module
    docstring; its scratch `collective_scratch(..., algorithm=)`); `slot` as in
    `all_gather_body`."""
    if n == 1:
        return x
    me = lax.axis_index(axis)
    R, C = x.shape
    c = C // n
    stage, recv = s.stage, s.recv.at[slot]
    for i in range(n):
        stage[i] = x[:, i * c:(i + 1) * c].astype(stage.dtype)
    gathered = s.gathered.at[slot]
    if check_algorithm(algorithm) == "two_phase":  # device j's partial of my chunk at j
        recv[pl.ds(me, 1)] = stage[pl.ds(me, 1)]
        _direct(lambda peer: stage.at[pl.ds(peer, 1)], lambda k: recv.at[pl.ds(me, 1)],
                s.sems, slot, me, n, phase=0)
        gathered[pl.ds(me, 1)] = tree_sum(recv[...])[None]
        _gather_direct(gathered, s.sems, slot, me, n, phase=1)
        return jnp.concatenate([gathered[i] for i in range(n)], axis=1)
    offset = 0
    for r in reversed(range(check_devices(n, "n"))):  # d = n/2, ..., 1
        d = 1 << r
        base = lax.bitwise_and(me, jnp.int32(~(2 * d - 1)))
        mine = lax.bitwise_and(me, jnp.int32(d))
        keep = pl.multiple_of(base + mine, d)
        give = pl.multiple_of(base + (d - mine), d)
        region = recv.at[pl.ds(offset, d)]
        _exchange(stage.at[pl.ds(give, d)], region, s.sems, slot, 0, r, _peer(me, d))
        stage[pl.ds(keep, d)] = stage[pl.ds(keep, d)] + region[...]
        offset += d
    gathered[pl.ds(me, 1)] = stage[pl.ds(me, 1)]
    _gather_rounds(gathered, s.sems, slot, me, n, phase=1)
    return jnp.concatenate([gathered[i] for i in range(n)], axis=1)


def argmax_body(logits, first_id, s: CollectiveScratch, *, n: int, valid=None, slot=0,
                axis: str = AXIS, algorithm: str = "recursive"):
    """Greedy token of each row over every shard's logits: logits [M, Vs] f32 holding ids
    first_id + [0, Vs) on this device (`valid` [M, Vs] bool masks padding) -> [M, 1]
    int32, ties to the lowest id, the same on every device. s.gathered is
    [2, n, M, 128] f32. With n=1 (s unused) it is the single-device argmax, op for op."""
    M, Vs = logits.shape
    local = lax.broadcasted_iota(jnp.int32, (M, Vs), 1)
    if valid is not None:
        logits = jnp.where(valid, logits, -jnp.inf)
    # NaN counts as the largest value (mk.model.reference.greedy's contract): a row with a NaN
    # gives its first NaN's id, never the fallback Vs (one past the last id).
    nan = logits != logits
    first_nan = jnp.min(jnp.where(nan, local, Vs), axis=1, keepdims=True)  # Vs: none
    best = jnp.max(jnp.where(nan, -jnp.inf, logits), axis=1, keepdims=True)
    index = jnp.min(jnp.where(logits == best, local, Vs), axis=1, keepdims=True)
    has_nan = first_nan < Vs
    index = jnp.where(has_nan, first_nan, index)
    if n == 1:
        return index
    best = jnp.where(has_nan, jnp.nan, best)
    index = index + first_id
    lane = lax.broadcasted_iota(jnp.int32, (M, 128), 1)
    packed = jnp.where(lane == 0, best, jnp.where(lane == 1, index.astype(jnp.float32), 0.0))
    gathered = all_gather_body(packed, s, n=n, slot=slot, axis=axis, algorithm=algorithm)
    best, index = gathered[0, :, 0:1], gathered[0, :, 1:2]
    for i in range(1, n):  # strictly greater: a tie keeps the lower shard's (lower) id;
        value, other = gathered[i, :, 0:1], gathered[i, :, 1:2]  # a NaN beats a number
        best_nan, value_nan = best != best, value != value
        take = jnp.logical_not(best_nan) & (value_nan | (value > best))
        index = jnp.where(take, other, index)
        best = jnp.where(take, value, best)
    return index.astype(jnp.int32)


# -- Standalone kernels --------------------------------------------------------------------
def _compiler_params(name: str, n: int):
    if n == 1:
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(collective_id=COLLECTIVE_IDS[name], has_side_effects=True)


def _check_stack(x, n: int, name: str, lanes: int):
    check_devices(n, "n")
    if x.ndim != 3 or x.shape[0] % n:
        raise ValueError(f"{name}: x shape {x.shape} must be [n*times, R, C] with n={n}")
    if x.shape[2] % lanes:
        raise ValueError(f"{name}: C={x.shape[2]} must be a multiple of {lanes}")
    return x.shape[0] // n, x.shape[1], x.shape[2]


def _standalone(kernel, collective: str, n: int, out_shape, scratch: dict, name: str):
    """The pallas_call of one standalone collective kernel: one VMEM input and output,
    `collective`'s id in COLLECTIVE_IDS."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(kernel, out_shape=out_shape, in_specs=[vmem], out_specs=vmem,
                          scratch_shapes=scratch,
                          compiler_params=_compiler_params(collective, n), name=name)


def _smap(mesh, fn, x, out_spec):
    check_interpret_devices(mesh)
    return jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=out_spec,
                         check_vma=False)(x)


def all_reduce_kernel(x_vmem, out_vmem, *, n: int, algorithm: str, **scratch):
    """x_vmem [times, R, C] f32 -> out_vmem [times, R, C]: `times` all-reduces in a row
    (slots 0, 1, 0, ...), so a test sees the double buffering reused."""
    s = CollectiveScratch(**scratch)
    barrier(n, algorithm=algorithm)
    for k in range(x_vmem.shape[0]):
        out_vmem[k] = all_reduce_body(x_vmem[k], s, n=n, slot=k % 2, algorithm=algorithm)


def all_reduce(x: jax.Array, mesh: jax.sharding.Mesh, *,
               algorithm: str | None = None) -> jax.Array:
    """x [n*times, R, C] float32, device i holding rows [i*times, (i+1)*times) -> the
    per-device results [n*times, R, C]: block i is device i's copy of the `times` sums
    (`algorithm`: default `choose_algorithm(n)`'s)."""
    n = mesh.shape[AXIS]
    times, R, C = _check_stack(x, n, "all_reduce", n)
    algorithm = choose_algorithm(n, algorithm)

    per_device = _standalone(functools.partial(all_reduce_kernel, n=n, algorithm=algorithm),
                             "all_reduce", n, jax.ShapeDtypeStruct((times, R, C), jnp.float32),
                             collective_scratch(R, C, n, reduce=True, algorithm=algorithm),
                             "mk_all_reduce")
    return _smap(mesh, per_device, x.astype(jnp.float32), P(AXIS))


def all_gather_kernel(x_vmem, out_vmem, *, n: int, slots: int, algorithm: str, **scratch):
    """x_vmem [times, R, C] -> out_vmem [times, n, R, C]."""
    s = CollectiveScratch(**scratch)
    barrier(n, algorithm=algorithm)
    for k in range(x_vmem.shape[0]):
        out_vmem[k] = all_gather_body(x_vmem[k], s, n=n, slot=k % slots, algorithm=algorithm)


def all_gather(x: jax.Array, mesh: jax.sharding.Mesh, *, slots: int = 2,
               algorithm: str | None = None) -> jax.Array:
    """x [n*times, R, C] float32 (device i: rows [i*times, (i+1)*times)) -> per-device
    results [n*times, n, R, C]. slots=1 reuses one buffer slot: the planted bug that the
    race detector must flag (module docstring)."""
    n = mesh.shape[AXIS]
    times, R, C = _check_stack(x, n, "all_gather", 1)
    if slots not in (1, 2):
        raise ValueError(f"all_gather: slots={slots!r} must be 1 or 2")
    algorithm = choose_algorithm(n, algorithm)

    per_device = _standalone(
        functools.partial(all_gather_kernel, n=n, slots=slots, algorithm=algorithm),
        "all_gather", n, jax.ShapeDtypeStruct((times, n, R, C), jnp.float32),
        collective_scratch(R, C, n, reduce=False, algorithm=algorithm), "mk_all_gather")
    return _smap(mesh, per_device, x.astype(jnp.float32), P(AXIS))


def greedy_argmax_kernel(logits_vmem, tokens_vmem, *, n: int, vocab: int, algorithm: str,
                         **scratch):
    """logits_vmem [times, M, Vs] f32 (this shard's ids) -> tokens_vmem [times, M, 1]."""
    s = CollectiveScratch(**scratch)
    barrier(n, algorithm=algorithm)
    Vs = logits_vmem.shape[2]
    first = lax.axis_index(AXIS) * Vs if n > 1 else 0
    for k in range(logits_vmem.shape[0]):
        ids = lax.broadcasted_iota(jnp.int32, logits_vmem.shape[1:], 1) + first
        tokens_vmem[k] = argmax_body(logits_vmem[k], first, s, n=n, valid=ids < vocab,
                                     slot=k % 2, algorithm=algorithm)


def greedy_argmax(logits: jax.Array, mesh: jax.sharding.Mesh, *,
                  vocab: int | None = None, algorithm: str | None = None) -> jax.Array:
    """logits [times, M, n*Vs] float32, the vocab split in n column shards (ids >= vocab
    are padding) -> per-device greedy tokens [n*times, M, 1] int32, ties to the lowest id."""
    n = mesh.shape[AXIS]
    check_devices(n, "n")
    if logits.ndim != 3 or logits.shape[2] % n:
        raise ValueError(f"greedy_argmax: logits shape {logits.shape} must be "
                         f"[times, M, n*Vs] with n={n}")
    times, M, V = logits.shape
    vocab = V if vocab is None else vocab
    if not 1 <= vocab <= V or V > MAX_INDEX:
        raise ValueError(f"greedy_argmax: vocab={vocab} must be in [1, {V}] and "
                         f"the padded vocab {V} <= {MAX_INDEX} (ids travel as float32)")

    algorithm = choose_algorithm(n, algorithm)
    per_device = _standalone(
        functools.partial(greedy_argmax_kernel, n=n, vocab=vocab, algorithm=algorithm),
        "argmax", n, jax.ShapeDtypeStruct((times, M, 1), jnp.int32),
        collective_scratch(M, 128, n, reduce=False, algorithm=algorithm), "mk_greedy_argmax")
    return jax.shard_map(per_device, mesh=mesh, in_specs=P(None, None, AXIS),
                         out_specs=P(AXIS), check_vma=False)(logits.astype(jnp.float32))
