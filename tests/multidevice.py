"""Run a function on several virtual CPU devices, in a subprocess.

The test suite runs with one CPU device; `--xla_force_host_platform_device_count` only
takes effect before jax is imported, so multi-device checks run in a fresh interpreter:
`run("test_collectives:gather_results", n)` calls that function with the mesh size n and
returns the dict of arrays it returned (saved as .npz). The parent compares them with the
reference, so a failure is reported by the test, not by the subprocess.

The subprocess gets `mk.kernels.collectives.interpret_devices(n)` = 2n devices (it says why: with
every device of the process in the mesh the kernel deadlocks, and `tp_mesh` refuses it).

Usage as a script (what `run` starts): python multidevice.py MODULE:FUNCTION N OUT.npz
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from mk.kernels.collectives import interpret_devices

TESTS = Path(__file__).resolve().parent


def run(target: str, n: int, *, timeout: float = 600) -> dict[str, np.ndarray]:
    """target(n) in a subprocess with 2n virtual CPU devices -> its dict of arrays."""
    flags = os.environ.get("XLA_FLAGS", "")
    count = interpret_devices(n)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={count}".strip())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.npz"
        done = subprocess.run([sys.executable, str(TESTS / "multidevice.py"), target,
                               str(n), str(out)], cwd=TESTS, env=env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{target}({n}) failed in its subprocess:\n"
                               f"{done.stderr[-6000:]}")
        with np.load(out) as data:
            return dict(data)


def _main(target: str, n: str, out: str):
    import importlib

    sys.path.insert(0, str(TESTS))
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(int(n))
    np.savez(out, **{k: np.asarray(v) for k, v in result.items()})


if __name__ == "__main__":
    _main(*sys.argv[1:])
