"""mk.kernels.jax_private is the one module that imports `jax._src`, and the version it names is
the jax pyproject.toml pins, so moving the pin means reading the private names again.

Not here: whether each private name still behaves as mk assumes (the tests of its users:
test_backend, test_bounds, test_exactness, test_tpu).
"""

import re
import tomllib
from pathlib import Path

from mk.kernels import jax_private

ROOT = Path(__file__).resolve().parents[1]


def test_the_private_names_are_written_for_the_pinned_jax():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mk"]["pins"]
    assert f"jax=={jax_private.WRITTEN_FOR}" in pins


def test_no_other_module_imports_jax_private_modules():
    importers = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "mk").rglob("*.py"))
                 if re.search(r"^\s*(from|import) jax\._src", p.read_text(), re.MULTILINE)]
    assert importers == ["mk/kernels/jax_private.py"]
