"""benchmarks/tpu_notebooks.py and its record (tools/chip_record.py) without a TPU: the
record round-trips and a bad one is refused naming the field; a run in parts keeps the
earlier notebooks' rows of the same chip and versions; off a chip it refuses unless asked
for interpret mode, and never writes a chip's file then; a stopped notebook's process and
its kernel (a session of its own) both end; the course map says how each notebook went on
a chip, or that no chip has run it, with every record value escaped.

Not here: the notebooks on a chip (the script's own run there writes the record); one
notebook end to end through papermill in interpret mode is marked slow.
"""

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402
import chip_record  # noqa: E402
import run_notebooks  # noqa: E402
import tpu_notebooks  # noqa: E402

from mk.kernels import backend  # noqa: E402

XSS = "<script>alert(1)</script>"
MADE = dict(chip="v5e", device_kind="TPU v5 lite", jax="0.10.2", libtpu="0.0.42.1",
            commit="abc1234def", when="2026-12-07T09:00:00+00:00", label="ran on TPU v5 lite")


def _row(notebook="06_megakernel", status="ok", **extra):
    failed = status != "ok"
    return dict(notebook=notebook, status=status, seconds=12.5, cells_run=5 if failed else 9,
                cells=9, failing_cell=6 if failed else None,
                failing_line="out = run()" if failed else "", error="E: boom" if failed else "",
                timeout_s=540.0, commit="abc1234def", when="2026-12-07T09:00:00+00:00") | extra


def _record(*rows):
    return dict(MADE, rows=list(rows) or [_row()])


def test_a_record_round_trips_through_the_untrusted_reader(tmp_path):
    record = _record(_row(), _row("01_weight_streaming", "failed"))
    chip_record.write(tmp_path / "v5e-notebooks.json", record)
    assert chip_record.load(tmp_path / "v5e-notebooks.json") == record
    assert not (tmp_path / "v5e-notebooks.json.partial").exists()


@pytest.mark.parametrize("change, field", [
    (lambda r: r.pop("libtpu"), "the record has missing fields ['libtpu']"),
    (lambda r: r.update(extra=1), "unknown fields"),
    (lambda r: r.update(chip=5), ": chip=5 must be of type str or NoneType"),
    (lambda r: r["rows"][0].update(status="done"), "rows[0].status='done' must be one of"),
    (lambda r: r["rows"][0].update(seconds=float("nan")), "rows[0].seconds=nan"),
    (lambda r: r["rows"][0].update(cells_run=10), "rows[0]: cells_run=10 must be in"),
    (lambda r: r["rows"][0].update(cells_run=True), "rows[0].cells_run=True"),
    (lambda r: r["rows"][0].update(failing_cell=2), "rows[0].failing_cell=2 given for a"),
    (lambda r: r["rows"][0].update(notebook=XSS), "rows[0].notebook="),
    (lambda r: r["rows"].append(_row()), "rows[1].notebook='06_megakernel' must be"),
    (lambda r: r["rows"][0].update(error="x" * 601), "rows[0].error has 601 characters"),
    (lambda r: r.update(rows={}), ": rows={} must be of type list"),
])
def test_a_bad_record_is_refused_naming_the_field(tmp_path, change, field):
    record = _record()
    change(record)
    path = tmp_path / "v5e-notebooks.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError) as err:
        chip_record.load(path)
    assert field in str(err.value) and str(path) in str(err.value)


def test_a_record_that_is_not_json_or_too_deep_is_refused(tmp_path):
    path = tmp_path / "v5e-notebooks.json"
    for text in ("{", "[" * 100 + "]" * 100):
        path.write_text(text)
        with pytest.raises(ValueError, match="a notebooks record"):
            chip_record.load(path)


def _fake_run(monkeypatch, made, statuses):
    """main() with its provenance `made` and each notebook's row from `statuses`."""
    monkeypatch.setattr(tpu_notebooks.measure, "provenance_apart", lambda: dict(made))
    monkeypatch.setattr(run_notebooks, "check_kernel", lambda: None)
    monkeypatch.setattr(tpu_notebooks, "run_child", lambda run, executed, timeout: _row(
        run.notebook.stem, statuses[run.notebook.stem], timeout_s=timeout))


def _main(tmp_path, *notebooks):
    """main() on `notebooks` (names; a name starting with -- and what follows: options)."""
    names = [n for n in notebooks if n[0].isdigit() and "_" in n]
    options = [n for n in notebooks if n not in names]
    return tpu_notebooks.main([*(str(ROOT / "notebooks" / f"{n}.ipynb") for n in names),
                               *options, "--interpret", "--json",
                               str(tmp_path / "cpu-notebooks.json"),
                               "--out", str(tmp_path / "out")])


def test_a_run_in_parts_keeps_the_earlier_rows_of_the_same_chip_and_versions(
        tmp_path, monkeypatch):
    made = {k: v for k, v in MADE.items() if k != "label"} | dict(chip=None)
    statuses = {"00b_the_tpu": "ok", "01_weight_streaming": "failed"}
    _fake_run(monkeypatch, made, statuses)
    assert _main(tmp_path, "00b_the_tpu") == 0
    assert _main(tmp_path, "01_weight_streaming") == 1  # a failed notebook: exit 1
    record = chip_record.load(tmp_path / "cpu-notebooks.json")
    assert [r["notebook"] for r in record["rows"]] == ["00b_the_tpu", "01_weight_streaming"]
    assert record["label"] == "interpret mode, not a TPU"
    statuses["00b_the_tpu"] = "timeout"  # run again: its row is replaced, the other kept
    assert _main(tmp_path, "00b_the_tpu") == 1
    rows = chip_record.load(tmp_path / "cpu-notebooks.json")["rows"]
    assert [r["status"] for r in rows] == ["timeout", "failed"]
    _fake_run(monkeypatch, made | dict(jax="0.11.0"), statuses)  # other versions: not kept
    _main(tmp_path, "00b_the_tpu")
    rows = chip_record.load(tmp_path / "cpu-notebooks.json")["rows"]
    assert [r["notebook"] for r in rows] == ["00b_the_tpu"]


def test_the_same_command_again_runs_only_what_is_missing_within_its_budget(
        tmp_path, monkeypatch, capsys):
    made = {k: v for k, v in MADE.items() if k != "label"} | dict(chip=None)
    _fake_run(monkeypatch, made, {"00b_the_tpu": "ok", "01_weight_streaming": "failed",
                                  "02_attention_prologue": "ok"})
    run_child = tpu_notebooks.run_child
    monkeypatch.setattr(tpu_notebooks, "run_child", lambda *a: time.sleep(0.6) or run_child(*a))
    both = ("00b_the_tpu", "01_weight_streaming", "02_attention_prologue")
    _main(tmp_path, *both, "--budget", "1.5", "--timeout", "1")  # one fits
    assert "left: 01_weight_streaming 02_attention_prologue" in capsys.readouterr().out
    _main(tmp_path, *both, "--missing")
    assert "[1/2] 01_weight_streaming: running" in capsys.readouterr().out
    rows = chip_record.load(tmp_path / "cpu-notebooks.json")["rows"]
    assert [r["notebook"] for r in rows] == list(both)
    _fake_run(monkeypatch, made | dict(commit="next"), {})  # a new commit: all again
    monkeypatch.setattr(tpu_notebooks, "run_child", lambda *a: pytest.fail("ran"))
    _main(tmp_path, *both, "--missing", "--budget", "1", "--timeout", "2")
    assert "left: 00b_the_tpu 01_weight_streaming 02" in capsys.readouterr().out


@pytest.mark.skipif(backend.on_tpu(), reason="on a TPU main([]) would run every notebook")
def test_off_a_tpu_it_refuses_unless_interpret_mode_is_asked_for(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tpu_notebooks.main([])
    assert "no TPU here (cpu)" in capsys.readouterr().err
    for named in (tmp_path / "v5e-notebooks.json", chip_record.path_for("cpu")):
        with pytest.raises(SystemExit):
            tpu_notebooks.main(["--interpret", "--json", str(named)])
        assert "a path not named for a TPU and not under" in capsys.readouterr().err
    assert not chip_record.path_for("cpu").exists()


def test_the_cells_that_ran_and_the_failing_one_come_from_papermills_statuses(tmp_path):
    cells = [nbformat.v4.new_code_cell("a = 1"), nbformat.v4.new_code_cell("p = 2"),
             nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("b = a\nc"),
             nbformat.v4.new_code_cell("d")]
    cells[1].metadata["tags"] = ["injected-parameters"]
    for cell, status in zip(cells, ["completed", "completed", None, "failed", "pending"]):
        cell.metadata["papermill"] = {"status": status}
    executed = tmp_path / "x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), executed)
    assert tpu_notebooks.cells_row(tmp_path / "source.ipynb", executed) == dict(
        cells=3, cells_run=1, failing_cell=2, failing_line="b = a")


def test_a_stopped_notebook_ends_with_its_kernel_in_another_session():
    """The kernel jupyter_client starts runs in a session of its own: a signal to the
    runner's process group would miss it, and it would hold the chip."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True)\nprint(k.pid, flush=True)\ntime.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    kernel = int(child.stdout.readline())
    start = time.perf_counter()
    tpu_notebooks.stop(child)
    assert child.poll() is not None and not psutil.pid_exists(kernel) or (
        psutil.Process(kernel).status() == psutil.STATUS_ZOMBIE)
    assert time.perf_counter() - start < tpu_notebooks.GRACE_S


def test_the_map_says_how_each_notebook_went_on_a_chip_or_that_none_ran_it(tmp_path,
                                                                           monkeypatch):
    record = _record(_row(), _row("01_weight_streaming", "failed", error=f"E: {XSS}"))
    record["rows"][0]["commit"] = "6956f2f0678f"
    chip_record.write(tmp_path / "v5e-notebooks.json", record)
    bad = copy.deepcopy(record)
    bad["chip"] = f"v6e{XSS}"
    bad["rows"][0]["status"] = f'ok" onmouseover="{XSS}'
    (tmp_path / "v6e-notebooks.json").write_text(json.dumps(bad))
    monkeypatch.setattr(chip_record, "MEASURED", tmp_path)
    out = tmp_path / "site"
    out.mkdir()
    run_notebooks.write_site_index(out)
    index = (out / "index.html").read_text()
    assert "<script>alert" not in index and '" onmouseover' not in index
    assert 'ran on v5e, 2026-12-07, 6956f2f, <span class="ok">ok</span>' in index
    assert ('ran on v5e, 2026-12-07, abc1234, <span class="failed">failed</span> at cell 6 '
            "of 9: E: &#60;script&#62;") in index
    assert index.count(build_site.NOT_ON_A_CHIP) == len(build_site.load_course()[0][
        "notebooks"]) + len(build_site.load_course()[1]["notebooks"]) - 2
    assert "Unreadable chip record: v6e-notebooks.json" in index


def test_the_notebooks_read_the_committed_records_not_the_calls_output(monkeypatch,
                                                                       tmp_path):
    """MK_MEASURED names where this script's record goes (a chip call's $OUT); passed on,
    notebook 09 looked there for the steps record and failed on the chip."""
    monkeypatch.setenv("MK_MEASURED", str(tmp_path))
    seen = {}

    class Popen:
        def __init__(self, argv, **kwargs):
            seen.update(kwargs)
            raise OSError("stop here")

    monkeypatch.setattr(tpu_notebooks.subprocess, "Popen", Popen)
    run = run_notebooks.Run(notebook=ROOT / "notebooks" / "09_speculative_sweep.ipynb",
                            parameters={})
    with pytest.raises(OSError, match="stop here"):
        tpu_notebooks.run_child(run, tmp_path / "09.ipynb", 1.0)
    assert "MK_MEASURED" not in seen["env"] and seen["env"]["PATH"]


def test_the_committed_records_are_read_and_shown():
    """Whatever data/measured holds is a record the map can show."""
    records, refused = chip_record.load_all()
    assert not refused
    for record in records:
        for row in record["rows"]:
            assert build_site.chip_cell(row["notebook"], [record]).startswith(
                f"ran on {record['chip']}, ")


@pytest.mark.slow
def test_one_notebook_runs_through_papermill_in_interpret_mode(tmp_path):
    path = tmp_path / "cpu-notebooks.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu_notebooks.py"),
                           str(ROOT / "notebooks" / "00b_the_tpu.ipynb"), "--interpret",
                           "--json", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    row, = chip_record.load(path)["rows"]
    assert row["status"] == "ok" and row["cells_run"] == row["cells"] > 0


def _listed(words: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, (", ".join(words[:-1]), words[-1])))


def test_the_readme_says_what_the_committed_record_holds():
    """README's sentence on the notebooks' chip runs is the record's, count for count: each
    notebook's newest row, the commits and dates they ran at, the longest of them; a new
    run that changes the record changes the sentence."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    record = chip_record.load(ROOT / "data" / "measured" / "v5e-notebooks.json")
    newest = {}
    for row in sorted(record["rows"], key=lambda r: r["when"]):
        newest[row["notebook"]] = row
    rows = sorted(newest.values(), key=lambda r: r["when"])
    commits = list(dict.fromkeys(r["commit"][:7] for r in rows))
    dates = list(dict.fromkeys(r["when"][:10] for r in rows))
    ok = sum(r["status"] == "ok" for r in rows)
    notebooks = len(list((ROOT / "notebooks").glob("[0-9]*.py")))
    longest = max(rows, key=lambda r: r["seconds"])
    said = (f"Each notebook's newest run with its kernels on the chip (the map shows each): "
            f"{len(rows)} of the {notebooks} ran, {ok} ok, at {_listed(commits)} "
            f"({', '.join(dates)}), {longest['notebook'][:2]} the longest at "
            f"{longest['seconds']:.0f} s")
    assert said in text, said
