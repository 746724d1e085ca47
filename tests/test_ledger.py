"""mk.cost.ledger: every published row against the floors, the modelled and the conventional step
under one set of assumptions, in one vocabulary."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mk
from mk.cost import ledger, perf
from mk.kernels.collectives import round_s
from mk.step.plan import DecodePlan
from mk.cost.published import published
from mk.cost.sim import Assumptions
from builders import simulated_step


@pytest.fixture(scope="module")
def rows():
    return ledger.entries()


def test_every_published_row_is_an_entry_and_a_system_without_a_chip_row_has_no_model(rows):
    assert len(rows) == len(published())
    cerebras = [r for r in rows if r["system"] == "cerebras"]
    assert cerebras and "hbm_floor_ms" not in cerebras[0] and "chips.csv" in cerebras[0]["note"]


def test_modelled_step_streams_hbm_beside_the_tile_floor_and_collectives_and_errors_agree(
        rows):
    for r in rows:
        if "hbm_floor_ms" not in r:
            continue
        if mk.chip(r["system"]).kind == "gpu":  # no GPU MXU floor
            assert "mxu_floor_ms" not in r and "mxu_floor" not in r, r["run"]
            continue
        lane = r["tile_floor_ms"] + r["collective_ms"]  # the compute lane, one after another
        assert r["modelled_ms"] == pytest.approx(max(r["hbm_floor_ms"], lane))
        assert r["tile_floor_fast_ms"] <= r["tile_floor_ms"]  # the fast end of the rate
        lane_bound = "collective" if r["collective_ms"] > r["tile_floor_ms"] else "tile"
        assert r["bound"] == ("hbm" if r["hbm_floor_ms"] >= lane else lane_bound)
        assert r["note"]
        for name in ("hbm_floor", "mxu_floor", "modelled", "conventional"):
            if name in r:
                assert r[f"{name}_error"] == pytest.approx(r[name] / r["published"] - 1)
    gpu = [r for r in rows if "conventional" in r]
    assert gpu and all(r["conventional"] < r["modelled"] for r in gpu)


def test_speculative_rows_verify_the_published_rows_on_every_core(rows):
    kimi = next(r for r in rows if r["system"] == "tpu7x" and r["tau"] == 6)
    assert (kimi["rows"], kimi["batch"]) == (ledger.VERIFY_ROWS, 1)
    assert kimi["context"] == 1152  # the release's benchmark scripts (published.csv)
    want = perf.predict(mk.preset("kimi-k3"), "tpu7x", batch=1, rows=8, context=1152,
                        tp=32, accepted=6)
    assert kimi["hbm_floor_ms"] == pytest.approx(want.hbm_floor_ms)
    assert kimi["preset"] == "kimi-k3" and "24 gated-MLA layers" in kimi["note"]
    assert ("TP32: each expert's 96 columns a device padded to 128 lanes: 1.33x its "
            "bytes") in kimi["note"]


def test_the_27b_row_is_the_hybrid_at_tp8_with_its_state_bytes_share(rows):
    """The release's "Qwen3.8-27B" is modelled as qwen3.5-27b (48 gated-DeltaNet layers): its
    row states the linear states' share of the step's bytes, which the floor counts."""
    qwen = next(r for r in rows if r["system"] == "tpu7x" and r["preset"] == "qwen3.5-27b")
    assert qwen["context"] == 2048  # the release's benchmark scripts (published.csv)
    e = perf.predict(mk.preset("qwen3.5-27b"), "tpu7x", batch=1, rows=8, context=2048, tp=8,
                     accepted=6)
    assert e.state_read_bytes > 0 and e.state_write_bytes == 8 * e.state_read_bytes
    assert qwen["state_share"] == pytest.approx(e.state_bytes / e.total_bytes)
    assert qwen["state_share"] > 0.01
    assert qwen["hbm_floor_ms"] == pytest.approx(e.hbm_floor_ms)
    assert qwen["published"] == 1515 and "gated-DeltaNet" in qwen["note"]
    kimi = [r for r in rows if r["preset"] == "kimi-k3" and "state_share" in r]
    assert kimi and all(0 < r["state_share"] < qwen["state_share"] for r in kimi)


def test_each_row_is_modelled_at_its_own_context_and_an_unstated_one_is_noted(monkeypatch,
                                                                               qwen27b_row):
    """The ledger reads the context from the row (not a constant): the 27B run at its
    2048 positions moves more KV bytes than the same row with context 0, and a row that
    states no context is modelled at 0 with a note saying so."""
    monkeypatch.setattr(ledger, "published", lambda: (qwen27b_row,))
    stated, = ledger.entries()
    monkeypatch.setattr(ledger, "published",
                        lambda: (dataclasses.replace(qwen27b_row, context=0),))
    zero, = ledger.entries()
    monkeypatch.setattr(ledger, "published",
                        lambda: (dataclasses.replace(qwen27b_row, context=None),))
    unstated, = ledger.entries()
    assert (stated["context"], zero["context"], unstated["context"]) == (2048, 0, 0)
    assert stated["hbm_floor_ms"] > zero["hbm_floor_ms"] == unstated["hbm_floor_ms"]
    assert "context not published: S=0 assumed" in unstated["note"]
    assert "context not published" not in stated["note"] + zero["note"]


def test_a_row_whose_tp_is_not_every_core_is_refused(monkeypatch):
    kimi = next(r for r in published() if r.system == "tpu7x" and r.tp)
    monkeypatch.setattr(ledger, "published", lambda: (dataclasses.replace(kimi, tp=8),))
    with pytest.raises(ValueError, match=r"tp=8 is not chips\*cores_per_chip=32"):
        ledger.entries()


def test_no_published_speed_beats_either_floor_under_the_strictest_routing(monkeypatch):
    def beating(rows):
        return [r["run"] for r in rows
                if "hbm_floor" in r and r["published"] > ledger.floor_tokens(r)]

    assert beating(ledger.entries(routing="shared")) == []
    # the control: a row claiming 100x its published speed beats its floors
    kimi = next(r for r in published() if r.system == "tpu7x" and r.tp)
    fast = dataclasses.replace(kimi, tokens_per_s=100 * kimi.tokens_per_s)
    monkeypatch.setattr(ledger, "published", lambda: (fast,))
    assert len(beating(ledger.entries(routing="shared"))) == 1


def test_the_collective_chain_moves_with_the_assumed_latency_of_a_message_round(rows):
    """Issue 35: every TPU row at another latency of one collective message round: its
    collective chain grows by that much per round of the step (two_phase at TP8 and TP32:
    2 an all-reduce, 2 L all-reduces, and 2 for the argmax's gather as `mk.cost.perf` charges
    it; 1 for each MoE layer's router gather where the router is split, and 3 for a
    latent MoE layer's all-gather and all-reduce of its latent: Kimi K3's), and the grid
    lays such rows out by latency. By default a round is the chip's (`round_s`: TPU7x's
    measured 4.1 us), so the 2-us rows move by 2 us less than that a round."""
    other = ledger.entries(assumptions=Assumptions(ici_latency_s=2e-6))
    for one, two in zip(rows, other):
        if "collective_ms" not in one or mk.chip(one["system"]).kind != "tpu":
            continue
        config = mk.preset(one["preset"])
        assert "two_phase: 2 message rounds" in one["note"]
        gathers = len(config.moe_layers) * (("router split by experts" in one["note"])
                                            + 3 * bool(config.moe_latent))
        change_s = 2e-6 - round_s(mk.chip(one["system"]))
        change_ms = (perf.collectives_per_step(config) * 2 + gathers) * change_s * 1e3
        assert two["collective_ms"] - one["collective_ms"] == pytest.approx(change_ms)
        assert (two["modelled_ms"] - one["modelled_ms"]) * change_s >= 0
    fake = [dict(run="r", published_step_ms=3.0, hbm_floor_ms=1.0, collective_ms=0.5,
                 simulated_ms=2.0, compiled_slow_ms=4.0, compiled_fast_ms=2.5),
            dict(run="gpu", published_step_ms=5.0)]
    headline_runs = {r["run"] for r in ledger.entries(batches=(1,))}
    assert {r["run"] for r in rows if r["batch"] == 1} == headline_runs
    assert "kimi-k3 on 16 tpu7x, B=1" in headline_runs and not any(
        "B=2" in run for run in headline_runs)
    table = ledger.latency_grid({2.0: fake, 1.0: fake[:1]})
    assert [(r["run"], r["round (µs)"]) for r in table] == [("r", 1.0), ("r", 2.0)]
    assert table[0]["compiled, slow bundle rate (ms)"] == 4.0
    assert "compiled, fast bundle rate (ms)" in table[0]


def test_glossary_defines_each_term_once_and_refuses_an_unknown_one():
    text = ledger.glossary().data
    assert all(text.count(f"| {t} |") == 1 for t in ledger.TERMS)
    assert "| roofline |" not in text
    with pytest.raises(ValueError, match="term='roofline'"):
        ledger.glossary("roofline")


@pytest.fixture(scope="module")
def qwen27b_row():
    return next(r for r in published()
                if r.preset == "qwen3.5-27b" and r.system == "tpu7x")


def test_a_recorded_per_tile_cost_gives_the_compiled_kernels_simulated_step(monkeypatch,
                                                                             qwen27b_row):
    """The "compiled" columns replay the recorded kernel (its ring, latency and costliest
    per-tile loop's bundles) at each end of the chip's bundle rate: the slow end makes the
    slower step; a dearer tile makes a slower step (the control), a
    recorded kernel that did not fit says so, and a row that is not the benchmark's is
    refused."""
    monkeypatch.setattr(ledger, "published", lambda: (qwen27b_row,))
    run, = ledger.runs()
    preset, chip, tp, batch, rows = run.key
    # 1300 bundles: 1.40 us at TPU7x's slow end, 1.26 us at its fast end, against the
    # 1.25 MiB tile's 355 ns of DMA: it bounds the step at both ends
    cost = dict(preset=preset, chip=chip, tp=tp, batch=batch, rows=rows, fits=True,
                slots=24, latency_us=1.0, bundles_per_tile="900-1300", tile_ns=600.0,
                dma_ns=355.0)
    r, = ledger.entries(simulate_tpu=True, tile_costs=[cost])
    block = dataclasses.replace(DecodePlan.make(run.config, batch=batch, rows=rows, tp=tp,
                                                position=run.context).block, slots=24)
    for end in ("slow", "fast"):
        want = simulated_step(
            run.config, run.spec, batch=batch, rows=rows, context=run.context, tp=tp,
            block=block, assumptions=mk.cost.sim.Assumptions(dma_latency_s=1e-6,
                                                        tile_bundles=1300, rate_end=end))
        assert r[f"compiled_{end}_ms"] == pytest.approx(want.step_ms)
        assert r[f"compiled_{end}_over_floor"] == pytest.approx(want.step_ms
                                                                / r["hbm_floor_ms"])
        assert r[f"tile_{end}_ns"] == pytest.approx(
            1300 / run.spec.bundle_rate(end, batch * rows) * 1e9)
        assert r[f"compiled_{end}_bound"]
    assert r["compiled_slow_ms"] > r["compiled_fast_ms"]
    assert r["compiled_slots"] == 24 and r["tile_bundles"] == 1300
    cheap, = ledger.entries(simulate_tpu=True, tile_costs=[cost | dict(
        bundles_per_tile="1-1")])
    assert cheap["compiled_slow_ms"] < r["compiled_slow_ms"]
    refused, = ledger.entries(simulate_tpu=True, tile_costs=[
        {k: v for k, v in cost.items() if k not in ("tile_ns", "dma_ns")}
        | dict(fits=False, error="VMEM 70 MiB of 64")])
    assert "compiled_slow_ms" not in refused and "VMEM 70 MiB" in refused["compiled_note"]
    cut, = ledger.entries(simulate_tpu=True, tile_costs=[
        dict(cost, fits=False, error="216 GiB of HBM", measured_on="its first 4 layers")])
    assert cut["compiled_slow_ms"] == pytest.approx(r["compiled_slow_ms"])
    assert "216 GiB" in cut["compiled_note"] and "first 4 layers" in cut["compiled_note"]
    with pytest.raises(ValueError, match=r"missing \['tp'\]"):
        ledger.entries(tile_costs=[{k: v for k, v in cost.items() if k != "tp"}])
    with pytest.raises(ValueError, match=r"bundles_per_tile='many'"):
        ledger.entries(simulate_tpu=True, tile_costs=[cost | dict(bundles_per_tile="many")])


def test_the_recorded_tile_costs_cover_every_published_tpu_run():
    """mk/data/tile_costs/published.json (benchmarks/tile_costs.py --published) holds one
    compiled kernel per TPU run of the ledger: a run added to published.csv without a
    recompile is caught here. A kernel that does not fit its core would record why and be
    measured on a cut of its layers."""
    recorded = json.loads((Path(__file__).parent.parent / "mk" / "data" / "tile_costs"
                           / "published.json").read_text())
    want = {run.key for run in ledger.runs() if run.spec and run.spec.kind == "tpu"}
    assert {ledger.cost_key(c) for c in recorded} == want
    assert all(c["tile_ns"] > 0 for c in recorded)
    assert all("HBM" in c["error"] and "layers" in c["measured_on"]
               for c in recorded if not c["fits"])


def test_no_term_is_contradicted_by_a_published_row():
    """Every term that claims no step can be shorter (`ledger.FLOORS`) holds for every
    published TPU row at the feed it names; a term beaten by a published row (the
    modelled step at the bf16 feed) does not call itself a bound."""
    claims = [t for t, text in ledger.TERMS.items() if "no step can be shorter" in text
              or "no TPU step can be shorter" in text]
    assert set(claims) == set(ledger.FLOORS), claims
    for term, (column, compute) in ledger.FLOORS.items():
        for r in ledger.entries(compute=compute):
            if column in r and mk.chip(r["system"]).kind == "tpu":
                assert r["published_step_ms"] >= r[column] * (1 - 1e-9), (term, r["run"])
    beaten = [r["run"] for r in ledger.entries() if "modelled_ms" in r
              and r["published_step_ms"] < r["modelled_ms"]]
    assert beaten, "no published row beats the modelled step: the term may say so"
    assert "not a bound" in ledger.TERMS["modelled step"]
    assert "lower bound" not in " ".join(ledger.TERMS.values())


def test_headline_states_the_kernel_against_the_release():
    rows = ledger.entries(speculative_only=True, simulate_tpu=True)
    text = ledger.headline(rows)
    assert "Kimi K3 on tpu7x, tau 6" in text and "simulated step" in text
    both = ledger.headline([r | dict(compiled_slow_ms=9.87, compiled_fast_ms=6.54)
                            for r in rows])
    assert "compiled-kernel step" in both and "9.87 ms at the slow end of the bundle" in both
    assert "6.54 ms at its fast end" in both
    with pytest.raises(ValueError, match="no simulated row"):
        ledger.headline(ledger.entries(speculative_only=True))


# -- One table of the words, in notebook 00; 09 and 11 link to it ------------------------------
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
LEDGER_PAGE = "00_decode_is_memory_bound"
NOTEBOOK_LINK = re.compile(r"\]\((\d\d[a-z]?_[a-z0-9_]+)\.ipynb\)")


def test_the_words_are_shown_once_in_notebook_00_and_09_and_11_link_to_it():
    """Notebook 00 shows every term (`glossary()`, no subset) in its section "The ledger";
    no other notebook re-prints definitions, and 09 and 11 link to 00's page."""
    shown = {p.stem: p.read_text(encoding="utf-8").count("ledger.glossary(")
             for p in NOTEBOOKS.glob("[0-9][0-9]*.py")}
    assert {k: v for k, v in shown.items() if v} == {LEDGER_PAGE: 1}
    zero = (NOTEBOOKS / f"{LEDGER_PAGE}.py").read_text(encoding="utf-8")
    assert "display(ledger.glossary())" in zero and "\n# ## The ledger" in zero
    for stem in ("09_speculative_sweep", "11_design_review"):
        text = (NOTEBOOKS / f"{stem}.py").read_text(encoding="utf-8")
        assert LEDGER_PAGE in NOTEBOOK_LINK.findall(text), stem


def test_a_notebook_link_names_a_notebook_whose_page_has_its_name():
    """A link `[..](NN_topic.ipynb)` opens the notebook in Jupyter and, on the site, the
    page myst makes of it: that page exists under that name only if the notebook's default
    run is unlabelled (notebooks/runs.yaml), so a label added later is caught here."""
    sys.path.insert(0, str(ROOT / "tools"))
    import run_notebooks

    linked = {stem for p in NOTEBOOKS.glob("[0-9][0-9]*.py")
              for stem in NOTEBOOK_LINK.findall(p.read_text(encoding="utf-8"))}
    assert LEDGER_PAGE in linked
    targets = [NOTEBOOKS / f"{stem}.ipynb" for stem in sorted(linked)]
    assert all(t.exists() for t in targets), targets
    runs = run_notebooks.load_runs(NOTEBOOKS / "runs.yaml", targets)
    first = {r.notebook.stem: r.name for r in reversed(runs)}
    assert first == {stem: stem for stem in linked}


def _site(folder: Path, *notebooks: tuple[str, str]) -> str:
    """Build a two-page site with the project's Sphinx configuration (warnings as
    errors); return the second page's HTML."""
    import nbformat

    folder.mkdir()
    for name, text in notebooks:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, folder / f"{name}.ipynb")
    toc = "\n".join(name for name, _ in notebooks)
    (folder / "index.md").write_text(f"# Runs\n\n```{{toctree}}\n{toc}\n```\n")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "-d",
         str(folder / ".doctrees"), "-c", str(ROOT / "docs"), str(folder), str(folder / "site")],
        capture_output=True, text=True, env=dict(os.environ, MK_MATHJAX="mathjax/x.js"))
    assert done.returncode == 0, done.stderr[-2000:]
    return (folder / "site" / f"{notebooks[-1][0]}.html").read_text(encoding="utf-8")


def test_a_notebook_link_is_the_pages_link_on_the_site_and_text_without_that_page(tmp_path):
    link = f"See [notebook 00's ledger]({LEDGER_PAGE}.ipynb)."
    both = _site(tmp_path / "both", (LEDGER_PAGE, "# Zero\n\n## The ledger\n"),
                 ("09_speculative_sweep", f"# Nine\n\n{link}"))
    assert f'href="{LEDGER_PAGE}.html"' in both
    alone = _site(tmp_path / "alone", ("09_speculative_sweep", f"# Nine\n\n{link}"))
    assert f'href="{LEDGER_PAGE}.html"' not in alone and "notebook 00" in alone


@pytest.mark.parametrize("kwargs, message", [
    (dict(batches=[0]), "batches[0]=0 must be a positive integer"),
    (dict(batches=[3]), "batches=[3]: published rows have batches [1, 2, 4, 8]"),
    (dict(batches=[]), "batches=[]: published rows have batches"),
    (dict(batches=1), "batches=1 must be a collection of batch sizes"),
    (dict(routing="skewed"), "routing='skewed' must be one of"),
    (dict(compute="fp4"), "compute='fp4' must be one of"),
    (dict(simulate_tpu="yes"), "simulate_tpu='yes' must be True or False"),
    (dict(assumptions={"hbm_share": 1}), "assumptions is a dict"),
    (dict(tile_costs="x"), "tile_costs='x' must be a list of rows"),
    (dict(tile_costs=[3]), "tile cost row 3 must be a mapping"),
])
def test_entries_refuses_bad_arguments_instead_of_returning_nothing(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ledger.entries(**kwargs)


@pytest.mark.parametrize("call", [
    lambda row: ledger.headline([row]), lambda row: ledger.latency_grid({1.0: [row]}),
    ledger.floor_tokens, ledger.larger_floor, ledger.tile_bundles,
    ledger.recorded_assumptions, ledger.cost_key])
@pytest.mark.parametrize("row", [{"simulated_ms": 1.0}, 3, None, {
    "run": "x", "simulated_ms": 1.0, "model": "m", "system": "s", "tau": 1}])
def test_the_row_readers_name_what_a_handed_in_row_lacks(call, row):
    """A row that `entries` or benchmarks/tile_costs.py did not make is refused with the
    field it lacks (or as not a mapping), not a KeyError or an empty-min error."""
    with pytest.raises(ValueError, match=r"must be a mapping|missing \[|no simulated row|"
                                         r"must read 'least-most'"):
        call(row)
