"""mk.measure.profiling: bubble arithmetic with known answers, real CPU captures, XProf's converter,
variant (b) against the reference, and the TPU compiler's schedule dumps.

Not covered here (no TPU): device planes (`/device:TPU:0`) of a real TPU trace and the
in-kernel phase markers in a profile; the static dumps stand in for the latter.
"""

import dataclasses
import json
import os
from pathlib import Path
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
import mk.kernels.backend
import mk.cost.sim
from mk.cost import calibration
from mk import profile_plots
from mk.measure import profiling
from mk.model import reference
from mk.measure.measure import MEASURED
from mk.measure.profiling import OpEvent, Step, Timeline
from builders import simulated_step

# One worker makes the real captures once for every test here (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("profiling")

# -- Bubble arithmetic on synthetic timelines -----------------------------------------------


def op(name, line, start, end, module="m1", run_id=1):
    return OpEvent(name, module, run_id, line, float(start), float(end - start), 0)


SYNTHETIC = Timeline("/host:CPU", (Step(0, 0.0, 100.0),), (
    op("a", "A", 10, 30),  # line A: a holds b
    op("b", "A", 15, 20),
    op("c", "A", 50, 60),
    op("d", "B", 25, 40),  # line B overlaps line A
    op("e", "B", 70, 90, module="m2", run_id=2),  # a second program
    op("f", "C", 52, 55, module="jit_add", run_id=3),  # a program run inside m1's run
))


def test_union_merges_overlapping_and_touching_intervals():
    assert profiling.union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7),
                                                                         (9, 9)]


def test_bubbles_of_overlapping_lines_nested_events_and_step_edges():
    b, = profiling.bubbles(SYNTHETIC)
    # union of busy: [10, 40] + [50, 60] + [70, 90] = 60; span 10..90 = 80
    assert (b.wall_ns, b.span_ns, b.busy_ns, b.idle_ns, b.host_ns) == (100, 80, 60, 20, 20)
    assert b.idle == ((40, 50), (60, 70))
    assert b.bubble_share == pytest.approx(0.4) and b.idle_share == pytest.approx(0.25)
    assert (b.ops, b.launches) == (6, 2)  # jit_add runs inside m1: not a launch of its own


def test_self_time_subtracts_nested_events_on_the_same_line_only():
    selfs = profiling.self_times(SYNTHETIC.ops)
    assert selfs == {"a": 15, "b": 5, "c": 10, "d": 15, "e": 20, "f": 3}
    b, = profiling.bubbles(SYNTHETIC)
    assert b.op_share["a"] == pytest.approx(15 / 68) and sum(b.op_share.values()) == (
        pytest.approx(1.0))


def test_a_step_without_ops_is_all_host_gap_and_ops_outside_steps_are_dropped():
    tl = Timeline("/host:CPU", (Step(0, 0.0, 10.0), Step(1, 10.0, 30.0)),
                  (OpEvent("x", "m", 1, "A", 2.0, 3.0, 0),
                   OpEvent("y", "m", 2, "A", 40.0, 1.0, -1)))
    first, empty = profiling.bubbles(tl)
    assert (first.span_ns, first.host_ns, first.bubble_share) == (3, 7, pytest.approx(0.7))
    assert (empty.ops, empty.host_ns, empty.bubble_share) == (0, 20, 1.0)
    row = profiling.summary([empty, first], "v")  # the median step is the shorter one
    assert (row["steps"], row["bubble_share"], row["ops_per_step"]) == (2, 0.7, 0.5)
    slow = dataclasses.replace(empty, wall_ns=30.0)
    assert profiling.summary([first, empty, slow])["bubble_share"] == 1.0


def test_summary_of_no_steps_is_an_error():
    with pytest.raises(ValueError, match="no steps"):
        profiling.summary([])


def test_figures_draw_the_bubbles_where_they_are():
    b = profiling.bubbles(SYNTHETIC)
    fig = profile_plots.gantt(SYNTHETIC, b)
    idle, = [t for t in fig.data if t.name and t.name.startswith("idle")]
    host, = [t for t in fig.data if t.name == "host gap"]
    assert list(idle.base) == [0.04, 0.06] and list(idle.x) == pytest.approx([0.01, 0.01])
    assert list(host.base) == [0.0, 0.09] and list(host.x) == pytest.approx([0.01, 0.01])
    assert {t.y[0] for t in fig.data if t.y} == {"A", "B", "C", "bubbles"}
    bars = profile_plots.share_bars([profiling.summary(b, "v")])
    assert sum(t.y[0] for t in bars.data) == pytest.approx(0.4)


# A TPU trace in XProf's layout, written by hand (no TPU here): the host plane holds the
# step, the device plane its programs ("XLA Modules") and kernels ("XLA Ops"); times in ps.
TPU_XSPACE = """
planes { id: 1 name: "/host:CPU"
  lines { id: 1 name: "python" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 100000000
             stats { metadata_id: 1 int64_value: 0 } } }
  event_metadata { key: 1 value { id: 1 name: "decode" } }
  stat_metadata { key: 1 value { id: 1 name: "step_num" } } }
planes { id: 2 name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 10000000 duration_ps: 30000000 }
    events { metadata_id: 2 offset_ps: 50000000 duration_ps: 40000000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 10000000 duration_ps: 10000000 }
    events { metadata_id: 4 offset_ps: 25000000 duration_ps: 15000000 }
    events { metadata_id: 5 offset_ps: 50000000 duration_ps: 40000000 } }
  event_metadata { key: 1 value { id: 1 name: "jit_a" } }
  event_metadata { key: 2 value { id: 2 name: "jit_b" } }
  event_metadata { key: 3 value { id: 3 name: "%fusion.1 = f32[1,1024]{1,0} fusion(%p)" } }
  event_metadata { key: 4 value { id: 4 name: "%fusion.2 = f32[8]{0} fusion(%fusion.1)" } }
  event_metadata { key: 5 value { id: 5 name: "%mk_megakernel.1 = (f32[1,8]) custom-call(%x)" } } }
"""  # a v5e names a TPU op event by its instruction's whole HLO text


def test_a_tpu_device_plane_is_read_from_its_xla_ops_line(tmp_path):
    path = tmp_path / "vm.xplane.pb"
    path.write_bytes(jax.profiler.ProfileData.text_proto_to_serialized_xspace(TPU_XSPACE))
    tl = profiling.timeline(path)
    assert tl.plane == "/device:TPU:0"
    assert [(o.name, o.module, o.step) for o in tl.ops] == [
        ("fusion.1", "jit_a", 0), ("fusion.2", "jit_a", 0), ("mk_megakernel.1", "jit_b", 0)]
    b, = profiling.bubbles(tl)
    # step 0..100 us; kernels 10-20, 25-40, 50-90 us
    assert (b.wall_ns, b.span_ns, b.busy_ns, b.idle_ns, b.host_ns) == (1e5, 8e4, 6.5e4, 1.5e4,
                                                                      2e4)
    assert (b.ops, b.launches) == (3, 2)
    assert b.op_share["mk_megakernel.1"] == pytest.approx(40 / 65)


# -- A recorded chip trace --------------------------------------------------------------------
MADE = dict(chip="v5e", device_kind="TPU v5 lite", jax="0", libtpu="0", commit="c", when="w",
            model="tiny")


def _record(tmp_path, record) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(record))
    return path


def test_a_trace_record_keeps_the_median_step_and_reads_back_as_it(tmp_path):
    steps = (Step(0, 0.0, 100.0), Step(1, 100.0, 300.0), Step(2, 300.0, 420.0))
    shifted = tuple(dataclasses.replace(o, start_ns=o.start_ns + 300, step=2)
                    for o in SYNTHETIC.ops)  # the median step (120 ns) holds SYNTHETIC's ops
    tl = Timeline("/device:TPU:0", steps, (op("x", "A", 10, 20),) + shifted)
    record = MADE | profiling.trace_record({v: tl for v in profiling.VARIANTS})
    back = profiling.recorded_timeline(profiling.load_trace_record(_record(tmp_path, record)),
                                       "staged")
    assert back.steps == (Step(0, 0.0, 120.0),) and len(back.ops) == len(SYNTHETIC.ops)
    assert {(o.name, o.line, o.start_ns) for o in back.ops} == {
        (o.name, o.line, o.start_ns) for o in SYNTHETIC.ops}
    b, = profiling.bubbles(back)
    assert (b.busy_ns, b.idle_ns, b.host_ns, b.launches) == (60, 20, 40, 2)
    assert record["variants"]["xla"]["summary"]["median_step"] == 2


@pytest.mark.parametrize("change, match", [
    (lambda r: r.pop("commit"), "field 'commit' is missing"),
    (lambda r: r["variants"].pop("megakernel"), "variant 'megakernel' is missing"),
    (lambda r: r["variants"]["xla"].pop("wall_ns"), "lacks field 'wall_ns'"),
    (lambda r: r["variants"]["xla"]["ops"].append([99, 0, 1, 0, 5, 5]),
     r"event \[99, .*\(6 names"),
    (lambda r: r["variants"]["xla"]["ops"].append([0, 0, 1, 0, 500, 5]), "inside its step"),
    (lambda r: r["variants"]["xla"]["ops"].append([0, 0, 1, 0, 5]), r"\[name, module"),
])
def test_a_bad_trace_record_is_refused_naming_what_is_wrong(tmp_path, change, match):
    record = MADE | profiling.trace_record({v: SYNTHETIC for v in profiling.VARIANTS})
    profiling.load_trace_record(_record(tmp_path, record))  # the control: this one reads
    change(record)
    with pytest.raises(ValueError, match=match):
        profiling.load_trace_record(_record(tmp_path, record))


def test_a_profile_that_is_a_pipe_or_no_xspace_is_refused_naming_it(tmp_path):
    """Issue 65: a named pipe blocked the reader for ever; bytes that are no XSpace were a
    bare RuntimeError naming no file."""
    pipe, junk = tmp_path / "pipe.xplane.pb", tmp_path / "junk.xplane.pb"
    os.mkfifo(pipe)
    junk.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"profile '.*pipe\.xplane\.pb' is a named pipe"):
        profiling.timeline(pipe)
    with pytest.raises(ValueError, match=r"profile '.*junk\.xplane\.pb' is not an XSpace"):
        profiling.timeline(junk)


def test_the_committed_chip_trace_is_a_v5e_s_and_its_summaries_are_its_events():
    """data/measured/v5e-trace.json (benchmarks/tpu_trace.py on the lent v5e): each
    variant's median step, measured again from its events, gives the summary recorded with
    it; the megakernel is one launch holding one mk_megakernel op."""
    record = profiling.load_trace_record(MEASURED / "v5e-trace.json")
    assert (record["chip"], record["model"]) == ("v5e", "qwen3-0.6b")
    for name in profiling.VARIANTS:
        kept = record["variants"][name]["summary"]
        again = profiling.summary(profiling.bubbles(profiling.recorded_timeline(record, name)),
                                  name)
        for field in ("wall_ms", "idle_share", "host_share", "bubble_share"):
            assert again[field] == kept[field], (name, field)
    mega = profiling.recorded_timeline(record, "megakernel")
    assert profiling.bubbles(mega)[0].launches == 1
    assert sum(o.name.startswith("mk_megakernel") for o in mega.ops) == 1


def test_the_simulator_steps_the_chips_traced_kernel_and_its_layers_within_tolerance():
    """The v5e trace's megakernel (its phases traced, `mk.cost.bundles.PHASE_FLAG`) against
    `mk.cost.sim` calibrated on the v5e, same model, B, T and position: the kernel op's time and
    each layer's but the first (whose wait for the ring's first tiles the trace counts in
    it and the simulator before it) within `mk.cost.calibration.TOLERANCE`."""
    record = profiling.load_trace_record(MEASURED / "v5e-trace.json")
    mega = profiling.recorded_timeline(record, "megakernel")
    kernel, = (o for o in mega.ops if o.name.startswith("mk_megakernel"))
    sim = simulated_step(mk.preset(record["model"]), record["chip"], batch=record["batch"],
                         rows=record["rows"], context=record["position"],
                         assumptions=calibration.assumptions(record["chip"]))
    assert sim.step_s * 1e9 == pytest.approx(kernel.duration_ns, rel=calibration.TOLERANCE)
    measured, simulated = profiling.layer_times(mega), sim.layer_seconds()
    assert len(measured) == len(simulated) == mk.preset(record["model"]).layers
    for i, (m, s_) in enumerate(zip(measured[1:], simulated[1:]), 1):
        assert s_ * 1e9 == pytest.approx(m, rel=calibration.TOLERANCE), i
    scopes = {r["scope"]: r for r in profiling.scope_table(mega)}
    assert scopes["prologue"]["count"] == scopes["mlp"]["count"] == len(measured)


def test_layer_times_split_the_loop_where_its_first_phase_opens_again():
    def scope(name, start, end):
        return op(name, "XLA TraceMe", start * 1000, end * 1000)  # µs

    tl = Timeline("/device:TPU:0", (Step(0, 0.0, 2e5),), (), (
        scope("prime", 0, 5), scope("layers", 10, 100),
        scope("prologue", 10, 20), scope("mlp", 20, 50),
        scope("prologue", 55, 60), scope("mlp", 60, 95), scope("lm_head", 100, 150)))
    assert profiling.layer_times(tl) == [45000, 45000]  # ns
    assert [(r["scope"], r["count"], r["total_us"]) for r in profiling.scope_table(tl)] == [
        ("prime", 1, 5), ("layers", 1, 90), ("prologue", 2, 15), ("mlp", 2, 65),
        ("lm_head", 1, 50)]
    assert profiling.layer_times(dataclasses.replace(tl, scopes=())) == []


# -- Real captures on the CPU ---------------------------------------------------------------
@pytest.fixture(scope="module")
def xla_capture(tmp_path_factory):
    """Three annotated steps of the XLA reference decode step (tiny), and its program."""
    config = mk.preset("tiny")
    params = mk.init_params(config, seed=0)
    cache = reference.init_cache(config, 1, 256)
    tokens, positions = jnp.array([[3]], jnp.int32), jnp.array([5], jnp.int32)
    cap = profiling.capture(lambda: reference.decode_step(config, params, cache, tokens,
                                                          positions),
                            steps=3, logdir=tmp_path_factory.mktemp("profiles"), name="xla")
    hlo = reference.forward.lower(config, params, cache, tokens, positions).compile()
    return cap, hlo.as_text()


def _executed_instructions(hlo_text: str) -> int:
    """Instructions of the entry computation that run as ops (XLA:CPU thunks)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    opcodes = re.findall(r"=\s*\S+\s+([a-z][a-z0-9-]*)\(", entry)
    return sum(o not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
               for o in opcodes)


def test_capture_has_the_standard_layout(xla_capture):
    cap, _ = xla_capture
    assert cap.path.name.endswith(".xplane.pb")
    assert cap.path.parent.parent.name == "profile" and cap.path.parent.name == cap.run
    assert cap.path.parent.parent.parent.name == "plugins"


def test_each_step_runs_every_op_of_the_compiled_program_once(xla_capture):
    cap, hlo = xla_capture
    tl = profiling.timeline(cap.path)
    per_step = profiling.bubbles(tl)
    want = _executed_instructions(hlo)
    assert want > 50  # the reference step is many ops
    assert [s.ops for s in per_step] == [want] * 3
    assert [s.launches for s in per_step] == [1] * 3
    for s in per_step:
        assert 0 <= s.idle_ns < s.span_ns <= s.wall_ns and 0 <= s.bubble_share < 1


def test_trace_viewer_converts_the_capture(xla_capture):
    cap, _ = xla_capture
    trace = profiling.trace_viewer(cap.path)
    names = {e.get("name") for e in trace["traceEvents"]}
    ops = {o.name for o in profiling.timeline(cap.path).ops}
    assert ops and ops <= names


def test_a_capture_never_overwrites_an_earlier_one(tmp_path):
    x = jnp.ones(8)
    runs = {profiling.capture(jnp.sin, x, steps=1, warmup=0, logdir=tmp_path, name="same").run
            for _ in range(2)}
    assert len(runs) == 2
    assert len(list((tmp_path / "same" / "plugins" / "profile").iterdir())) == 2


@pytest.mark.parametrize("kwargs, field", [(dict(steps=0), "steps"), (dict(warmup=-1), "warmup"),
                                           (dict(name="../x"), "name")])
def test_bad_capture_arguments_are_named(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        profiling.capture(jnp.sin, jnp.ones(2), logdir=tmp_path, **kwargs)


@pytest.mark.parametrize("tied", [False, True])
def test_staged_step_is_one_launch_per_op_and_matches_the_reference(tmp_path, tied):
    """A tied model's lm_head (the embedding transposed) is laid out once, not launched
    in every step (a v5e trace of qwen3-0.6b counted 2 + 4 L + 1)."""
    config = dataclasses.replace(mk.preset("tiny"), tie_embeddings=tied)
    params = mk.init_params(config, seed=0)
    prompt = jax.random.randint(jax.random.key(0), (1, 5), 0, config.vocab)
    _, cache = reference.prefill(config, params, prompt, max_context=256)
    tokens, positions = jnp.array([[7]], jnp.int32), jnp.array([5], jnp.int32)
    want, want_cache = reference.decode_step(config, params, cache, tokens, positions)
    step = profiling.variants(config, params, cache, tokens, positions)["staged"]
    with mk.kernels.backend.use("interpret"):
        got, got_cache = step()  # also the warm-up: every op compiles here
        cap = profiling.capture(step, steps=1, warmup=0, logdir=tmp_path, name="staged")
    b, = profiling.bubbles(profiling.timeline(cap.path))
    assert b.launches == 2 + 4 * config.layers  # embed, 4 ops per layer, lm_head
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * scale)
    np.testing.assert_array_equal(reference.greedy(got), reference.greedy(want))
    np.testing.assert_allclose(got_cache.k.astype(jnp.float32),
                               want_cache.k.astype(jnp.float32), rtol=2e-2, atol=3e-2)


def test_xprof_fallback_line_is_dropped_and_other_stderr_lines_stay(capfd):
    """The C++ ERROR line xprof prints on every conversion goes; a real error (the control,
    written the same way, to file descriptor 2) still reaches stderr."""
    with profiling.benign_stderr_dropped(profiling.XPROF_FALLBACK):
        os.write(2, b"E0000 xprof: No UnifiedProfileProcessor registered for trace_viewer\n")
        os.write(2, b"E0001 a real failure\n")
    err = capfd.readouterr().err
    assert "UnifiedProfileProcessor" not in err
    assert "E0001 a real failure" in err


# -- Where captures go ------------------------------------------------------------------------
def _tree(root, *files):
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def test_captures_go_to_mk_profiles_else_the_checkouts_profiles_else_the_working_directory(
        tmp_path, monkeypatch):
    checkout = _tree(tmp_path / "checkout", "pyproject.toml", "profiles/README.md",
                     "mk/measure/profiling.py")
    installed = _tree(tmp_path / "site-packages", "mk/measure/profiling.py")
    elsewhere = tmp_path / "notebooks"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # e.g. a notebook's folder
    rule = profiling.profiles_dir
    assert rule({}, checkout / "mk" / "measure" / "profiling.py") == checkout / "profiles"
    assert rule({}, installed / "mk" / "measure" / "profiling.py") == elsewhere / "profiles"
    assert rule({"MK_PROFILES": "here"}, checkout / "mk" / "measure" /
                "profiling.py") == elsewhere / "here"
    assert rule({"MK_PROFILES": ""}, checkout / "mk" / "measure" /
                "profiling.py") == checkout / "profiles"
    # a folder with a pyproject.toml but no profiles/README.md is not this checkout
    other = _tree(tmp_path / "other", "pyproject.toml", "mk/measure/profiling.py")
    assert rule({}, other / "mk" / "measure" / "profiling.py") == elsewhere / "profiles"
    # this checkout, as the tests import it
    assert rule({}) == Path(profiling.__file__).resolve().parents[2] / "profiles"


@pytest.mark.slow  # 47-86 s on the shared 2 cores; the rule's unit test above runs in CI
def test_notebook_08_run_by_papermill_in_notebooks_writes_under_the_top_level_profiles(
        tmp_path):
    """A copy of the checkout (what the notebook reads), notebook 08 run the way Jupyter and
    papermill run it: working directory notebooks/, no MK_PROFILES."""
    import shutil
    import subprocess
    import sys

    root = Path(profiling.__file__).resolve().parents[2]
    copy = tmp_path / "checkout"
    for folder in ("mk", "data"):
        shutil.copytree(root / folder, copy / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "profiles/README.md",
                 "notebooks/08_profile_bubbles.ipynb"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, copy / name)
    env = {k: v for k, v in os.environ.items() if k not in ("MK_PROFILES", "PYTHONPATH")}
    env.update(PYTHONPATH=str(copy), JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    subprocess.run([sys.executable, "-m", "papermill", "--cwd", "notebooks",
                    "notebooks/08_profile_bubbles.ipynb", str(tmp_path / "out.ipynb"),
                    "-p", "steps", "1", "-p", "preset", "tiny"], cwd=copy, env=env,
                   check=True, capture_output=True)
    captured = sorted(p.relative_to(copy) for p in copy.rglob("*.xplane.pb"))
    assert captured and all(p.parts[0] == "profiles" for p in captured), captured
    assert not (copy / "notebooks" / "profiles").exists()
