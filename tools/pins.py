"""Write requirements.txt, requirements-test.txt and environment.yml from pyproject.toml.

pyproject.toml is the one list of dependencies (core and the extras `notebooks`, `profile`,
`docs`, `test`). The three files here are generated from it for those who install with
`pip install -r` or conda/mamba; `--check` reports files that differ from what would be
written (tests/test_environment.py runs it) and exits 1.

Not here: resolving transitive dependencies (pip does; only the declared pins are listed).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_EXTRAS = ("notebooks", "profile", "docs")  # what `make run` needs
TEST_EXTRAS = ("test",)
HEADER = "# Generated from pyproject.toml by tools/pins.py: edit pyproject.toml, then run it.\n"


def _section(title: str, deps: list[str]) -> str:
    return f"# {title}\n" + "".join(f"{dep}\n" for dep in deps)


def render(pyproject: str) -> dict[str, str]:
    """{file name: text} of the generated files for the text of a pyproject.toml."""
    project = tomllib.loads(pyproject)["project"]
    extras = project.get("optional-dependencies", {})
    missing = [e for e in RUNTIME_EXTRAS + TEST_EXTRAS if e not in extras]
    if missing:
        raise ValueError(f"pyproject.toml: optional-dependencies lacks {missing}; "
                         f"it has {sorted(extras)}")
    runtime = HEADER + _section("core", project["dependencies"]) + "".join(
        _section(f"extra {name}", extras[name]) for name in RUNTIME_EXTRAS)
    test = HEADER + "-r requirements.txt\n" + "".join(
        _section(f"extra {name}", extras[name]) for name in TEST_EXTRAS)
    pip = project["dependencies"] + [d for e in RUNTIME_EXTRAS + TEST_EXTRAS for d in extras[e]]
    env = (HEADER + "# conda/mamba: `mamba env create -f environment.yml && mamba activate mk`.\n"
           "name: mk\nchannels:\n  - conda-forge\ndependencies:\n  - python=3.11\n  - pip\n"
           "  - pip:\n" + "".join(f"      - {dep}\n" for dep in pip) + "      - -e .\n")
    return {"requirements.txt": runtime, "requirements-test.txt": test,
            "environment.yml": env}


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
    if args.check:
        differ = stale()
        if differ:
            print(f"{differ} differ from pyproject.toml: run python tools/pins.py",
                  file=sys.stderr)
        return 1 if differ else 0
    for name, text in render((ROOT / "pyproject.toml").read_text(encoding="utf-8")).items():
        (ROOT / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
