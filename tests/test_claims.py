"""Issue 62's table: each claim the notebooks made that a TPU v5e contradicted, as the
notebooks say it now, checked against the committed records in data/measured.

One check per row of the table. Each reads the notebooks' .py text (and README.md, docs/)
and a record, never runs a notebook, and returns the problems it finds: a sentence that is
gone, a number that disagrees with the record, or the old false sentence back. Each test
runs its check on the text as committed (no problem) and on a copy with one wrong number
or one old sentence planted (a problem found), so every check is shown able to fail.

Not here: whether a notebook runs (tests/test_notebooks.py), the records' own format
(tests/test_tpu_notebooks.py, tests/test_calibration.py), the simulator's agreement with
the records row by row (tests/test_calibration.py).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from mk.cost import calibration, ledger, perf
from mk.course import reviewed
from mk.measure import measure
from mk.model.chips import spec_of

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "data" / "measured"


def _prose(text: str) -> str:
    """A notebook's .py or a Markdown page as one line: comment marks and line breaks gone."""
    return " ".join(" ".join(re.sub(r"^# ?", "", line) for line in text.splitlines()).split())


@functools.cache
def _texts() -> dict[str, str]:
    """{notebook stem, "README", "docs/notebooks", "docs/colab": its text as prose}."""
    out = {p.stem: _prose(p.read_text(encoding="utf-8"))
           for p in (ROOT / "notebooks").glob("[0-9]*.py")}
    out["README"] = _prose((ROOT / "README.md").read_text(encoding="utf-8"))
    for page in ("notebooks", "colab"):
        out[f"docs/{page}"] = _prose((ROOT / "docs" / f"{page}.md").read_text(encoding="utf-8"))
    return out


def _record(name: str) -> dict:
    return json.loads((MEASURED / name).read_text(encoding="utf-8"))


def _planted(key: str, old: str, new: str) -> dict[str, str]:
    """The texts with `old` replaced by `new` in `key`'s (which must contain it)."""
    texts = dict(_texts())
    assert old in texts[key], (key, old)
    texts[key] = texts[key].replace(old, new, 1)
    return texts


def _said(texts, key, pattern, problems) -> re.Match | None:
    found = re.search(pattern, texts[key])
    if found is None:
        problems.append(f"{key}: no sentence matching {pattern!r}")
    return found


def _never(texts, keys, pattern, problems) -> None:
    for key in keys:
        if re.search(pattern, texts[key], re.I):
            problems.append(f"{key}: the old claim {pattern!r} is back")


def _loops() -> list[tuple[dict, float]]:
    """Each device loop of the v5e's steps record with its HBM floor's share of it."""
    record = calibration.load_steps(calibration.steps_path("v5e"))
    out = []
    for row in record["rows"]:
        if row.get(calibration.LOOP):
            floor = perf.predict(calibration.row_config(row), "v5e", batch=row["batch"],
                                 rows=row["rows"], context=row["context"]).hbm_floor_ms
            out.append((row, floor / (row[calibration.LOOP] * 1e3)))
    return out


# -- 06, 02, 03: "the step is its bytes over HBM bandwidth; everything else overlaps" --------
def step_is_not_its_bytes(texts) -> list[str]:
    problems = []
    _never(texts, ("06_megakernel", "02_attention_prologue", "03_decode_attention"),
           r"everything else overlaps", problems)
    if 'ledger.steps_table("v5e")' not in texts["06_megakernel"]:
        problems.append("06: the v5e's measured steps table is not shown")
    for key in ("02_attention_prologue", "03_decode_attention"):
        if "notebook 06's" not in texts[key] or "measured" not in texts[key]:
            problems.append(f"{key}: no pointer to 06's measured steps")
    said = _said(texts, "06_megakernel", r"the dense rows that read much KV \((\d+) sequences, "
                 r"or a (\d+)-position cache\) sit furthest from the floor", problems)
    if said:
        dense = [(row, share) for row, share in _loops()
                 if not calibration.row_config(row).is_moe
                 and not calibration.row_config(row).is_hybrid]
        heavy = [s for row, s in dense if row["batch"] == int(said[1])
                 or row["context"] == int(said[2])]
        light = [s for row, s in dense if row["batch"] != int(said[1])
                 and row["context"] != int(said[2])]
        if not heavy or not light or max(heavy) >= min(light):
            problems.append(f"06: KV-heavy dense loops at {heavy} of their floor, the others "
                            f"at {light}: they do not sit furthest from it")
    # 03: the attention loop takes KV slower than the DMA engine brings weights.
    if "took KV slower than the DMA engine brings weights" not in texts["03_decode_attention"]:
        problems.append("03: the measured KV rate against the DMA rate is not said")
    elif not calibration.assumptions("v5e").kv_bytes_per_s < measure.load(
            measure.path_for("v5e")).hbm_bw:
        problems.append("03: the v5e's attention loop is not slower than its DMA engine")
    return problems


def test_06_02_03_say_a_step_is_not_its_bytes_alone_as_the_v5e_measured():
    assert step_is_not_its_bytes(_texts()) == []
    assert step_is_not_its_bytes(_planted(
        "06_megakernel", "the dense rows that read much KV (8 sequences",
        "the dense rows that read much KV (2 sequences"))
    assert step_is_not_its_bytes(_planted(
        "02_attention_prologue", "VMEM; the time is",
        "VMEM; everything else overlaps, the time is"))


# -- 08, 11, 13, 05d: "qwen3 steps at >= 97 % HBM busy" -------------------------------------
def simulator_error_is_said(texts) -> list[str]:
    problems = []
    _never(texts, ("08_profile_bubbles", "11_design_review", "11b_design_review_appendix",
                   "13_measure_your_tpu", "05d_gpt_oss_layers"),
           r"\b(9[0-9](\.\d+)?|100) ?% (of the step )?HBM busy|HBM busy (at |of )?(9[0-9]|100) ?%",
           problems)
    loops = [share for row, share in _loops() if row["model"].startswith("qwen3")]
    if max(loops) >= 0.97:
        problems.append(f"the v5e's qwen3 loops reached {max(loops):.0%} of floor speed")
    error = reviewed.simulator_error("v5e")
    if "the simulator's error" not in texts["11_design_review"] or \
            "reviewed.simulator_error(c)" not in texts["11_design_review"]:
        problems.append("11: the verdict does not state the simulator's measured error")
    said = _said(texts, "11b_design_review_appendix", r"assumed inputs, which were too "
                 r"(fast|slow) on the one chip measured", problems)
    if said and (said[1] == "fast") != (error["assumed"][1] < 0):
        problems.append(f"11b: 'too {said[1]}', but the assumed simulator's errors on the "
                        f"v5e run {error['assumed']}")
    for key in ("13_measure_your_tpu", "08_profile_bubbles"):
        if not re.search(r'steps_table\("v5e"\)|calibration\.assumptions\("v5e"\)', texts[key]):
            problems.append(f"{key}: no measured v5e step beside the simulated one")
    return problems


def test_08_11_13_05d_say_how_far_the_simulator_was_from_the_v5e():
    assert simulator_error_is_said(_texts()) == []
    assert simulator_error_is_said(_planted(
        "11b_design_review_appendix", "which were too fast", "which were too slow"))
    assert simulator_error_is_said(_planted(
        "08_profile_bubbles", "## The same step on a real chip",
        "## The same step on a real chip: qwen3 steps at 97 % HBM busy"))


# -- 00, 12: "the storage format of the weights is the speed" -------------------------------
def format_is_the_speed_only_at_the_floor(texts) -> list[str]:
    problems = []
    _never(texts, ("00_decode_is_memory_bound", "12_quantised_weights"),
           r"(?<!there )the storage format of the weights is the speed", problems)
    said = _said(texts, "12_quantised_weights", r"a TPU v5e measured an fp4 tile of (\d+) % "
                 r"of a bf16 tile's bytes in (\d+) % of its time", problems)
    if said:
        tiles = {r["format"]: r for r in _record("v5e-tiles.json")["rows"]}
        fp4, bf16 = tiles["fp4"], tiles["bf16"]
        for got, want in ((said[1], fp4["tile_bytes"] / bf16["tile_bytes"]),
                          (said[2], fp4["tile_s"] / bf16["tile_s"])):
            if int(got) != round(want * 100):
                problems.append(f"12: says {got} %, v5e-tiles.json gives {want:.0%}")
    return problems


def test_12_says_the_format_is_the_speed_only_at_the_floor_as_the_v5e_measured():
    assert format_is_the_speed_only_at_the_floor(_texts()) == []
    text = _texts()["12_quantised_weights"]
    number = re.search(r"bf16 tile's bytes in (\d+) %", text)[1]
    assert format_is_the_speed_only_at_the_floor(_planted(
        "12_quantised_weights", f"bytes in {number} %", f"bytes in {int(number) // 4} %"))
    assert format_is_the_speed_only_at_the_floor(_planted(
        "00_decode_is_memory_bound", "A floor is what",
        "The storage format of the weights is the speed. A floor is what"))


# -- 01: "on a TPU the printed wall times can be set against the floor" ---------------------
def a_call_is_not_the_stream(texts) -> list[str]:
    problems = []
    _never(texts, ("01_weight_streaming",), r"wall times (printed above )?can be set against "
           r"the floor", problems)
    said = _said(texts, "01_weight_streaming", r"a call's fixed cost \(host dispatch and "
                 r"launch, about ([\d.]+) ms a step on a v5e", problems)
    if said:
        call = calibration.call_seconds(calibration.load_steps(
            calibration.steps_path("v5e")))[0] * 1e3
        if abs(float(said[1]) - call) > 0.05:
            problems.append(f"01: says {said[1]} ms a call, v5e-steps.json gives {call:.2f}")
    return problems


def test_01_says_a_call_costs_more_than_its_kernels_floor_as_the_v5e_measured():
    assert a_call_is_not_the_stream(_texts()) == []
    number = re.search(r"launch, about ([\d.]+) ms", _texts()["01_weight_streaming"])[1]
    assert a_call_is_not_the_stream(_planted(
        "01_weight_streaming", f"about {number} ms", "about 0.01 ms"))


# -- 04: "a profile on a TPU runtime shows the routing time" --------------------------------
def a_profile_shows_one_op(texts) -> list[str]:
    problems = []
    _never(texts, ("04_mlp_and_moe",), r"a profile on a TPU runtime shows (the )?routing",
           problems)
    _said(texts, "04_mlp_and_moe", r"A profile on a TPU runtime shows little more by default: "
          r"a pallas_call is one op in the trace", problems)
    trace = _record("v5e-trace.json")
    flags = trace["libtpu_flags"]
    mega = trace["variants"]["megakernel"]
    if "region_trace=true" not in flags or not mega["scopes"]:
        problems.append("v5e-trace.json: no named scopes recorded with the region trace on")
    if mega["summary"]["launches_per_step"] != 1.0:
        problems.append("v5e-trace.json: the megakernel is not one launch a step")
    return problems


def test_04_says_a_pallas_call_is_one_op_in_a_trace_as_the_v5e_recorded():
    assert a_profile_shows_one_op(_texts()) == []
    assert a_profile_shows_one_op(_planted(
        "04_mlp_and_moe", "shows little more by default", "shows the routing time"))


# -- 06, 05d, 09: "the megakernel gives exactly the reference's tokens" ---------------------
def tokens_as_judged_on_the_chip(texts) -> list[str]:
    problems = []
    if "ledger.verified_table()" not in texts["06_megakernel"]:
        problems.append("06: the chip's judged tokens are not shown")
    _never(texts, ("05d_gpt_oss_layers", "09_speculative_sweep", "06_megakernel"),
           r"exactly the reference's tokens on (a|the) (TPU|chip)", problems)
    cases = _record("v5e-exact.json")["cases"]
    said = _said(texts, "README", r"\((\d+) judged cases: every family.*?token-exact but "
                 r"for (\d+) bf16 near-ties, none wrong", problems)
    if said:
        counted = (len(cases), sum(c["ties"] for c in cases), sum(c["wrong"] for c in cases))
        if (int(said[1]), int(said[2]), 0) != counted:
            problems.append(f"README: {said[1]} cases, {said[2]} near-ties, none wrong; "
                            f"v5e-exact.json: {counted}")
    families = {c["family"] for c in cases}
    if not {"qwen3", "gpt_oss"} <= families:
        problems.append(f"v5e-exact.json judged only {sorted(families)}")
    return problems


def test_06_and_readme_say_what_the_chip_judged_of_the_tokens():
    assert tokens_as_judged_on_the_chip(_texts()) == []
    assert tokens_as_judged_on_the_chip(_planted(
        "README", "but for 3 bf16 near-ties", "but for 4 bf16 near-ties"))


# -- 07, 12, 05d: "`DecodePlan.fits` decides what runs; gpt-oss-20b fits a v5e" -------------
def fits_is_counted_not_measured(texts) -> list[str]:
    problems = []
    rows = {r["model"]: r for r in _record("v5e-models.json")["rows"]}
    said = _said(texts, "12_quantised_weights", r"on a v5e, qwen3-4b bf16 counted ([\d.]+) "
                 r"GiB for a donating `generate` and peaked at ([\d.]+), qwen3-8b int8 counted "
                 r"([\d.]+) GiB for a donating `generate` and peaked at ([\d.]+), both exact",
                 problems)
    if said:
        want = [rows["qwen3-4b"]["planned_gib"], rows["qwen3-4b"]["peak_gib"],
                rows["qwen3-8b"]["planned_gib"], rows["qwen3-8b"]["peak_gib"]]
        if [float(x) for x in said.groups()] != [round(w, 1) for w in want]:
            problems.append(f"12: {said.groups()} GiB, v5e-models.json {want}")
        if any(rows[m]["wrong"] or rows[m]["exact"] + rows[m]["ties"] != rows[m]["total"]
               for m in ("qwen3-4b", "qwen3-8b")):
            problems.append("12: 'both exact', but v5e-models.json has a wrong token")
    oss = rows.get("gpt-oss-20b")
    for key in ("05d_gpt_oss_layers", "docs/colab"):
        if oss is None:
            if not re.search(r"v5e-1.{0,120}counted, not measured", texts[key]):
                problems.append(f"{key}: says the 20b on a v5e-1 without 'counted, not "
                                "measured' (v5e-models.json has no gpt-oss-20b row)")
            continue
        said = _said(texts, key, r"its random weights in the real shapes counted ([\d.]+) "
                     r"GiB for a donating `?generate`? and peaked at ([\d.]+) on a v5e, "
                     r"(\d) of its (\d) tokens exact", problems)
        if said and ([float(x) for x in said.groups()[:2]] != [
                round(oss[k], 1) for k in ("planned_gib", "peak_gib")]
                or [int(x) for x in said.groups()[2:]] != [oss["exact"] + oss["ties"],
                                                           oss["total"]]):
            problems.append(f"{key}: gpt-oss-20b {said.groups()}, v5e-models.json "
                            f"{[oss[k] for k in ('planned_gib', 'peak_gib', 'exact', 'total')]}")
    limit = {r["limit_gib"] for r in rows.values()}
    said = _said(texts, "05d_gpt_oss_layers", r"v5e-1's ([\d.]+) GiB", problems)
    if said and {float(said[1])} != limit:
        problems.append(f"05d: v5e-1's {said[1]} GiB, v5e-models.json's limit {limit}")
    return problems


def test_12_and_05d_say_what_a_v5e_held_counted_and_measured():
    assert fits_is_counted_not_measured(_texts()) == []
    assert fits_is_counted_not_measured(_planted(
        "12_quantised_weights", "and peaked at 9.2,", "and peaked at 8.2,"))
    assert fits_is_counted_not_measured(_planted(
        "05d_gpt_oss_layers", "and peaked at 14.5", "and peaked at 13.5"))
    assert fits_is_counted_not_measured(_planted(
        "docs/colab", "1 of its 8 tokens exact", "8 of its 8 tokens exact"))


# -- 13: "measure your TPU" failed on the v5e with its defaults -----------------------------
def thirteen_ran_with_its_defaults(texts) -> list[str]:
    problems = []
    record = _record("v5e.json")
    full = measure.SWEEPS["full"]  # what 13's sweep="auto" runs on a TPU
    _said(texts, "13_measure_your_tpu", r"A lent TPU v5e ran this measurement with the "
          r"notebook's defaults", problems)
    if record["mode"] != "hardware" or (record["repeats"], record["min_extra_bytes"]) != (
            full.repeats, full.min_extra_bytes):
        problems.append(f"v5e.json: {record['mode']}, repeats {record['repeats']}, "
                        f"min_extra_bytes {record['min_extra_bytes']}: not 13's defaults")
    said = _said(texts, "13_measure_your_tpu", r"On a TPU that fixed cost is about ([\d.]+) ms",
                 problems)
    if said and abs(float(said[1]) - record["step"]["seconds"] * 1e3) > 0.25:
        problems.append(f"13: about {said[1]} ms, v5e.json's one step "
                        f"{record['step']['seconds'] * 1e3:.2f} ms")
    said = _said(texts, "13_measure_your_tpu", r"on a chip of (\d+) GB/s", problems)
    if said and int(said[1]) != round(spec_of("v5e").hbm_bw / 1e9):
        problems.append(f"13: a chip of {said[1]} GB/s, the v5e's datasheet "
                        f"{spec_of('v5e').hbm_bw / 1e9:.0f}")
    notebooks = {r["notebook"]: r["status"] for r in _record("v5e-notebooks.json")["rows"]}
    if notebooks.get("13_measure_your_tpu") != "ok":
        problems.append("v5e-notebooks.json: 13 did not run ok on the v5e")
    return problems


def test_13_says_it_ran_on_the_v5e_with_its_defaults():
    assert thirteen_ran_with_its_defaults(_texts()) == []
    assert thirteen_ran_with_its_defaults(_planted(
        "13_measure_your_tpu", "fixed cost is about 1 ms", "fixed cost is about 5 ms"))


# -- README (and docs/notebooks.md): "nothing here was run on a TPU" ------------------------
def readme_says_what_the_chip_found(texts) -> list[str]:
    problems = []
    _never(texts, ("README",), r"nothing here (was|is) run on a TPU", problems)
    ran = {r["notebook"]: r["status"] for r in _record("v5e-notebooks.json")["rows"]}
    for line in (ROOT / "docs" / "notebooks.md").read_text(encoding="utf-8").splitlines():
        stem = re.match(r"\| \[`(\d\d[a-z]?_\w+)`\]", line)
        if not stem:
            continue
        never = re.search(r"never run on a TPU|not yet run on a chip", line)
        if ran.get(stem[1]) == "ok" and never:
            problems.append(f"docs/notebooks.md: {stem[1]} '{never[0]}', but it ran ok on "
                            "the v5e (v5e-notebooks.json)")
        if stem[1] not in ran and not never:
            problems.append(f"docs/notebooks.md: {stem[1]} never ran on a chip; its status "
                            "must say so")
    probe = measure.load(measure.path_for("v5e"))
    said = _said(texts, "README", r"the DMA probe \(notebook 13's defaults, at \w+\) ([\d.]+) "
                 r"µs and (\d+) GB/s; the attention loop took KV at (\d+) GB/s", problems)
    if said:
        want = (f"{probe.dma_latency_s * 1e6:.2f}", f"{probe.hbm_bw / 1e9:.0f}",
                f"{calibration.assumptions('v5e').kv_bytes_per_s / 1e9:.0f}")
        if said.groups() != want:
            problems.append(f"README: probe and KV rate {said.groups()}, records {want}")
    loops = {(r["model"], r["batch"]): r[calibration.LOOP] * 1e3 for r, _ in _loops()
             if r["context"] == 1024 and r["rows"] == 1 and r.get("layers") is None}
    said = _said(texts, "README", r"device-loop steps of ([\d.]+) ms \(qwen3-0.6b B1\), "
                 r"([\d.]+) \(B8\), ([\d.]+) \(qwen3-1.7b B1\) and ([\d.]+) \(qwen3-4b B1\)",
                 problems)
    if said:
        keys = [("qwen3-0.6b", 1), ("qwen3-0.6b", 8), ("qwen3-1.7b", 1), ("qwen3-4b", 1)]
        for got, key in zip(said.groups(), keys):
            if abs(float(got) - loops[key]) > 0.01 * loops[key]:
                problems.append(f"README: {key} {got} ms, v5e-steps.json {loops[key]:.3f}")
    said = _said(texts, "README", r"every B1 and T8 row at context 1024 reaches (\d+)-(\d+) % "
                 r"of its HBM floor, qwen3-1.7b B8 (\d+) %, qwen3-0.6b B8 (\d+) % and B1 at "
                 r"4096 positions (\d+) %", problems)
    if said:
        table = ledger.steps_table("v5e")
        col = table.columns.index("share of measured HBM floor")
        share = {(r[0], r[1], r[2], r[3]): int(r[col].rstrip("%")) for r in table.rows
                 if r[col] != "-"}
        ones = [s for (_, b, t, c), s in share.items() if c == 1024 and (b, t) in
                ((1, 1), (1, 8))]
        want = (min(ones), max(ones), share["qwen3-1.7b", 8, 1, 1024],
                share["qwen3-0.6b", 8, 1, 1024], share["qwen3-0.6b", 1, 1, 4096])
        if tuple(map(int, said.groups())) != want:
            problems.append(f"README: shares of the measured floor {said.groups()}, "
                            f"steps_table {want}")
    return problems


def test_readme_and_the_notebook_list_say_what_the_v5e_found():
    assert readme_says_what_the_chip_found(_texts()) == []
    assert readme_says_what_the_chip_found(_planted(
        "README", "steps of 1.97 ms (qwen3-0.6b B1)", "steps of 1.64 ms (qwen3-0.6b B1)"))
    assert readme_says_what_the_chip_found(_planted(
        "README", "0.36 µs and 748 GB/s", "0.36 µs and 819 GB/s"))
    assert readme_says_what_the_chip_found(_planted(
        "README", "qwen3-0.6b B8 74 %", "qwen3-0.6b B8 85 %"))
