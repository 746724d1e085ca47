"""mk.kernels.backend: the backend names, and the DMA bookkeeping check of interpret mode on
hand-written kernels that start a copy once, twice, or start it and never wait.

(The ring's planted bugs, caught by the same check, are in
tests/kernels/test_weight_streaming.py.)
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.kernels import backend


def _copy_kernel(x_hbm, out_vmem, sem, *, starts, waits):
    copy = pltpu.make_async_copy(x_hbm, out_vmem, sem.at[0])
    for _ in range(starts):
        copy.start()
    for _ in range(waits):
        copy.wait()


def _copy(x, *, starts, waits):
    return pl.pallas_call(
        functools.partial(_copy_kernel, starts=starts, waits=waits),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))])(x)


CASES = {  # name: (starts, waits, what the check reports in "on_wait" / "eager" mode)
    "one start, one wait": (1, 1, None, None),
    "started twice, waited once": (2, 1, "was never waited for", "has count 4096"),
    "started, never waited": (1, 0, "was never waited for", "has count 4096"),
}


@pytest.mark.parametrize("mode", ["on_wait", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_dma_leftovers_name_every_unmatched_start_in_both_dma_modes(case, mode):
    starts, waits, *reports = CASES[case]
    report = reports[mode == "eager"]
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    with backend.use("interpret", dma_execution_mode=mode):
        y = jax.block_until_ready(_copy(x, starts=starts, waits=waits))
    leftovers = backend.dma_leftovers()
    if report is None:
        assert leftovers == []
        np.testing.assert_array_equal(y, x)
    else:
        assert len(leftovers) == 1 and report in leftovers[0], leftovers
    with pytest.raises(RuntimeError, match=report) if report else contextlib.nullcontext():
        with backend.use("interpret", dma_execution_mode=mode, strict_dma=True):
            jax.block_until_ready(_copy(x, starts=starts, waits=waits))


def test_leftovers_speak_of_the_last_block_only():
    x = jnp.zeros((8, 128), jnp.float32)
    with backend.use("interpret"):
        jax.block_until_ready(_copy(x, starts=1, waits=0))
    assert backend.dma_leftovers()
    with backend.use("interpret"):
        jax.block_until_ready(_copy(x, starts=1, waits=1))
    assert backend.dma_leftovers() == []


def test_bad_backend_names_are_named():
    with pytest.raises(ValueError, match=r"backend='gpu' must be one of"):
        backend.resolve("gpu")
    with pytest.raises(ValueError, match=r"backend='hardware' needs a TPU"):
        backend.resolve("hardware")


def test_races_are_none_where_no_detector_ran_and_say_so():
    """A printed "races found: False" on a TPU would claim a check that never ran: without
    the detector `races_found` is None, and `races_text` says it was not checked."""
    with backend.use("interpret"):
        assert backend.races_found() is None
    with backend.use("interpret", detect_races=True):
        assert backend.races_found() is False
    assert "not checked" in backend.races_text(None)
    assert backend.races_text(True) == "FOUND"


def test_a_dma_log_refuses_a_kernel_traced_for_the_chip(monkeypatch):
    """The DMA log counts with host callbacks, which only interpret mode runs (on a v5e,
    notebook 05d's count came back 4 K tiles short): on a TPU outside `use("interpret")`
    a DMA started while a log is open is refused; inside it, or on a CPU, it is recorded."""
    from mk.kernels import common

    class Copy:
        started = 0

        def start(self):
            self.started += 1

    monkeypatch.setattr(backend, "on_tpu", lambda: True)
    with common.dma_log() as log:
        with pytest.raises(RuntimeError, match="only TPU interpret mode runs"):
            common.start_dma(Copy(), "k_tile", 64)
        with backend.use("interpret"):
            common.start_dma(Copy(), "k_tile", 64)
        jax.effects_barrier()
    assert log == [("k_tile", 64)]
    common.start_dma(Copy(), "k_tile", 64)  # no log open: nothing is asked of the backend
