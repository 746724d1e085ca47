"""One switch between TPU hardware and TPU interpret mode; the kernels never know.

Every kernel in `mk.kernels` is built with `interpret=False`. Running it inside
`mk.backend.use("interpret")` makes Pallas simulate the TPU on the CPU (VMEM/HBM, DMAs,
semaphores, and optionally a happens-before race detector); inside `use("hardware")` (or
"auto" on a TPU) nothing changes and Mosaic compiles it for the chip. There is no second
copy of any kernel.

Here: `resolve`, `use`, `check_active`, `races_found`. Not here: ahead-of-time compiles
for a chip that is not present (`mk.tpu`).
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import config as _jax_config
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interpret_state
from jax.experimental.pallas import tpu as pltpu

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
        dma_execution_mode: str = "on_wait"):
    """Run the Pallas kernels built and traced inside this block on `backend`.

    `pl.pallas_call(...)` reads the mode when it is built, so build and call kernels
    inside the block (every public wrapper in `mk.kernels` does both at once).

    In interpret mode the simulator's state is reset on entry, so `races_found()` read at
    the end of the block speaks of this block only, and an earlier failure cannot leak in.
    """
    if resolve(backend) == "hardware":
        yield
        return
    params = pltpu.InterpretParams(detect_races=detect_races,
                                   dma_execution_mode=dma_execution_mode)
    pltpu.reset_tpu_interpret_mode_state()
    try:
        with pltpu.force_tpu_interpret_mode(params):
            yield
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise


def check_active() -> None:
    """Raise ValueError, saying what to do, when a kernel would be run outside `use` on a
    machine without a TPU (Pallas would fail deep in lowering: "Only interpret mode is
    supported on CPU backend")."""
    if on_tpu() or _jax_config.pallas_tpu_interpret_mode_context_manager.value is not None:
        return
    raise ValueError(f"this process runs on {jax.default_backend()!r}, not a TPU: run the "
                     "kernel inside `with mk.backend.use('interpret'):` (TPU interpret mode "
                     "on the CPU), or call a generate function, which takes backend=")


def races_found() -> bool:
    """Whether the race detector flagged a race since the last `use(...)` entry."""
    state = _interpret_state.races
    return bool(state is not None and state.races_found)
