"""Download the wheels a TPU machine lacks for mk's notebooks into `.whl-tpu/` (ignored), the
folder a chip session carries (issue 62).

The machine has Python 3.11 and jax, jaxlib and libtpu (with numpy, scipy, ml_dtypes and
opt_einsum) and nothing else. `ROOTS` is what mk and benchmarks/tpu_notebooks.py need
beyond that: mk's own dependencies, papermill, ipykernel, jupytext, nbformat, ipywidgets,
PyYAML and xprof (notebook 08). Their closure, at the versions this interpreter has
installed (`make`'s venv, built from constraints.txt, whose pins of the roots are
checked), less `LEFT_OUT` and with `ONLY`'s dependencies for xprof, is downloaded for Python
3.11 on manylinux x86_64, one wheel per package, no resolver: `pip download --no-deps`.

    .venv/bin/python tools/chip_wheels.py            # .whl-tpu/, about 52 MiB of wheels

On the chip, before anything else: `PIP_CONFIG_FILE=/dev/null python3 -m pip install
--isolated -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site
.whl-tpu/*.whl && export PYTHONPATH=/tmp/site:$PWD` (README's "On a TPU").
Not here: installing mk itself (the checkout travels), anything for the site (Sphinx).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".whl-tpu"
ROOTS = ("flatbuffers", "safetensors", "plotly", "ipython", "tqdm", "papermill", "ipykernel",
         "jupytext", "nbformat", "ipywidgets", "PyYAML", "xprof")
ON_CHIP = ("jax", "jaxlib", "libtpu", "numpy", "scipy", "ml-dtypes", "opt-einsum")
# Packages whose declared dependencies are replaced by what the notebooks import of them:
# notebook 08 reads its capture with `mk.measure.profiling.trace_viewer`, and
# `xprof.convert.raw_to_tool_data` imports with these two alone (tried in a clean folder);
# xprof's other 27 (duckdb, google-cloud-storage, cryptography, ...) serve its web UI.
ONLY = {"xprof": ("six", "protobuf")}
# Imported only when present, never in a headless run, and 10 MB together: ipykernel's
# debugger (debugpy), IPython's completion (jedi, and with it parso).
LEFT_OUT = ("debugpy", "jedi")
PLATFORM = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
CARRY_LIMIT = 64 * 2**20  # the checkout and every carried path together


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(roots=ROOTS, skip=ON_CHIP + LEFT_OUT) -> dict[str, str]:
    """{package: version} of `roots` and their dependencies on Linux Python 3.11 (`ONLY`'s
    instead of a package's own), as installed here, without `skip` (what the chip has,
    what a headless run never imports)."""
    marker_env = default_environment() | dict(python_version="3.11", sys_platform="linux",
                                              platform_system="Linux", extra="")
    found, todo = {}, list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in found or name in skip:
            continue
        found[name] = metadata.version(name)
        if name in ONLY:
            todo += ONLY[name]
            continue
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(marker_env):
                todo.append(requirement.name)
    return dict(sorted(found.items()))


def check_constraints(found: dict[str, str], constraints: Path = ROOT / "constraints.txt"
                      ) -> None:
    """Raise unless each pin of constraints.txt that `found` names has its version."""
    for line in constraints.read_text(encoding="utf-8").splitlines():
        name, sep, version = line.partition("#")[0].strip().partition("==")
        name = canonical(name.split("[")[0])
        if sep and name in found and found[name] != version:
            raise SystemExit(f"{name}=={found[name]} is installed here; constraints.txt pins "
                             f"{version}: rebuild the venv (make) first")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=DEST, help="folder of the wheels")
    p.add_argument("--list", action="store_true", help="print the pins, download nothing")
    args = p.parse_args(argv)
    found = pins()
    check_constraints(found)
    if args.list:
        print("\n".join(f"{n}=={v}" for n, v in found.items()))
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM,
                    "-d", str(args.dest), *(f"{n}=={v}" for n, v in found.items())],
                   check=True)
    wheels = {canonical(w.name.split("-")[0]): w for w in args.dest.glob("*.whl")}
    stale = sorted(n for n in wheels if n not in found)
    total = sum(w.stat().st_size for w in wheels.values())
    print(f"{len(found)} wheels, {total / 2**20:.1f} MiB in {args.dest}"
          + (f"; not in the set, remove them: {stale}" if stale else ""))
    return 1 if stale or total > CARRY_LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
