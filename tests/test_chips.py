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
from mk.measure import measure, tpu
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


# -- The bundle rate: a range with its sources ---------------------------------------------
CLOCK_PROBES = chips.DATA / "clock_probes.json"


def test_mxus_per_core_are_jaxs_tpu_info_counts():
    """A TensorCore's MXU count is the one JAX's Pallas TPU info has (and the
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


def test_each_tpu_bundle_rate_names_its_source():
    """A TPU row's rate is measured, derived or assumed, and its notes say which."""
    for spec in all_chips("tpu"):
        assert spec.bundle_rate_source in chips.RATE_SOURCES, spec.name
        assert f"Bundle rate {spec.bundle_rate_source}" in spec.notes, spec.name
    assert {c.name: c.bundle_rate_source for c in all_chips("tpu")} == {
        "v5e": "measured", "v6e": "assumed", "v5p": "assumed", "tpu7x": "derived"}


# The release's engineering report (Inferact/tpu-megakernels): TPU7x's MXU takes a
# 256 x 256 bf16 tile in 20 ns; its other figures allow at most 1.03 G bundles/s.
TPU7X_PUSH_S, TPU7X_FASTEST = 20e-9, 1.03e9


def test_tpu7x_ends_are_the_release_push_rate_over_our_bundles_per_tile():
    """The slow end: the bundles mk's compiled bf16 feed spends on one 256 x 256 tile at
    M 8 (18.6, the tile cost table) in the release's 20 ns; the fast end, the most the
    report's other figures allow (docs/design/mk.model.chips.md)."""
    from mk.cost import feed_costs
    spec = chip("tpu7x")
    per_tile = feed_costs.bundles_per_element("tpu7x", "bf16", 8) * 256 * 256
    assert per_tile == pytest.approx(18.6, abs=0.05)
    assert spec.bundle_rate("slow") == pytest.approx(per_tile / TPU7X_PUSH_S, rel=0.005)
    assert spec.bundle_rate("fast") == TPU7X_FASTEST
    assert spec.mxu_bundle_rate is None  # the push rate is the MXU's own


def test_assumed_rates_are_the_known_rates_over_the_probe_times_each_chips_probe():
    """v6e and v5p: each end is one of the two ratios of a known decode-loop rate to its
    chip's probe bound (TPU7x's slow end, derived; v5e's, measured) times the chip's own
    bound, and its MXU-bound rate v5e's measured ratio times it, each to 3 digits."""
    probes = {r["chip"]: r["clock_hz"] for r in json.loads(CLOCK_PROBES.read_text())}
    ratios = sorted(chip(c).bundle_rate("slow") / probes[c] for c in ("tpu7x", "v5e"))
    mxu_ratio = chip("v5e").mxu_bundle_rate / probes["v5e"]
    for name in ("v6e", "v5p"):
        spec = chip(name)
        assert (spec.bundle_rate("slow"), spec.bundle_rate("fast")) == pytest.approx(
            [r * probes[name] for r in ratios], rel=0.005), name
        assert spec.mxu_bundle_rate == pytest.approx(mxu_ratio * probes[name], rel=0.005), name


V5E_RECORD = measure.MEASURED / "v5e-bundles.json"  # benchmarks/tpu_bundle_time.py's


def test_v5e_rate_agrees_with_the_chips_record():
    """chips.csv's v5e rates are what the chip measured (data/measured/v5e-bundles.json),
    within 2 %: the decode loop's at both ends, the MXU-bound loop's at M from mxu_rows
    on; and neither measured loop ran its FLOPs past the datasheet's bf16 peak."""
    record = json.loads(V5E_RECORD.read_text())
    assert record["chip"] == "v5e", record["label"]
    spec, rows = chip("v5e"), {r["loop"]: r for r in record["rows"]}
    for loop, m in (("decode", 8), ("mxu", 512)):
        row = rows[loop]
        for end in chips.RATE_ENDS:
            assert spec.bundle_rate(end, m) == pytest.approx(row["bundles_per_s"],
                                                             rel=0.02), (loop, end)
        flops_per_s = 2 * row["m"] * row["k"] * row["n"] / (
            row["body_bundles"] * row["s_per_bundle"])
        assert flops_per_s < spec.bf16_flops, loop


def test_the_mxu_bound_rate_applies_from_mxu_rows_on_where_a_row_has_one():
    v5e, tpu7x = chip("v5e"), chip("tpu7x")
    assert v5e.bundle_rate(m=127) == v5e.bundle_rate_slow
    assert v5e.bundle_rate(m=128) == v5e.bundle_rate("fast", 512) == v5e.mxu_bundle_rate
    assert v5e.mxu_bundle_rate > v5e.bundle_rate_fast  # measured: its bundles stall less
    assert tpu7x.bundle_rate("fast", 512) == tpu7x.bundle_rate("fast")  # none: the decode's
    v6e = chip("v6e")
    assert v6e.bundle_rate("slow", 255) == v6e.bundle_rate_slow
    assert v6e.bundle_rate("slow", 256) == v6e.bundle_rate("fast", 256) == v6e.mxu_bundle_rate


def test_a_bundle_rate_missing_upside_down_or_not_positive_is_refused_naming_the_field():
    v6e = chip("v6e")
    with pytest.raises(ValueError, match=r"bundle_rate_slow=3000000000.0 is above "
                                         r"bundle_rate_fast=1660000000.0"):
        dataclasses.replace(v6e, bundle_rate_slow=3e9)
    with pytest.raises(ValueError, match=r"bundle_rate_slow=0.0 must be positive"):
        dataclasses.replace(v6e, bundle_rate_slow=0.0)
    with pytest.raises(ValueError, match=r"bundle_rate_fast=-1.0 must be positive"):
        dataclasses.replace(v6e, bundle_rate_fast=-1.0)
    with pytest.raises(ValueError, match=r"bundle_rate_slow=None must be positive"):
        dataclasses.replace(v6e, bundle_rate_slow=None)
    with pytest.raises(ValueError, match=r"mxu_bundle_rate=0.0 must be positive"):
        dataclasses.replace(v6e, mxu_bundle_rate=0.0)
    with pytest.raises(ValueError, match=r"chip h200: mxu_bundle_rate=1000000000.0 must be "
                                         "empty for a GPU"):
        dataclasses.replace(chip("h200"), mxu_bundle_rate=1e9)
    with pytest.raises(ValueError, match=r"bundle_rate_source='guessed' must be one of"):
        dataclasses.replace(v6e, bundle_rate_source="guessed")
    with pytest.raises(ValueError, match=r"chip h200: bundle_rate_fast=1000000000.0 must be "
                                         "positive for a TPU and empty for a GPU"):
        dataclasses.replace(chip("h200"), bundle_rate_fast=1e9)
    with pytest.raises(ValueError, match=r"mxus_per_core=2 must be positive for a TPU and "
                                         "empty for a GPU"):
        dataclasses.replace(chip("h200"), mxus_per_core=2)
    with pytest.raises(ValueError, match=r"end='low'"):
        v6e.bundle_rate("low")
    with pytest.raises(ValueError, match=r"m=0 must be a positive integer"):
        v6e.bundle_rate(m=0)
    with pytest.raises(ValueError, match="no bundle rate"):
        chip("h200").bundle_rate("slow")
    assert v6e.bundle_rate() == v6e.bundle_rate("slow") < v6e.bundle_rate("fast")


@pytest.mark.parametrize("field, value, message", [
    ("bundle_rate_slow", "", r"bundle_rate_slow=None must be positive for a TPU"),
    ("bundle_rate_fast", "900000000", r"bundle_rate_slow=1001000000.0 is above "
                                       r"bundle_rate_fast=900000000.0")])
def test_the_csv_refuses_a_tpu_row_without_a_rate_or_fast_under_slow(tmp_path, field, value,
                                                                     message):
    header, first = chips.CHIPS_CSV.read_text(encoding="utf-8").splitlines()[:2]
    names = header.split(",")
    cells = first.split(",")  # the v5e row: no comma before its quoted source
    cells[names.index(field)] = value
    path = tmp_path / "chips.csv"
    path.write_text(f"{header}\n{','.join(cells)}\n")
    with pytest.raises(ValueError, match=r"chips\.csv: row 1 \('v5e'\): ValueError .*"
                                         + message):
        chips.read_chips(path)


def test_spec_of_takes_a_name_or_a_spec_and_gives_the_spec():
    spec = chips.chip("v5e")
    assert chips.spec_of("v5e") is spec and chips.spec_of(spec) is spec
    with pytest.raises(ValueError, match="not known"):
        chips.spec_of("v99")
