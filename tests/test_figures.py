"""The figures the course draws, read back from their plotly JSON: for each public figure
function of mk.plots (and mk.measure.profiling's, which notebook 08 draws), built on tiny data,
its traces (how many, their names), its axes' titles and units, at most 10 legend
entries, and the drawn values against the inputs.

The rules every figure keeps (mk.figure_rules) are tested here against planted defects;
tests/test_plots.py has the colour rules (one colour per category and per weight family)
and the ring's Gantt; this module does not repeat them.
"""

from __future__ import annotations


import pytest

import mk
from mk import colours, figure_rules, plots, profile_plots, sim_plots
from mk.cost import machine, perf
from mk.measure import profiling
from builders import simulated_step


def legend(fig) -> list[str]:
    return figure_rules.legend(fig.to_dict())


def axes(fig) -> tuple[str, str]:
    layout = fig.to_dict()["layout"]
    return tuple(layout.get(a, {}).get("title", {}).get("text", "")
                 for a in ("xaxis", "yaxis"))


def check_rules(fig, *, x_unit: str | None = None, y_unit: str | None = None) -> None:
    """The figure rules (mk.figure_rules), a title, and these units on its axes."""
    assert figure_rules.check(fig) == []
    x, y = axes(fig)
    assert x_unit is None or x_unit in x, x
    assert y_unit is None or y_unit in y, y
    assert fig.layout.title.text


# -- The rules themselves, against planted defects ---------------------------------------------
def _good():
    wq = colours.WEIGHT_COLOURS["wq"]
    return {"data": [{"type": "bar", "name": "wq", "marker": {"color": wq},
                      "x": [0.5, 1.0], "y": ["slot 0", "slot 1"], "orientation": "h"}],
            "layout": {"xaxis": {"title": {"text": "time (µs, modelled)"}},
                       "yaxis": {"title": {"text": "ring slot"}}}}


def test_figure_rules_pass_a_good_figure_and_report_each_planted_defect():
    good = _good()
    assert figure_rules.check(good) == []
    untitled = _good()
    untitled["layout"]["yaxis"] = {}
    assert figure_rules.check(untitled) == ["yaxis carries data but has no title"]
    no_unit = _good()
    no_unit["layout"]["xaxis"]["title"]["text"] = "time"
    assert figure_rules.check(no_unit) == [
        "xaxis is a quantity but its title 'time' names no unit in parentheses or brackets"]
    eleven = _good()
    eleven["data"] += [{"type": "scatter", "name": f"series {i}", "x": [1], "y": ["slot 0"]}
                       for i in range(10)]
    assert figure_rules.check(eleven) == [
        f"the legend has 11 entries, more than 10: {['wq'] + [f'series {i}' for i in range(10)]}"]
    grouped = _good()  # a group's hidden-in-legend traces are no entries; its shown ones are
    grouped["data"] = [{"type": "scatter", "name": f"s{i} {half}", "legendgroup": f"s{i}",
                        "showlegend": half == "a", "x": [1], "y": ["a"]}
                       for i in range(10) for half in ("a", "b")]
    assert figure_rules.check(grouped) == []
    grouped["data"][1]["showlegend"] = True
    assert len(figure_rules.legend(grouped)) == 11 and len(figure_rules.check(grouped)) == 1
    # a slider showing one set of ten traces at a time lists ten; a step showing 11 is found
    sets = _good()
    sets["data"] = [{"type": "scatter", "name": f"gamma={g}", "visible": b == 0, "x": [1],
                     "y": ["a"]} for b in range(2) for g in range(10)]
    steps = [{"method": "update", "args": [{"visible": [b == s for b in range(2)
                                                        for g in range(10)]}]} for s in range(2)]
    sets["layout"]["sliders"] = [{"steps": steps}]
    assert figure_rules.check(sets) == []
    steps[1]["args"][0]["visible"][0] = True
    assert len(figure_rules.legend(sets)) == 11
    wrong = _good()
    wrong["data"][0]["marker"]["color"] = colours.WEIGHT_COLOURS["wk"]
    assert figure_rules.check(wrong) == [
        f"trace 'wq' is drawn in {colours.WEIGHT_COLOURS['wk']}, not its colour "
        f"{colours.WEIGHT_COLOURS['wq']}"]
    frame = _good()  # a frame's traces are held to the same colours
    frame["frames"] = [{"name": "2 slots", "data": [{"type": "bar", "name": "w_up[3]",
                                                      "x": [1.0], "y": ["slot 0"]}]}]
    assert figure_rules.check(frame) == [
        "frame '2 slots': trace 'w_up[3]' has no colour of its own: it must be "
        f"{colours.WEIGHT_COLOURS['w_up']}"]
    hidden = _good()  # an axis drawn without ticks or title carries nothing to read
    hidden["layout"]["yaxis"] = {"visible": False}
    assert figure_rules.check(hidden) == []
    index = {"data": [{"type": "heatmap", "z": [[1.0, 2.0]]}],  # implicit index axes
             "layout": {"xaxis": {"title": {"text": "key channel"}},
                        "yaxis": {"title": {"text": "head (index)"}}}}
    assert figure_rules.check(index) == [
        "xaxis is a quantity but its title 'key channel' names no unit in parentheses "
        "or brackets"]


# -- The simulator's timeline, and one collective of a tensor-parallel step -----------------
@pytest.fixture(scope="module")
def shard():
    """qwen3-8b's TP4 shard on v6e, batch 8: its 73 collectives (two a layer, the argmax's
    gather) simulated in ~0.1 s."""
    return simulated_step(mk.preset("qwen3-8b"), mk.chip("v6e"), batch=8, context=512, tp=4)


def _collectives(s):
    return [e for e in s.events if e.what == "collective"]


def test_collective_timeline_draws_that_collective_and_what_overlaps_it(shard):
    found = _collectives(shard)
    assert len(found) == 2 * shard.plan.config.layers + 1
    c = found[9]
    fig = sim_plots.collective_timeline(shard, index=9, pad=0.5)
    check_rules(fig, x_unit="µs")
    assert "simulated" in fig.layout.xaxis.title.text and "simulated" in fig.layout.title.text
    assert "qwen3-8b TP4 on v6e: collective 9 (layer 4)" in fig.layout.title.text
    span = c.end_s - c.start_s
    lo, hi = fig.layout.xaxis.range
    assert (lo, hi) == pytest.approx(((c.start_s - span / 2) * 1e6,
                                      (c.end_s + span / 2) * 1e6))
    bars = {t.name: t for t in fig.data}
    # the collective itself: one bar, where the simulation put it
    assert bars["collective"].base == pytest.approx((c.start_s * 1e6,))
    assert bars["collective"].x == pytest.approx(((c.end_s - c.start_s) * 1e6,))
    # every DMA run overlapping the window is drawn, and nothing outside it
    dma = [e for e in shard.events if e.lane == "dma" and e.end_s >= lo / 1e6
           and e.start_s <= hi / 1e6]
    assert dma and len(bars["DMA"].base) == len(dma)
    assert sorted(bars["DMA"].base) == pytest.approx(sorted(e.start_s * 1e6 for e in dma))
    assert all(b + w >= lo and b <= hi for t in fig.data for b, w in zip(t.base, t.x))
    # the ring keeps loading while the compute lane waits: DMA during the collective
    assert any(e.start_s < c.end_s and e.end_s > c.start_s for e in dma)
    # the last collective is the argmax's gather after the lm_head
    assert "after the lm_head" in sim_plots.collective_timeline(shard, index=-1).layout.title.text


def test_collective_timeline_refuses_a_step_without_collectives_and_a_bad_index(shard):
    one = simulated_step(mk.preset("tiny"), mk.chip("v6e"), context=64)
    with pytest.raises(ValueError, match="tp=1 has no collective"):
        sim_plots.collective_timeline(one, index=0)
    n = len(_collectives(shard))
    with pytest.raises(ValueError, match=f"index={n} must be in \\[-{n}, {n}\\)"):
        sim_plots.collective_timeline(shard, index=n)


def test_timeline_window_keeps_only_what_overlaps_it(shard):
    whole = sim_plots.timeline(shard, layers=(2, 3))
    c = _collectives(shard)[5]
    window = sim_plots.timeline(shard, layers=(2, 3), window_s=(c.start_s, c.end_s))
    count = {t.name: len(t.base) for t in whole.data}
    inside = {t.name: len(t.base) for t in window.data}
    assert sum(inside.values()) < sum(count.values())
    assert all(inside[k] <= count[k] for k in inside)
    assert inside["collective"] == 1


# -- Models and published numbers --------------------------------------------------------------
@pytest.fixture(scope="module")
def estimates():
    return {"tiny": perf.predict(mk.preset("tiny"), "v6e", batch=1, context=64),
            "tiny-moe B=4": perf.predict(mk.preset("tiny-moe"), "v6e", batch=4, context=64)}


def test_roofline_draws_each_chips_line_and_one_slider_step_per_point_set(estimates):
    curves = {c: perf.roofline_curve(mk.chip(c), points=5) for c in ("v6e", "tpu7x")}
    one, moe = estimates.values()
    fig = plots.roofline(curves, {"B=1": {"tiny": one}, "B=4": {"tiny-moe": moe}})
    check_rules(fig, x_unit="FLOP per HBM byte", y_unit="TFLOP/s")
    assert [t.name for t in fig.data] == ["v6e", "tpu7x", "tiny", "tiny-moe"]
    assert (fig.layout.xaxis.type, fig.layout.yaxis.type) == ("log", "log")
    x, y = curves["tpu7x"]
    assert list(fig.data[1].x) == pytest.approx(list(x))
    assert list(fig.data[1].y) == pytest.approx([v / 1e12 for v in y])
    point = fig.data[3]
    assert point.x == pytest.approx((moe.intensity_flop_per_byte,))
    assert point.y == pytest.approx((moe.attainable_flops_per_chip / 1e12,))
    assert [t.visible for t in fig.data[2:]] == [True, False]  # the first set shows
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["B=1", "B=4"]
    assert steps[1].args[0]["visible"] == [True, True, False, True]
    assert plots.roofline(curves, {"B=1": {"tiny": one}}).layout.sliders == ()


def test_bytes_breakdown_stacks_every_byte_of_the_step(estimates):
    shares = plots.bytes_breakdown(estimates)
    gb = plots.bytes_breakdown(estimates, relative=False)
    check_rules(shares, y_unit="share of step bytes")
    check_rules(gb, y_unit="GB")
    names = [t.name for t in gb.data]
    assert "experts touched" in names and "norm weights" in names
    assert "linear-layer weights" not in names  # neither step has linear layers
    for i, e in enumerate(estimates.values()):
        # the parts add up to the step's bytes: no byte left out of the stack
        assert sum(t.y[i] for t in shares.data) == pytest.approx(1.0)
        assert sum(t.y[i] for t in gb.data) == pytest.approx(e.total_bytes / 1e9)
    experts = next(t for t in gb.data if t.name == "experts touched")
    assert experts.y == pytest.approx((0.0, estimates["tiny-moe B=4"].expert_bytes / 1e9))
    assert list(shares.data[0].x) == list(estimates)


def test_published_vs_floor_draws_the_published_bar_and_each_bound():
    fig = plots.published_vs_floor(["run a", "run b"], [700.0, 350.0],
                                   {"HBM floor bound": [1200.0, 900.0],
                                    "MXU floor bound": [None, 2000.0]})
    check_rules(fig, y_unit="tokens/s")
    assert [t.name for t in fig.data] == ["published", "HBM floor bound", "MXU floor bound"]
    assert fig.data[0].y == (700.0, 350.0) and fig.data[2].y == (None, 2000.0)
    assert all(list(t.x) == ["run a", "run b"] for t in fig.data)
    assert fig.layout.yaxis.type == "log"
    with pytest.raises(ValueError, match="bounds\\['x'\\] has 1 values for 2 labels"):
        plots.published_vs_floor(["a", "b"], [1.0, 2.0], {"x": [1.0]})


# -- The ring and the KV cache -------------------------------------------------------------
def _stream(slots=3):
    from mk.kernels.common import BlockSizes
    from mk.kernels.stream import TileStream
    return TileStream.build(BlockSizes(slots=slots, tile_rows=128, tile_cols=128),
                            [("wq", 256, 256), ("w_up", 256, 384)])


def test_tile_stream_draws_every_tile_once_in_consumption_order_with_its_slot():
    stream = _stream()
    fig = plots.tile_stream(stream)
    check_rules(fig, x_unit="tiles")
    assert [t.name for t in fig.data] == ["wq", "w_up"]
    assert [len(t.base) for t in fig.data] == [4, 6]  # 2 x 2 and 2 x 3 tiles of 128
    assert sorted(g for t in fig.data for g in t.base) == list(range(stream.total))
    for t in fig.data:
        assert set(t.y) == {t.name} and set(t.x) == {1}
        assert [c[4] for c in t.customdata] == [g % 3 for g in t.base]  # slot g mod slots
    assert "10 weight tiles through a 3-slot ring" == fig.layout.title.text


def test_ring_gantt_bars_are_the_schedules_issue_land_and_consume_times():
    from mk.course import teach
    times = dict(latency_s=0.5e-6, dma_s=0.05e-6, compute_s=0.02e-6)
    schedules = {f"{n} slots": teach.ring_schedule(_stream(n), slots=n, **times)
                 for n in (1, 3)}
    fig = plots.ring_gantt(schedules, title="t")
    check_rules(fig, x_unit="µs")
    assert legend(fig) == ["w_up", "wq", "skipped (not loaded)"]
    assert len(fig.frames) == 2 and all(len(f.data) == len(fig.data) == 5 for f in fig.frames)
    rows = schedules["3 slots"]
    frame = {t.name: t for t in fig.frames[1].data}
    wq = [r for r in rows if r["family"] == "wq"]
    assert frame["wq"].base == pytest.approx([r["start"] * 1e6 for r in wq])
    assert frame["wq"].x == pytest.approx([0.02] * len(wq))
    assert frame["wq in flight"].base == pytest.approx([r["issue"] * 1e6 for r in wq])
    assert frame["wq in flight"].x == pytest.approx([(r["land"] - r["issue"]) * 1e6
                                                     for r in wq])
    assert list(frame["wq"].y) == [f"slot {r['slot']}" for r in wq]
    assert len(frame["skipped (not loaded)"].x) == 0


def test_kv_tile_map_has_one_row_per_sequence_and_one_cell_per_tile():
    fig = plots.kv_tile_map([127, 300], rows=2, kv_tile=128, context=512)
    check_rules(fig, x_unit="tile")
    assert legend(fig) == ["read", "read and written back", "skipped"]
    cells = {t.name: sorted(zip(t.y, t.base)) for t in fig.data}
    assert sum(len(c) for c in cells.values()) == 2 * 4  # every tile of both sequences
    # p=127 with 2 rows writes tiles 0 and 1; p=300 reads 0, 1 and writes 2
    assert cells["read and written back"] == [("sequence 0 (p=127)", 0),
                                              ("sequence 0 (p=127)", 1),
                                              ("sequence 1 (p=300)", 2)]
    assert cells["read"] == [("sequence 1 (p=300)", 0), ("sequence 1 (p=300)", 1)]


def test_tpu_picture_is_a_picture_whose_boxes_carry_the_chips_numbers():
    spec = mk.chip("v5e")
    fig = plots.tpu_picture(spec)
    assert fig.layout.title.text.startswith("v5e: one TensorCore")
    assert fig.layout.xaxis.visible is False and fig.layout.yaxis.visible is False
    assert legend(fig) == [] and len(fig.data) == 1  # no data axes: nothing to title
    assert len(fig.layout.shapes) == len(fig.data[0].text) + 1  # a box each, the core
    assert any(f"{spec.vmem_bytes >> 20} MiB" in t for t in fig.data[0].text)


# -- The simulator ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sims():
    return {n: simulated_step(mk.preset(n), mk.chip("v6e"), context=64)
            for n in ("tiny", "tiny-moe", "tiny-hybrid")}


def test_timeline_draws_every_event_and_bubble_on_its_lane(sims):
    s = sims["tiny-moe"]
    fig = sim_plots.timeline(s)
    check_rules(fig, x_unit="µs, simulated")
    bars = [(y, b, w) for t in fig.data for y, b, w in zip(t.y, t.base, t.x)]
    assert len(bars) == len(s.events) + len(s.bubbles)
    assert {y for y, _, _ in bars} == {"DMA", "compute", "HBM idle"}
    want = sorted((e.start_s * 1e6, (e.end_s - e.start_s) * 1e6) for e in s.events)
    got = sorted((b, w) for t in fig.data if not t.name.startswith("idle: ")
                 for b, w in zip(t.base, t.x))
    assert [v for pair in got for v in pair] == pytest.approx(
        [v for pair in want for v in pair])
    two = sim_plots.timeline({"a": s, "b": sims["tiny"]}, layers=(0, 0))
    assert {y for t in two.data for y in t.y} == {f"{k} {lane}" for k in "ab"
                                                  for lane in ("DMA", "compute", "HBM idle")}
    assert len(legend(two)) <= 10


def test_timeline_legend_keeps_ten_entries_the_longest_idle_causes_first():
    """A tensor-parallel MoE step has 4 busy categories and more idle causes than the
    legend's 10 entries hold: the legend keeps the causes with the most idle time; every
    cause is still drawn, in its colour, named on hover."""
    s = simulated_step(mk.preset("qwen3-30b-a3b"), mk.chip("v6e"), batch=8, context=512, tp=4)
    fig = sim_plots.timeline(s)
    names = legend(fig)
    drawn = {t.name[len("idle: "):] for t in fig.data if t.name.startswith("idle: ")}
    kept = [n[len("idle: "):] for n in names if n.startswith("idle: ")]
    assert len(names) == plots.LEGEND_ENTRIES < 4 + len(drawn)
    share = s.bubble_share()
    assert drawn == set(share) and len(kept) == plots.LEGEND_ENTRIES - 4
    assert min(share[c] for c in kept) >= max(share[c] for c in drawn - set(kept))
    assert all(t.marker.color == colours.IDLE_COLOURS[t.name[len("idle: "):]]
               for t in fig.data if t.name.startswith("idle: "))


def test_every_bubble_cause_of_every_kind_of_model_has_its_colour(sims):
    """A hybrid's switched-off mixer is a cause of its own (it was drawn in the step-end
    grey, not in the list of causes)."""
    hybrid = simulated_step(mk.preset("qwen3.5-27b"), mk.chip("tpu7x"), context=0, tp=8)
    for s in [*sims.values(), hybrid]:
        assert set(s.bubble_share()) <= set(colours.IDLE_COLOURS) == set(machine.CAUSES)
    assert "skipped mixer" in hybrid.bubble_share()


def test_bubble_bars_stack_hbm_busy_and_each_cause_to_the_step(sims):
    fig = sim_plots.bubble_bars(sims)
    check_rules(fig, y_unit="ms")
    assert fig.data[0].name == "HBM busy"
    causes = [t.name[len("idle: "):] for t in fig.data[1:]]
    assert set(causes) == {c for s in sims.values() for c in s.bubble_share()}
    for i, s in enumerate(sims.values()):
        assert sum(t.y[i] for t in fig.data) == pytest.approx(s.step_ms)
        assert fig.data[0].y[i] == pytest.approx(s.hbm_floor_s * 1e3)
    for t in fig.data[1:]:
        assert t.marker.color == colours.IDLE_COLOURS[t.name[len("idle: "):]]  # the timeline's
    idle = [sum(t.y) for t in fig.data[1:]]
    assert idle == sorted(idle, reverse=True)  # the longest causes first, into the legend
    # every cause at once: HBM busy and the nine longest in the legend, all drawn
    from types import SimpleNamespace
    every = {c: (i + 1) * 1e-6 for i, c in enumerate(machine.CAUSES)}
    fake = SimpleNamespace(hbm_floor_s=1e-3, bubble_share=lambda: every)
    fig = sim_plots.bubble_bars({"all causes": fake})
    assert len(fig.data) == 1 + len(machine.CAUSES) and len(legend(fig)) == plots.LEGEND_ENTRIES
    assert set(legend(fig)[1:]) == {f"idle: {c}" for c in sorted(every, key=every.get)[-9:]}


def test_sweep_lines_and_lines_draw_their_inputs():
    rows = [dict(slots=s, step_ms=ms, hbm_utilisation=u, largest_bubble="ring empty")
            for s, ms, u in ((2, 3.0, 0.5), (4, 2.0, 0.8), (8, None, None))]
    fig = sim_plots.sweep_lines(rows, "slots")
    check_rules(fig, y_unit="ms")
    assert list(fig.data[0].x) == ["2", "4"] and list(fig.data[0].y) == [3.0, 2.0]
    assert [c[0] for c in fig.data[0].customdata] == [0.5, 0.8]
    fig = plots.lines([1, 2, 4], {"a": [1.0, 2.0, 3.0], "b": [3.0, 2.0, 1.0]}, title="t",
                      xaxis="tau (tokens)", yaxis="throughput (tokens/s)")
    check_rules(fig, x_unit="tokens", y_unit="tokens/s")
    assert legend(fig) == ["a", "b"] and list(fig.data[1].y) == [3.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="series 'a' has 1 values for 3 x values"):
        plots.lines([1, 2, 4], {"a": [1.0]}, title="t", xaxis="x", yaxis="y")


# -- Measured traces (notebook 08) -----------------------------------------------------------
def _trace():
    """A made-up trace of one step on 5 thread lines (ns): op i on line i % 5."""
    ops = tuple(profiling.OpEvent(f"op{i}", "m", 0, f"thread {i % 5}", 1000.0 + 300 * i,
                                  200.0 + 50 * (i % 5), 0) for i in range(10))
    return profiling.Timeline("/host:CPU", (profiling.Step(7, 0.0, 5000.0),), ops)


def test_lanes_figure_and_gantt_draw_each_busy_lane_and_the_gaps():
    fig = profile_plots.lanes_figure({"a": [(0.0, 1.0, "x"), (2.0, 3.0, "y")]},
                                 idle=[(1.0, 2.0), (3.0, 3.0)], host=[(3.0, 4.0)],
                                 title="t", x_title="time (µs)")
    check_rules(fig, x_unit="µs")
    assert [t.name for t in fig.data][1:] == ["idle: no op running", "host gap"]
    assert fig.data[0].base == (0.0, 2.0) and fig.data[0].x == (1.0, 1.0)
    assert fig.data[1].x == (1.0,)  # the empty gap is left out
    tl = _trace()
    fig = profile_plots.gantt(tl, profiling.bubbles(tl), 0, max_lines=4)
    check_rules(fig, x_unit="measured on this machine")
    lanes = [t.y[0] for t in fig.data if t.showlegend is False]
    assert len(lanes) == 4 and "thread 0" not in lanes  # the four busiest of five
    busy = next(t for t in fig.data if t.y and t.y[0] == "thread 4")
    assert busy.base == pytest.approx((2.2, 3.7))  # ops 4 and 9, µs from the step start
    assert fig.layout.title.text == "step 7"


def test_share_bars_stack_the_idle_and_host_shares():
    rows = [dict(variant="xla", bubble_share=0.5, host_share=0.2),
            dict(variant="megakernel", bubble_share=0.1, host_share=0.05)]
    fig = profile_plots.share_bars(rows)
    check_rules(fig, y_unit="share")
    assert legend(fig) == ["idle inside the step", "host gap"]
    assert fig.data[0].y == pytest.approx((0.3, 0.05)) and fig.data[1].y == (0.2, 0.05)
    assert list(fig.data[0].x) == ["xla", "megakernel"]
