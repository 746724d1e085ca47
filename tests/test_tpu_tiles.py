"""benchmarks/tpu_tiles.py without a TPU: the per-tile timing runs in interpret mode into a
record named for no chip, every format's product equals the reference's, and a CPU is
refused a chip's record."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import tpu_tiles  # noqa: E402

from mk.measure import measure  # noqa: E402


def test_the_script_refuses_a_cpu_a_chips_record(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tpu_tiles.main([])
    assert "no TPU here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpu_tiles.main(["--interpret", "--json", str(tmp_path / "v5e-tiles.json")])
    with pytest.raises(ValueError, match=r"depths=\(3, 3\) must be"):
        tpu_tiles.time_tile("int8", tile=256, depths=(3, 3), repeats=1, backend="interpret")


@pytest.mark.parametrize("fmt", ["int8", "fp4"])
def test_a_tile_is_timed_and_its_product_is_the_references(tmp_path, fmt):
    path = tmp_path / "cpu-tiles.json"
    tpu_tiles.main(["--interpret", "--json", str(path), "--formats", fmt])
    record = json.loads(path.read_text())
    assert record["label"] == measure.INTERPRET_LABEL and record["chip"] is None
    row, = record["rows"]
    assert row["format"] == fmt and row["depths"] == list(tpu_tiles.INTERPRET["depths"])
    assert row["max_error"] < 1e-5 * row["scale"], row  # summation order only
    assert row["tile_bytes"] < 256 * 256 * 2  # packed: fewer bytes than bf16's


def test_the_reference_is_not_the_kernels_own_rounding():
    """Control: an int8 weight's values rounded to bf16 before the dot (not the codes and
    scales the kernel multiplies) miss the kernel's product by more than the bound."""
    import jax.numpy as jnp
    import numpy as np

    from mk.kernels import backend
    from mk.model import ops, quant
    from mk.kernels.common import BlockSizes
    from mk.kernels.weight_streaming import stream_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 512)), jnp.float32)
    q = quant.quantize_weight(rng.standard_normal((512, 256)).astype(np.float32), "int8")
    with backend.use("interpret"):
        got = np.asarray(stream_matmul(x, q, block=BlockSizes(slots=3, tile_rows=256,
                                                              tile_cols=256)))
    right = np.asarray(ops.matmul(x, tpu_tiles.reference_weight(q)))
    rounded = np.asarray(ops.matmul(x, tpu_tiles.reference_weight(q).astype(jnp.bfloat16)))
    bound = 1e-5 * np.abs(right).max()
    assert np.abs(got - right).max() < bound < np.abs(got - rounded).max()
