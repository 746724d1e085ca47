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
INCONCLUSIVE = ("inconclusive: the race detector missed the planted cross-device race in "
                "this run, so its silence on the kernels under test proves nothing")


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


def planted_race_caught(n: int) -> bool:
    """Call in the subprocess, after the checks it guards: the planted cross-device race
    (two all-gathers through ONE buffer slot, on n devices) under the race detector ->
    whether the detector flagged it. It misses now and then (tests/test_collectives.py
    says how often), so a run's "no race" counts only when this is True (`race_free`)."""
    import jax

    from mk.kernels import backend
    from mk.kernels import collectives

    x = np.random.default_rng(n).standard_normal((2 * n, 8, 256), np.float32)
    with backend.use("interpret", detect_races=True):
        jax.block_until_ready(collectives.all_gather(x, collectives.tp_mesh(n), slots=1))
        return backend.races_found()


def race_free(races, planted_caught) -> None:
    """The parent's verdict on a subprocess's race check: inconclusive (pytest.skip) when
    the planted race of the same run was missed, else fail if a race was found."""
    import pytest

    if not planted_caught:
        pytest.skip(INCONCLUSIVE)
    assert not races, "the race detector flagged a race"


def _main(target: str, n: str, out: str):
    import importlib

    sys.path.insert(0, str(TESTS))
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(int(n))
    np.savez(out, **{k: np.asarray(v) for k, v in result.items()})


if __name__ == "__main__":
    _main(*sys.argv[1:])
