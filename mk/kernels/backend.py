"""One switch between TPU hardware and TPU interpret mode; the kernels never know.

Every kernel in `mk.kernels` is built with `interpret=False`. Running it inside
`mk.kernels.backend.use("interpret")` makes Pallas simulate the TPU on the CPU (VMEM/HBM, DMAs,
semaphores, and optionally a happens-before race detector); inside `use("hardware")` (or
"auto" on a TPU) nothing changes and Mosaic compiles it for the chip. There is no second
copy of any kernel.

Two checks of interpret mode are read here after a block: `races_found()` (the race
detector) and `dma_leftovers()` (DMA bookkeeping a kernel left behind at its exit: a
semaphore with a non-zero count, a DMA started and never waited for, e.g. a tile issued
twice). Interpret mode itself only prints the first kind and never sees the second in its
default "on_wait" DMA mode (a duplicate DMA just stays queued); `use(..., strict_dma=True)`
makes either an error.

Here: `resolve`, `use`, `interpreting`, `check_active`, `races_found` (and `races_text`),
`dma_leftovers`. Not here: ahead-of-time compiles for a chip that is not present (`mk.measure.tpu`).
"""

from __future__ import annotations

import contextlib

import jax
from jax.experimental.pallas import tpu as pltpu

from mk.kernels.jax_private import config as _jax_config
from mk.kernels.jax_private import interpret_pallas_call as _interpret_state
from mk.kernels.jax_private import source_info_util

BACKENDS = ("auto", "interpret", "hardware")


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def resolve(backend: str) -> str:
    """"auto" -> "hardware" on a TPU, else "interpret"; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend == "auto":
        return "hardware" if on_tpu() else "interpret"
    if backend == "hardware" and not on_tpu():
        raise ValueError(f"backend='hardware' needs a TPU; this process runs on "
                         f"{jax.default_backend()!r} (use 'interpret' or 'auto')")
    return backend


@contextlib.contextmanager
def use(backend: str = "auto", *, detect_races: bool = False,
        dma_execution_mode: str = "on_wait", strict_dma: bool = False):
    """Run the Pallas kernels built and traced inside this block on `backend`.

    `pl.pallas_call(...)` reads the mode when it is built, so build and call kernels
    inside the block (every public wrapper in `mk.kernels` does both at once).

    In interpret mode the simulator's state is reset on entry, so `races_found()` and
    `dma_leftovers()` read at the end of the block speak of this block only, and an
    earlier failure cannot leak in. With `strict_dma`, leaving the block raises
    `RuntimeError` listing the DMA leftovers, if any.
    """
    global _detecting
    if resolve(backend) == "hardware":
        _detecting = False  # the chip has no race detector
        yield
        return
    _detecting = detect_races
    params = pltpu.InterpretParams(detect_races=detect_races,
                                   dma_execution_mode=dma_execution_mode)
    pltpu.reset_tpu_interpret_mode_state()
    _leftovers.clear()
    try:
        with pltpu.force_tpu_interpret_mode(params):
            yield
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise
    if strict_dma and dma_leftovers():
        raise RuntimeError("DMA bookkeeping left at kernel exit:\n  "
                           + "\n  ".join(dma_leftovers()))


def interpreting() -> bool:
    """Whether a kernel built now runs in TPU interpret mode (inside `use("interpret")`)."""
    return _jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def active() -> bool:
    """Whether a kernel built now runs: on a TPU, or inside `use` (interpret mode)."""
    return on_tpu() or interpreting()


def check_active() -> None:
    """Raise ValueError, saying what to do, when a kernel would be run outside `use` on a
    machine without a TPU (Pallas would fail deep in lowering: "Only interpret mode is
    supported on CPU backend")."""
    if active():
        return
    raise ValueError(f"this process runs on {jax.default_backend()!r}, not a TPU: run the "
                     "kernel inside `with mk.kernels.backend.use('interpret'):` (TPU interpret "
                     "mode "
                     "on the CPU), or call mk.step.megakernel.generate or "
                     "mk.speculative.spec.generate, "
                     "which take backend=")


def races_found() -> bool | None:
    """Whether the race detector flagged a race since the last `use(...)` entry; None when
    that block ran no detector (on hardware, or without `detect_races`)."""
    if not _detecting:
        return None
    state = _interpret_state.races
    return bool(state is not None and state.races_found)


def races_text(found: bool | None) -> str:
    """`races_found()`'s answer in words, for a printed result: on hardware the detector
    never runs, and "no race" would claim a check that did not happen."""
    return {None: "not checked (the race detector runs in interpret mode only)",
            False: "none found (race detector on)", True: "FOUND"}[found]


_detecting = False  # whether the last `use(...)` block ran the race detector


def dma_leftovers() -> list[str]:
    """What the interpreted kernels run since the last `use(...)` entry left at their exit:
    one line per semaphore with a non-zero count and per DMA started but never waited for
    (empty when every start was matched by exactly one wait)."""
    jax.effects_barrier()  # the exit checks run in host callbacks: let them finish
    return list(_leftovers)


# -- The exit check (reads JAX internals, here only) -----------------------------------------
# The pinned interpreter (jax 0.10.2, jax/_src/pallas/mosaic/interpret/) ends every kernel
# with a host callback `_validate(token, device_id)` that prints the first semaphore with a
# non-zero count, then frees the simulated memory, so nothing can be read after the call.
# We wrap that callback once, at import, before any kernel is traced (a trace captures the
# function, so a wrapper installed later would miss cached traces). The wrapper only reads:
# each semaphore's `count_by_core` and its queue of pending tasks (`tasks`), whose DMA tasks
# are bound methods of a `DMA` with a `state`; it then calls the original.
_leftovers: list[str] = []
_jax_validate = _interpret_state._validate


def _record_leftovers(token, device_id):
    memory = _interpret_state._get_shared_memory()
    device = int(device_id)
    cores = memory.get_global_core_ids(device)
    with memory.lock:
        semaphores = list(memory.sem.values()) + list(memory.fixed_id_sem.values())
    unfinished = {}
    for sem in semaphores:
        with sem.cv:
            counts = [(core, int(sem.count_by_core[core])) for core in cores]
            tasks = [task for core in cores for task in sem.tasks[core]]
        _leftovers.extend(f"device {device}: semaphore {sem.id} has count {count} on core "
                          f"{core} at kernel exit" for core, count in counts if count)
        for task in tasks:
            dma = getattr(task, "__self__", None)
            if isinstance(dma, _interpret_state.DMA) and (
                    dma.state != _interpret_state.DmaState.COMPLETED):
                unfinished[dma.id] = dma
    for dma in unfinished.values():
        where = source_info_util.summarize(dma.source_info) if dma.source_info else "?"
        _leftovers.append(f"device {device}: DMA {dma.id} started at {where} was never "
                          f"waited for")
    return _jax_validate(token, device_id)


_interpret_state._validate = _record_leftovers
