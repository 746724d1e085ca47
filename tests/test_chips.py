"""data/chips.csv and mk.model.chips: every row is complete and sourced, lookups fail loudly, and
the TPU rows agree with what libtpu itself reports for their topology names."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from mk.model import chips
from mk.measure import tpu
from mk.model.chips import CHIP_NAMES, ChipSpec, all_chips, chip

MIB, GIB = 1 << 20, 1 << 30


def test_chip_names_are_the_rows_of_the_csv_in_order():
    assert CHIP_NAMES == ("v5e", "v6e", "v5p", "tpu7x", "gb200", "h200")
    assert tuple(c.name for c in all_chips()) == CHIP_NAMES


def test_every_chip_row_names_its_source_document():
    for c in all_chips():
        assert c.source.strip(), f"{c.name} has no source"
        vendor = "Google Cloud TPU" if c.kind == "tpu" else "NVIDIA"
        assert vendor in c.source, f"{c.name}: source {c.source!r} is not a {vendor} document"


def test_lookup_returns_the_tpu7x_row():
    spec = chip("tpu7x")
    assert isinstance(spec, ChipSpec)
    assert (spec.kind, spec.cores_per_chip, spec.topology) == ("tpu", 2, "tpu7x:1x1x1")
    assert spec.hbm_bytes == 192 * GIB
    assert spec.bf16_flops == 2307e12 and spec.fp8_flops == 4614e12
    assert spec.hbm_bw == 7.38e12 and spec.ici_bw == 1.2e12


def test_unknown_chip_raises_naming_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"chip='v7x'.*'tpu7x'"):
        chip("v7x")


def test_all_chips_filters_by_kind_and_rejects_unknown_kinds():
    assert {c.name for c in all_chips("gpu")} == {"gb200", "h200"}
    assert {c.name for c in all_chips("tpu")} == {"v5e", "v6e", "v5p", "tpu7x"}
    with pytest.raises(ValueError, match="kind='npu'"):
        all_chips("npu")


def test_vmem_per_core_is_the_limit_the_compiler_enforces():
    # PLATFORM.md: v5e 128 MiB, v5p 64 MiB, v6e 128 MiB, TPU7x 64 MiB.
    expected = {"v5e": 128 * MIB, "v6e": 128 * MIB, "v5p": 64 * MIB, "tpu7x": 64 * MIB}
    assert {c.name: c.vmem_bytes for c in all_chips("tpu")} == expected


def test_gpus_have_no_vmem_and_no_topology():
    for c in all_chips("gpu"):
        assert c.vmem_bytes is None and c.topology == "" and c.cores_per_chip == 1


def test_chips_without_fp8_say_their_fp8_column_is_int8():
    for name in ("v5e", "v6e", "v5p"):
        assert "int8" in chip(name).notes
        assert chip(name).fp8_flops == 2 * chip(name).bf16_flops


def test_ridge_point_is_bf16_peak_over_hbm_bandwidth():
    spec = chip("v5e")
    assert spec.ridge_flop_per_byte == pytest.approx(197e12 / 819e9)


def test_spec_rejects_a_gpu_with_vmem_and_a_row_without_source():
    gpu = chip("h200")
    with pytest.raises(ValueError, match="vmem_bytes=1"):
        dataclasses.replace(gpu, vmem_bytes=1)
    with pytest.raises(ValueError, match="source is empty"):
        dataclasses.replace(gpu, source=" ")
    with pytest.raises(ValueError, match="hbm_bw=0"):
        dataclasses.replace(gpu, hbm_bw=0)


def test_duplicate_chip_names_in_a_csv_are_rejected(tmp_path):
    text = chips.CHIPS_CSV.read_text(encoding="utf-8")
    last = text.strip().splitlines()[-1]
    path = tmp_path / "chips.csv"
    path.write_text(text + last + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not unique"):
        chips.read_chips(path)


def test_a_chips_table_handed_in_is_read_with_limits_and_a_bad_row_named(tmp_path):
    """Issue 65: a pipe would block for ever, a word where a number belongs was a bare
    ValueError from int() naming no file or row."""
    header, first = chips.CHIPS_CSV.read_text(encoding="utf-8").splitlines()[:2]
    path, pipe = tmp_path / "chips.csv", tmp_path / "pipe.csv"
    row = dict(zip(header.split(","), first.split(",")))
    bad = first.replace(f",{row['hbm_bytes']},", ",fast,", 1)
    path.write_text(f"{header}\n{bad}\n")
    with pytest.raises(ValueError, match=r"chips\.csv: row 1 \('v5e'\): ValueError .*'fast'"):
        chips.read_chips(path)
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match=r"chips table '.*pipe\.csv' is a named pipe"):
        chips.read_chips(pipe)
    path.write_text(f"{header}\n{first}\n")
    assert list(chips.read_chips(path)) == ["v5e"]


@pytest.mark.parametrize("name", [c.name for c in all_chips("tpu")])
def test_topology_compiles_for_the_chip_and_has_cores_per_chip_devices_per_chip(name):
    # libtpu's ahead-of-time topology: each TensorCore that is a JAX device is one device
    # here, so devices / distinct chip coordinates must equal cores_per_chip.
    topologies = pytest.importorskip("jax.experimental.topologies")
    spec = chip(name)
    dims = spec.topology.split(":")[1].split("x")
    # A one-chip topology needs one-chip hosts; libtpu defaults to 2x2x1 hosts.
    extra = {"chips_per_host_bounds": [1, 1, 1]} if set(dims) == {"1"} else {}
    devices = topologies.get_topology_desc(topology_name=spec.topology, platform="tpu",
                                           **extra).devices
    n_chips = len({tuple(d.coords) for d in devices})
    assert len(devices) == n_chips * spec.cores_per_chip


def test_mxu_side_is_128_before_v6e_and_256_from_v6e_and_empty_on_gpus():
    assert {c.name: c.mxu_rows for c in all_chips()} == {
        "v5e": 128, "v5p": 128, "v6e": 256, "tpu7x": 256, "gb200": None, "h200": None}
    with pytest.raises(ValueError, match="mxu_rows=None"):
        dataclasses.replace(chip("v6e"), mxu_rows=None)
    with pytest.raises(ValueError, match="mxu_rows=128"):
        dataclasses.replace(chip("h200"), mxu_rows=128)


def test_hbm_compile_bytes_is_what_libtpu_says_one_core_holds():
    """The capacity check's HBM limit (`DecodePlan.fits`) is libtpu's: compiling an
    argument larger than a core's HBM makes the compiler name what it has available."""
    for spec in all_chips("tpu"):
        big = jax.ShapeDtypeStruct((spec.hbm_bytes // 4,), jnp.float32)  # a whole chip's
        report = tpu.compile_for_chip(lambda a: a * 2, [big], spec)
        available = re.search(r"available HBM \(([0-9.]+)G\)", report.error)
        assert not report.ok and available, report.error[:300]
        assert spec.hbm_compile_bytes / 2**30 == pytest.approx(float(available.group(1)),
                                                               abs=0.005), spec.name


# -- The clock: a range with its sources ---------------------------------------------------
CLOCK_PROBES = chips.DATA / "clock_probes.json"


def test_mxus_per_core_are_jaxs_tpu_info_counts():
    """The datasheet derivation's MXU count is the one JAX's Pallas TPU info has (and the
    dumps address: tests/test_bundles.py); TPU7x has 2, not the 4 once assumed."""
    from jax.experimental.pallas import tpu as pltpu
    version = {"v5e": "TPU_V5E", "v6e": "TPU_V6E", "v5p": "TPU_V5P", "tpu7x": "TPU_7X"}
    for spec in all_chips("tpu"):
        info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion[version[spec.name]], 1)
        assert (spec.mxus_per_core, spec.mxu_rows) == (info.num_mxus,
                                                       info.mxu_column_size), spec.name
    assert {c.name: c.tensorcores_per_chip for c in all_chips("tpu")} == {
        "v5e": 1, "v6e": 1, "v5p": 2, "tpu7x": 2}


def test_mxu_feeds_are_what_jaxs_tpu_info_says_bf16_multiplies_natively():
    """A chip takes fp8 weights beside bf16 activations exactly where JAX's Pallas TPU
    info says bf16 x float8_e4m3fn is native (TPU7x; v5e, v6e and v5p only bf16); a row
    claiming a feed its MXU lacks, or a GPU with feeds, is refused by name."""
    from jax.experimental.pallas import tpu as pltpu
    version = {"v5e": "TPU_V5E", "v6e": "TPU_V6E", "v5p": "TPU_V5P", "tpu7x": "TPU_7X"}
    for spec in all_chips("tpu"):
        info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion[version[spec.name]], 1)
        native = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
        assert spec.mxu_feeds == tuple(f for f, t in native.items()
                                       if info.is_matmul_supported(jnp.bfloat16, t)), spec.name
    assert chip("tpu7x").mxu_feeds == ("bf16", "fp8") and chip("v6e").mxu_feeds == ("bf16",)
    with pytest.raises(ValueError, match=r"chip v6e: mxu_feeds=\('bf16', 'int4'\)"):
        dataclasses.replace(chip("v6e"), mxu_feeds=("bf16", "int4"))
    with pytest.raises(ValueError, match=r"chip h200: mxu_feeds=\('bf16',\)"):
        dataclasses.replace(chip("h200"), mxu_feeds=("bf16",))


def test_each_tpu_clock_range_spans_the_datasheet_derivation_and_the_schedule_probe():
    """The two ends are the two sources the row's notes name, each at its end: the
    datasheet derivation (bf16 peak / (TensorCores x MXUs x rows^2 x 2)) and the clock
    libtpu's schedule of one bf16 matmul implies (data/clock_probes.json), to the MHz."""
    probes = {r["chip"]: r for r in json.loads(CLOCK_PROBES.read_text())}
    for spec in all_chips("tpu"):
        derived, probed = spec.datasheet_clock_hz, probes[spec.name]["clock_hz"]
        low, high = sorted((derived, probed))
        assert spec.clock("low") == pytest.approx(low, abs=0.5e6), spec.name
        assert spec.clock("high") == pytest.approx(high, abs=0.5e6), spec.name
        ends = {"low": low, "high": high}
        for end, value in ends.items():
            source = "derived" if value == derived else "libtpu's schedule"
            assert re.search(rf"{end.capitalize()} end {value / 1e9:.2f} GHz "
                             rf"(from )?{source}", spec.notes), (spec.name, end)
    assert chip("tpu7x").datasheet_clock_hz == pytest.approx(2307e12 / (2 * 2 * 256**2 * 2))


def test_a_clock_range_upside_down_or_not_positive_is_refused_naming_the_field():
    v6e = chip("v6e")
    with pytest.raises(ValueError,
                       match=r"clock_low_hz=4000000000.0 is above clock_high_hz=3502000000.0"):
        dataclasses.replace(v6e, clock_low_hz=4e9)
    with pytest.raises(ValueError, match=r"clock_low_hz=0.0 must be positive"):
        dataclasses.replace(v6e, clock_low_hz=0.0)
    with pytest.raises(ValueError, match=r"clock_high_hz=-1.0 must be positive"):
        dataclasses.replace(v6e, clock_high_hz=-1.0)
    with pytest.raises(ValueError, match=r"clock_low_hz=None must be positive"):
        dataclasses.replace(v6e, clock_low_hz=None)
    with pytest.raises(ValueError, match=r"mxus_per_core=2 must be positive for a TPU and "
                                         "empty for a GPU"):
        dataclasses.replace(chip("h200"), mxus_per_core=2)
    with pytest.raises(ValueError, match=r"end='mid'"):
        v6e.clock("mid")
    with pytest.raises(ValueError, match="no TensorCore clock"):
        chip("h200").clock("low")
    assert v6e.clock() == v6e.clock("low") < v6e.clock("high")


def test_spec_of_takes_a_name_or_a_spec_and_gives_the_spec():
    spec = chips.chip("v5e")
    assert chips.spec_of("v5e") is spec and chips.spec_of(spec) is spec
    with pytest.raises(ValueError, match="not known"):
        chips.spec_of("v99")
