"""Write constraints.txt, requirements.txt, requirements-test.txt and environment.yml from
pyproject.toml.

pyproject.toml is the one list of dependencies: the package's ranges (core and the extras
`notebooks`, `profile`, `docs`, `test`, and `colab`, which names `profile`) and the exact
versions tested, `[tool.mk].pins`. constraints.txt holds every pin (make and CI install
with `-c constraints.txt`, so the venv is exact while the wheel's ranges leave Colab's own
packages alone); the requirements files and environment.yml list the declared packages at
their pins for those who install with `pip install -r` or conda/mamba. `--check` reports
files that differ from what would be written, a declared package without a pin and a pin
outside its range (tests/test_environment.py runs it) and exits 1.

Not here: resolving transitive dependencies (pip does; only the declared packages are
pinned).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_EXTRAS = ("notebooks", "profile", "docs")  # what `make run` needs
TEST_EXTRAS = ("test",)
HEADER = "# Generated from pyproject.toml by tools/pins.py: edit pyproject.toml, then run it.\n"


def _declared(project: dict, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """The core requirements and those of `extras` (all extras if none), without the
    package's references to its own extras."""
    lists = [project["dependencies"]] + [
        deps for name, deps in project.get("optional-dependencies", {}).items()
        if not extras or name in extras]
    own = canonicalize_name(project["name"])
    return [Requirement(d) for deps in lists for d in deps
            if canonicalize_name(Requirement(d).name) != own]


def _pins(pyproject: dict) -> dict[str, Requirement]:
    return {canonicalize_name(Requirement(p).name): Requirement(p)
            for p in pyproject["tool"]["mk"]["pins"]}


def problems(pyproject_text: str) -> list[str]:
    """Declared packages without an exact pin, and pins outside their declared range."""
    pyproject = tomllib.loads(pyproject_text)
    pins, out = _pins(pyproject), []
    for pin in pins.values():
        specs = list(pin.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            out.append(f"pin {pin} is not one exact name==version")
    for req in _declared(pyproject["project"]):
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            out.append(f"{req} has no pin in [tool.mk].pins")
        elif not req.specifier.contains(next(iter(pin.specifier)).version, prereleases=True):
            out.append(f"pin {pin} lies outside the declared range {req}")
    return out


def _pinned(req: Requirement, pins: dict[str, Requirement]) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{pins[canonicalize_name(req.name)].specifier}"


def _section(title: str, reqs: list[Requirement], pins: dict) -> str:
    return f"# {title}\n" + "".join(f"{_pinned(r, pins)}\n" for r in reqs)


def render(pyproject_text: str) -> dict[str, str]:
    """{file name: text} of the generated files for the text of a pyproject.toml."""
    pyproject = tomllib.loads(pyproject_text)
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    missing = [e for e in RUNTIME_EXTRAS + TEST_EXTRAS if e not in extras]
    if missing:
        raise ValueError(f"pyproject.toml: optional-dependencies lacks {missing}; "
                         f"it has {sorted(extras)}")
    pins = _pins(pyproject)
    core = [Requirement(d) for d in project["dependencies"]]
    runtime = HEADER + _section("core", core, pins) + "".join(
        _section(f"extra {name}", _declared({**project, "dependencies": []}, (name,)), pins)
        for name in RUNTIME_EXTRAS)
    test = HEADER + "-r requirements.txt\n" + "".join(
        _section(f"extra {name}", _declared({**project, "dependencies": []}, (name,)), pins)
        for name in TEST_EXTRAS)
    pip = [_pinned(r, pins) for r in _declared(project, RUNTIME_EXTRAS + TEST_EXTRAS)]
    env = (HEADER + "# conda/mamba: `mamba env create -f environment.yml && mamba activate mk`.\n"
           "name: mk\nchannels:\n  - conda-forge\ndependencies:\n  - python=3.11\n  - pip\n"
           "  - pip:\n" + "".join(f"      - {dep}\n" for dep in pip) + "      - -e .\n")
    constraints = HEADER + "# pip install -c constraints.txt ...: the tested versions.\n" + "".join(
        f"{pin}\n" for pin in pyproject["tool"]["mk"]["pins"])
    return {"constraints.txt": constraints, "requirements.txt": runtime,
            "requirements-test.txt": test, "environment.yml": env}


def stale(root: Path = ROOT) -> list[str]:
    """The generated files under `root` whose text differs from what `render` writes."""
    wanted = render((root / "pyproject.toml").read_text(encoding="utf-8"))
    return [name for name, text in wanted.items()
            if not (root / name).exists()
            or (root / name).read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a file differs from pyproject.toml")
    args = parser.parse_args(argv)
    bad = problems((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for problem in bad:
        print(f"pyproject.toml: {problem}", file=sys.stderr)
    if args.check:
        differ = stale()
        if differ:
            print(f"{differ} differ from pyproject.toml: run python tools/pins.py",
                  file=sys.stderr)
        return 1 if differ or bad else 0
    if bad:
        return 1
    for name, text in render((ROOT / "pyproject.toml").read_text(encoding="utf-8")).items():
        (ROOT / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
