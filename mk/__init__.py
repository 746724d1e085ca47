"""mk: a TPU decode megakernel in JAX Pallas, built stage by stage and checked on CPU.

Top-level names: `ModelConfig`, `preset`, `chip`, `init_params`, `load_checkpoint`,
`quantize`. The modules stand in floors, each importing only those below it: `mk.model`
(config, the weight table, the pure-JAX oracle `mk.model.reference`, quant), `mk.kernels`
(the Pallas machinery), `mk.kinds` (each layer kind beside its kernels), `mk.step` (the
plan and `mk.step.megakernel`), `mk.measure` (`mk.measure.tpu`'s compiles, timings), `mk.cost`
(`mk.cost.perf`, `mk.cost.sim`), `mk.speculative`,
`mk.course`; docs/layout.md lists them all.

Importing `mk` on a machine without a TPU pins JAX to the CPU (`JAX_PLATFORMS=cpu`,
`TPU_SKIP_MDS_QUERY=1`) before JAX is imported, so libtpu does not print host-discovery
errors, and lets several processes compile for TPUs at once; a variable the user already
set is left alone.
"""

import glob
import os


def _tpu_present() -> bool:
    # TPU VMs (Colab TPU runtimes included) expose /dev/accel* (v5e and later) or
    # /dev/vfio devices; a CPU-only machine has neither.
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


if not _tpu_present():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu's lockfile guards a real TPU; compile-only use (mk.measure.tpu) is safe from several
    # processes at once (parallel test workers, a notebook beside the tests).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Without these, libtpu looks for TPU hosts at its first use and prints warnings; the
    # values do not change what mk.measure.tpu compiles (the topology name decides that).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")

import mk.cost.perf  # noqa: E402, F401 - loaded by `import mk`, under its floor
import mk.cost.sim  # noqa: E402, F401
import mk.measure.tpu  # noqa: E402, F401
import mk.model.quant  # noqa: E402, F401
import mk.model.reference  # noqa: E402, F401
import mk.step.megakernel  # noqa: E402, F401
from mk.model.checkpoint import init_params, load_checkpoint  # noqa: E402
from mk.model.chips import ChipSpec, chip  # noqa: E402
from mk.model.config import ModelConfig  # noqa: E402
from mk.model.presets import preset  # noqa: E402
from mk.model.quant import quantize  # noqa: E402

del mk  # the name `import mk.x.y` binds: mk is no attribute of itself

__all__ = ["ChipSpec", "ModelConfig", "chip", "init_params", "load_checkpoint",
           "preset", "quantize"]
