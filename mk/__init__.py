"""mk: a TPU decode megakernel in JAX Pallas, built stage by stage and checked on CPU.

Top-level names: `ModelConfig`, `preset`, `chip`, `init_params`, `load_checkpoint`,
`quantize`; modules `mk.reference` (the pure-JAX oracle), `mk.quant` (weight storage),
`mk.megakernel` (the whole decode step in one kernel), `mk.perf` (bytes, FLOPs and the
roofline), `mk.sim` (the tile schedule replayed on a chip model) and `mk.tpu`
(ahead-of-time TPU compiles). Every other module (the stage kernels in `mk.kernels`, the
plan `mk.kernels.plan`, the weight table `mk.weights`, the layer kinds `mk.kinds`, ...)
is imported by name; docs/layout.md lists them all.

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
    # libtpu's lockfile guards a real TPU; compile-only use (mk.tpu) is safe from several
    # processes at once (parallel test workers, a notebook beside the tests).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Without these, libtpu looks for TPU hosts at its first use and prints warnings; the
    # values do not change what mk.tpu compiles (the topology name decides that).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")

from mk import megakernel, perf, quant, reference, sim, tpu  # noqa: E402
from mk.checkpoint import init_params, load_checkpoint  # noqa: E402
from mk.chips import ChipSpec, chip  # noqa: E402
from mk.config import ModelConfig  # noqa: E402
from mk.presets import preset  # noqa: E402
from mk.quant import quantize  # noqa: E402

__all__ = ["ChipSpec", "ModelConfig", "chip", "init_params", "load_checkpoint", "megakernel",
           "perf", "preset", "quant", "quantize", "reference", "sim", "tpu"]
