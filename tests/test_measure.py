"""mk.measure.measure: the DMA probe runs in interpret mode and gives well-formed numbers, a record
round-trips through its JSON, a malformed file is refused naming the field, the simulator
takes its latency from a measured file (and keeps its defaults without one), and
interpret-mode timings are never written as a TPU's file.

What interpret mode does not cover: any TPU time (its times are the interpreter's); the
probe's lowering for real TPUs is checked by an ahead-of-time compile.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

import mk
from mk.measure import measure, tpu
from mk.cost import sim
from mk.kernels.dma_probe import dma_probe
from builders import simulated_step

# One worker probes once for every test here (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("measure")

# Three probe points (two sizes one at a time, one size two at a time), cheap on a CPU.
TINY = measure.Sweep(sizes=(4096, 8192), chunk=4096, in_flight=(1, 2), counts=(2, 34),
                     repeats=3)


@pytest.fixture(scope="module")
def record():
    return measure.measure("interpret", sweep=TINY, config=mk.preset("tiny"), context=100)


@pytest.fixture
def measured_dir(tmp_path, monkeypatch):
    """MEASURED in a temporary folder: no test touches the checkout's data/measured."""
    folder = tmp_path / "measured"
    monkeypatch.setattr(measure, "MEASURED", folder)
    return folder


def _as_hardware(record: measure.Measured, kind: str) -> measure.Measured:
    """A planted hardware record (a test's stand-in for a TPU run)."""
    return dataclasses.replace(record, mode="hardware", label=f"measured on {kind}",
                               device_kind=kind)


def test_probe_runs_in_interpret_mode_and_returns_well_formed_numbers(record):
    assert record.mode == "interpret" and record.chip is None
    assert record.label == measure.INTERPRET_LABEL == "interpret mode, not a TPU"
    assert record.device_kind == jax.devices()[0].device_kind
    assert [(p.bytes, p.in_flight) for p in record.dma] == [(4096, 1), (8192, 1), (4096, 2)]
    assert all(0 < p.seconds < 10 and p.bandwidth > 0 for p in record.dma)
    assert (record.counts, record.repeats) == (TINY.counts, TINY.repeats)
    step = record.step
    assert (step.model, step.batch, step.rows, step.context) == ("tiny", 1, 1, 100)
    assert 0 < step.seconds < 60


def test_probe_checks_that_its_data_landed_and_that_more_copies_take_longer(monkeypatch):
    with mk.kernels.backend.use("interpret"):
        # Control for the landing check: a probe that copies nothing is caught.
        monkeypatch.setattr(measure, "dma_probe", lambda src, count: jnp.zeros((8, 128)))
        with pytest.raises(RuntimeError, match="did not land"):
            measure.seconds_per_copy(4096, 1, TINY)
        # Control for the timing check: equal times for both counts are refused.
        monkeypatch.setattr(measure, "dma_probe", dma_probe)
        monkeypatch.setattr(measure, "median_seconds", lambda calls, repeats: {
            key: 1.0 for key in calls})
        with pytest.raises(RuntimeError, match="timing noise"):
            measure.seconds_per_copy(4096, 1, TINY)


def test_probe_compiles_for_every_tpu_ahead_of_time():
    src = jax.ShapeDtypeStruct((4, 2048, 128), jnp.float32)  # 1 MiB copies, 4 in flight
    count = jax.ShapeDtypeStruct((1,), jnp.int32)
    for chip in measure.TPU_NAMES:
        report = tpu.compile_for_chip(dma_probe, [src, count], chip, name="dma_probe")
        assert report.ok, report.error


def test_record_round_trips_through_json(record, tmp_path):
    path = measure.write(record, tmp_path / "cpu-run.json")
    assert measure.load(path) == record
    assert json.loads(path.read_text())["label"] == measure.INTERPRET_LABEL
    example = measure.example("tpu7x", dma_latency_s=1e-6)
    assert measure.load(measure.write(example, tmp_path / "example.json")) == example


def test_example_record_gives_back_its_latency_and_bandwidth_share():
    made = measure.example("v6e", dma_latency_s=2e-6, hbm_share=0.8)
    assert made.dma_latency_s == pytest.approx(2e-6, rel=1e-6)
    assert made.hbm_share(mk.chip("v6e")) == pytest.approx(0.8)
    # the same points read as another chip's are over that chip's datasheet bandwidth
    with pytest.raises(ValueError, match="must be in"):
        made.hbm_share(mk.chip("v5e"))


MALFORMED = [  # (change to a good file, words the error must contain)
    (lambda d: d.pop("dma"), "dma is missing"),
    (lambda d: d["dma"][1].update(seconds=-1.0), "dma[1].seconds=-1.0"),
    (lambda d: d["dma"][0].pop("in_flight"), "dma[0].in_flight is missing"),
    (lambda d: d["dma"][0].update(bytes=1000), "dma[0].bytes=1000"),
    (lambda d: d.update(mode="tpu"), "mode='tpu'"),
    (lambda d: d.update(schema=1), "schema=1"),
    (lambda d: d.pop("min_extra_bytes"), "min_extra_bytes is missing"),
    (lambda d: d.update(chip="v6e"), "chip='v6e'"),
    (lambda d: d.update(counts=[5, 5]), "counts=(5, 5)"),
    (lambda d: d.update(latency=1e-6), "latency is not a field"),
    (lambda d: d["step"].update(batch=0), "step.batch=0"),
    (lambda d: d.update(step="fast"), "step='fast' must be a JSON object"),
]


@pytest.mark.parametrize("change,words", MALFORMED, ids=[w for _, w in MALFORMED])
def test_malformed_file_is_refused_naming_the_field(record, tmp_path, change, words):
    good = record.to_dict()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(good))
    assert measure.load(path) == record  # control: the file before the change loads
    change(good)
    path.write_text(json.dumps(good))
    with pytest.raises(ValueError) as err:
        measure.load(path)
    assert str(path) in str(err.value) and words in str(err.value)


def test_a_copy_faster_than_the_datasheet_is_refused_as_noise(record):
    """What the v5e's default sweep gave on 2026-12-06 (0f38c60) with 512 extra copies: 256
    KiB copies 8 in flight at 39 ns each (6.7 TB/s on a chip of 819 GB/s). The control: the
    chip's own 4 MiB one-at-a-time point (669 GB/s) is accepted."""
    def on_v5e(*points):
        return dataclasses.replace(record, mode="hardware", label="measured on TPU v5 lite",
                                   device_kind="TPU v5 lite", chip="v5e", dma=points)
    honest = measure.DmaPoint(4 * 1024 ** 2, 1, 6.272e-6)
    assert on_v5e(honest).hbm_bw < mk.chip("v5e").device_hbm_bw
    with pytest.raises(ValueError, match=r"dma\[1\]: 262144 bytes, 8 in flight, moved 6714 "
                                         r"GB/s, over v5e's datasheet 819 GB/s"):
        on_v5e(honest, measure.DmaPoint(256 * 1024, 8, 3.9045e-8))


def test_the_full_sweep_moves_gigabytes_between_its_two_counts():
    full = measure.SWEEPS["full"]
    for nbytes, _ in full.points():
        low, high = full.counts_for(nbytes)
        assert (high - low) * nbytes >= full.min_extra_bytes == 4 * 1024 ** 3
    assert measure.SWEEPS["quick"].counts_for(4096) == measure.SWEEPS["quick"].counts


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    path = tmp_path / "v6e.json"
    path.write_text("{latency: 1}")
    with pytest.raises(ValueError, match="not JSON"):
        measure.load(path)
    path.unlink()
    os.mkfifo(path)  # read as a file, a pipe would block until a writer came
    with pytest.raises(ValueError, match=r"v6e\.json' is a named pipe"):
        measure.load(path)


def test_simulator_picks_up_a_measured_latency(measured_dir):
    config = mk.preset("tiny")
    assumed = sim.Assumptions.measured("v6e")  # no file yet: the defaults, unchanged
    assert assumed == sim.Assumptions() and assumed.source == "assumed"
    planted = _as_hardware(measure.example("v6e", dma_latency_s=10 * assumed.dma_latency_s),
                           "TPU v6 lite")
    assert measure.write(planted) == measured_dir / "v6e.json"
    taken = sim.Assumptions.measured("v6e")
    assert taken.dma_latency_s == pytest.approx(10 * assumed.dma_latency_s)
    assert taken.hbm_share == pytest.approx(1.0)
    assert taken.source.startswith("measured on TPU v6 lite")
    before = simulated_step(config, "v6e", assumptions=assumed)
    after = simulated_step(config, "v6e", assumptions=taken)
    assert after.step_s > 1.2 * before.step_s
    assert after.assumptions.source == taken.source
    # simulate without assumptions keeps the defaults: a file is used only when asked for
    assert simulated_step(config, "v6e").step_s == before.step_s
    # another chip without a file keeps the defaults; a file of the wrong chip is refused
    assert sim.Assumptions.measured("v5e") == sim.Assumptions()
    with pytest.raises(ValueError, match="chip='v6e' is not the simulated chip 'v5e'"):
        sim.Assumptions.measured("v5e", measured_dir / "v6e.json")


def test_interpret_results_are_never_written_as_a_tpus_file(record, measured_dir, tmp_path):
    with pytest.raises(ValueError, match="only a record measured on a TPU"):
        measure.write(record)
    for path in (measure.path_for("v6e"), measured_dir / "cpu.json",
                 tmp_path / "elsewhere" / "v6e.json"):  # the notebook's exercise is the first
        with pytest.raises(ValueError, match="never written"):
            measure.write(record, path)
    assert not measured_dir.exists() and not (tmp_path / "elsewhere").exists()
    # an example is never a TPU's file either, nor taken from one by the simulator
    example = measure.example("v6e", dma_latency_s=1e-6)
    with pytest.raises(ValueError, match="never written"):
        measure.write(example, measured_dir / "v6e.json")
    # nor is an interpret record read by the simulator, from any path
    kept = measure.write(record, tmp_path / "cpu-run.json")  # control: a path of its own
    with pytest.raises(ValueError, match="mode='interpret'"):
        sim.Assumptions.measured("v6e", kept)
    # a TPU's record goes to its own chip's file only
    planted = _as_hardware(measure.example("v5e", dma_latency_s=1e-6), "TPU v5 lite")
    with pytest.raises(ValueError, match="not to another chip's file"):
        measure.write(planted, measured_dir / "v6e.json")
    assert measure.write(planted) == measured_dir / "v5e.json"


def test_device_kinds_name_chips_of_the_csv():
    assert set(measure.DEVICE_KINDS.values()) <= set(measure.TPU_NAMES)
    assert measure.chip_of("TPU v6 lite") == "v6e"
    with pytest.raises(ValueError, match="device_kind='cpu'"):
        measure.chip_of("cpu")


@pytest.mark.parametrize("change,words", [
    (dict(sizes=(4096, 5000)), "Sweep.sizes[...]=5000 must be a multiple of 4096"),
    (dict(chunk=0), "Sweep.chunk=0 must be an integer >= 4096"),
    (dict(in_flight=(1, 0)), "Sweep.in_flight[...]=0 must be an integer >= 1"),
    (dict(counts=(8, 8)), "Sweep.counts=(8, 8) must be two integers"),
    (dict(repeats=0), "Sweep.repeats=0 must be an integer >= 1"),
    (dict(sizes=()), "Sweep.sizes is empty"),
])
def test_a_bad_sweep_is_refused_naming_the_field(change, words):
    dataclasses.replace(TINY)  # control: the sweep the tests use is valid
    with pytest.raises(ValueError) as err:
        dataclasses.replace(TINY, **change)
    assert words in str(err.value)


def test_provenance_asked_of_another_process_is_this_ones():
    """The scripts that must leave the chip free ask a fresh process (`provenance_apart`):
    the same chip, versions and commit as this process's own."""
    here, apart = measure.provenance(), measure.provenance_apart()
    assert {k: apart[k] for k in here if k != "when"} == {k: here[k] for k in here
                                                          if k != "when"}


def test_a_benchmarks_record_is_labelled_for_its_machine_or_refused(tmp_path):
    """`measure.labelled`, every TPU benchmark's one gate: interpret mode only into a
    --json path neither named for a TPU nor under data/measured; a TPU's record labelled
    with its device; a CPU without --interpret refused."""
    cpu = dict(chip=None, device_kind="cpu")
    assert measure.labelled(cpu, interpret=True, json_path=tmp_path / "cpu-steps.json")[
        "label"] == measure.INTERPRET_LABEL
    for path in (None, tmp_path / "v5e-steps.json", measure.MEASURED / "cpu-steps.json"):
        with pytest.raises(ValueError, match="--interpret needs --json, a path not named"):
            measure.labelled(cpu, interpret=True, json_path=path)
    with pytest.raises(ValueError, match=r"no TPU here \(cpu\)"):
        measure.labelled(cpu, interpret=False, json_path=None)
    tpu = dict(chip="v5e", device_kind="TPU v5 lite")
    assert measure.labelled(tpu, interpret=False, json_path=None, verb="ran")[
        "label"] == "ran on TPU v5 lite"
