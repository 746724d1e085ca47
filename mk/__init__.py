"""mk: a TPU decode megakernel in JAX Pallas, built stage by stage and checked on CPU.

Top-level names: `ModelConfig`, `preset`, `chip`, `init_params`, `load_checkpoint`; modules
`mk.reference` (the pure-JAX oracle, built from `mk.ops`, its array-level blocks, and
`mk.linear_attention`, the gated DeltaNet's math), `mk.quant` (int8, fp8, int4 and fp4
weight storage; `quantize` is `mk.quant.quantize`), `mk.megakernel` (the whole decode step
in one kernel), `mk.perf` (bytes, FLOPs and the roofline), `mk.sim` (the megakernel's tile
schedule replayed on a chip model) and `mk.tpu` (ahead-of-time TPU compiles). The stage
kernels are in `mk.kernels`; `mk.spec` (speculative decoding; its drafters are
`mk.drafters`, the models it steps `mk.runners`), `mk.profiling` and
`mk.tensor_parallel`, `mk.ledger` (the published numbers and the words for step times),
`mk.xla_step` (XLA's own step, compiled and counted) and `mk.bounds` (every index of a
kernel against its allocation, on the traced jaxpr) are imported by name;
`mk.kernels.plan` is one device's step as data; `mk.weights` is the table of every weight
(owner, shape, byte family, path, split, format group, Hugging Face names) and `mk.kinds`
the layer kinds (each one object: its weights, buffers, kernel phases, simulator twin and
config checks; the kernel, the plan and the simulator loop over them).

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
