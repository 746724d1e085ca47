"""mk.plots: one colour per category in every timeline, the kernel source on the page, the
TPU picture from the chip rows."""

import math
import re

import pytest

import mk
from mk import colours, figure_rules, plots, sim_plots
from mk.cost import feed_costs, machine, sim
from mk.course import teach
from mk.kernels.common import BlockSizes
from mk.kernels.stream import Repeat, TileStream
from mk.model.chips import all_chips
from mk.kernels.ring import Ring
from builders import simulated_step


def test_every_bubble_cause_has_its_own_fixed_colour():
    assert set(colours.IDLE_COLOURS) == set(machine.CAUSES)
    assert len(set(colours.IDLE_COLOURS.values())) == len(machine.CAUSES)


def test_timeline_colours_by_category_the_same_in_every_figure():
    seen = {}
    for name in ("tiny", "tiny-moe"):
        fig = sim_plots.timeline(simulated_step(mk.preset(name), "v6e", context=64))
        for trace in fig.data:
            assert seen.setdefault(trace.name, trace.marker.color) == trace.marker.color
    busy = {n for n in seen if not n.startswith("idle: ")}
    assert busy <= set(colours.CATEGORY_COLOURS) and {"DMA", "MXU", "vector"} <= busy


def test_show_source_is_the_modules_code():
    text = plots.show_source(Ring.matmul).data
    assert "# mk.kernels.ring, line" in text and "lax.fori_loop" in text
    with pytest.raises(ValueError, match="lines=\\(5, 1\\)"):
        plots.show_source(Ring.matmul, lines=(5, 1))


def test_tpu_picture_labels_each_unit_with_its_chip_row_and_refuses_a_gpu():
    for spec in all_chips("tpu"):
        text = " ".join(plots.tpu_picture(spec).data[0].text)
        assert f"{spec.mxu_rows} x {spec.mxu_rows}" in text
        assert f"{spec.vmem_bytes >> 20} MiB" in text and f"{spec.hbm_bw / 1e9:,.0f} GB/s" in text
    with pytest.raises(ValueError, match="kind='gpu'"):
        plots.tpu_picture(mk.chip("h200"))


def test_timeline_draws_a_partly_idle_run_translucent_and_a_fully_idle_one_solid():
    from types import SimpleNamespace
    run = SimpleNamespace(
        config_name="x", chip_name="v6e", events=[],
        bubbles=[machine.Bubble(0.0, 10e-6, "ring empty", 0, 4.4e-6),  # idle 44 % of its span
                 machine.Bubble(10e-6, 11e-6, "step end", None, 1e-6)])
    opacity = {t.name: list(t.marker.opacity) for t in sim_plots.timeline(run).data}
    assert opacity["idle: ring empty"] == pytest.approx([0.44])
    assert opacity["idle: step end"] == pytest.approx([1.0])


def _schedules(stream, depths=(1, 2, 6)):
    return {f"{n} slots": teach.ring_schedule(stream, slots=n, latency_s=0.5e-6,
                                              dma_s=0.05e-6, compute_s=0.02e-6)
            for n in depths}


def test_ring_gantt_has_units_few_legend_entries_and_weight_colours():
    stream = TileStream.build(BlockSizes(slots=1, tile_rows=128, tile_cols=128), [
        (n, 256, 256) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")])
    fig = plots.ring_gantt(_schedules(stream), title="t")
    assert figure_rules.check(fig) == []
    assert "µs" in fig.layout.xaxis.title.text
    assert [f.name for f in fig.frames] == ["1 slots", "2 slots", "6 slots"]
    assert [s.label for s in fig.layout.sliders[0].steps] == ["1 slots", "2 slots", "6 slots"]


def test_show_adds_a_figures_frames_without_playing_them_on_load(monkeypatch):
    """plotly's to_html plays the frames on load unless told not to; a slider click during
    that play rejects its promise, an uncaught JavaScript error ("undefined") on the page."""
    stream = TileStream.build(BlockSizes(slots=1, tile_rows=128, tile_cols=128),
                              [("wq", 256, 256)])
    shown = []
    monkeypatch.setattr(plots, "display", lambda bundle, raw: shown.append(bundle))
    plots.show(plots.ring_gantt(_schedules(stream), title="t"))
    html = shown[0]["text/html"]
    assert "Plotly.addFrames(" in html and "Plotly.animate(" not in html
    assert [f["name"] for f in shown[0]["application/vnd.plotly.v1+json"]["frames"]] == [
        "1 slots", "2 slots", "6 slots"]


def test_show_fixes_an_animated_figures_axes_to_hold_every_frame(monkeypatch):
    """plotly keeps the first frame's autorange through an animation: from a 1-slot first
    frame, the 6-slot frame would draw slot 0 only (the ring Gantt of af5b9de)."""
    stream = TileStream.build(BlockSizes(slots=1, tile_rows=128, tile_cols=128),
                              [("wq", 256, 256), ("wo", 256, 256)])
    schedules = _schedules(stream)
    fig = plots.ring_gantt(schedules, title="t")
    assert fig.layout.yaxis.range is None  # as built: plotly would autorange frame 1
    shown = []
    monkeypatch.setattr(plots, "display", lambda bundle, raw: shown.append(bundle))
    plots.show(fig)
    layout = shown[0]["application/vnd.plotly.v1+json"]["layout"]
    assert layout["yaxis"]["range"] == [5.5, -0.5]  # reversed: slot 0 on top, 6 slots
    assert layout["yaxis"]["categoryarray"][:6] == [f"slot {s}" for s in range(6)]
    lo, hi = layout["xaxis"]["range"]
    times = [t[k] * 1e6 for rows in schedules.values() for t in rows for k in ("issue", "end")]
    assert lo < min(times) and max(times) < hi
    assert layout["xaxis"]["autorange"] is False and layout["yaxis"]["autorange"] is False


def test_tile_stream_colours_each_family_once_in_every_figure():
    block = BlockSizes(slots=3, tile_rows=128, tile_cols=128)
    moe = TileStream.build(block, [("wq", 256, 256), Repeat(4, (("we_gate", 256, 128),
                                                                ("we_up", 256, 128),
                                                                ("we_down", 128, 256)))])
    assert figure_rules.check(plots.tile_stream(moe)) == []
    assert colours.weight_colour("we_gate[3]") == colours.WEIGHT_COLOURS["we_gate"]
    # a hybrid's step streams 12 matrices: one row each, named on the axis, no legend of 12
    # (notebook 06's tiny-hybrid run broke the legend rule before)
    names = ("lin_qkv", "lin_z", "lin_out", "wq", "wk", "wv", "wq_gate", "wo", "w_gate",
             "w_up", "w_down", "lm_head")
    hybrid = TileStream.build(block, [(n, 128, 128) for n in names])
    assert figure_rules.check(plots.tile_stream(hybrid)) == []


def test_ring_schedule_is_the_simulators_replay_of_one_matrix():
    spec = mk.chip("v6e")
    a = sim.Assumptions()
    bw = spec.device_hbm_bw
    d = 128 * 128 * 2 / bw
    c = feed_costs.tile_s(spec, "bf16", 1, 128 * 128, a.rate_end)  # the simulator's cost
    for n in (1, 2, 3, 14):
        stream = TileStream.build(BlockSizes(slots=n, tile_rows=128, tile_cols=128),
                                  [("w", 1024, 1024)])
        rows = teach.ring_schedule(stream, slots=n, latency_s=a.dma_latency_s, dma_s=d,
                                   compute_s=c)
        assert rows[-1]["end"] == pytest.approx(sim.replay_matmul(stream, spec,
                                                                  rows=1).step_s, rel=1e-9)
        assert all(r["issue"] <= r["land"] <= r["start"] < r["end"] for r in rows)


def test_kv_tile_map_counts_the_kernels_tiles_and_labels_its_axes():
    from mk.kernels.kv_stream import tile_counts
    positions, rows, tile = [127, 300, 5], 2, 128
    fig = plots.kv_tile_map(positions, rows, tile, 512)
    bars = {t.name: len(t.base) for t in fig.data}
    read, written = tile_counts(positions, rows, tile)
    assert bars["read"] + bars["read and written back"] == read
    assert bars["read and written back"] == written
    assert bars["skipped"] == 3 * 4 - read
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text and len(fig.data) <= 10


def test_idle_expert_slots_are_skipped_in_order_and_drawn_grey():
    block = BlockSizes(slots=3, tile_rows=128, tile_cols=128)
    stream = TileStream.build(block, [("wq", 256, 256), Repeat(4, (
        ("we_gate", 256, 128), ("we_up", 256, 128), ("we_down", 128, 256)))])
    active = teach.first_copies(2)  # the router picked two experts: slots 2 and 3 are off
    times = dict(slots=3, latency_s=0.5e-6, dma_s=0.05e-6, compute_s=0.02e-6)
    rows = teach.ring_schedule(stream, active=active, **times)
    off = [r for r in rows if r["skipped"]]
    assert len(off) == 2 * 6 and all(r["start"] == r["end"] for r in off)
    assert rows[-1]["end"] < teach.ring_schedule(stream, **times)[-1]["end"]
    fig = plots.ring_gantt({"3 slots": rows}, title="t")
    assert figure_rules.check(fig) == []
    grey = next(t for t in fig.data if t.name.startswith("skipped"))
    assert len(grey.x) == len(off)


def test_knobs_are_a_widget_for_a_reader_and_the_defaults_in_a_headless_run(monkeypatch):
    import ipywidgets

    calls, shown = [], []
    monkeypatch.setattr(plots, "display", shown.append)

    def panel(tau=6, chip="tpu7x"):
        calls.append((tau, chip))

    monkeypatch.setenv(plots.HEADLESS, "1")
    plots.knobs(panel, tau=(1, 8), chip=["v5e", "tpu7x"])
    assert calls == [(6, "tpu7x")] and shown == []  # the defaults, no widget
    monkeypatch.delenv(plots.HEADLESS)
    plots.knobs(panel, tau=(1, 8), chip=["v5e", "tpu7x"])
    assert len(shown) == 1 and isinstance(shown[0], ipywidgets.interactive)
    assert calls[-1] == (6, "tpu7x")  # interactive draws its first state at once


def test_table_cells_are_padded_and_numbers_right_aligned():
    """Unpadded cells ran the numbers of neighbouring columns together (00's tables)."""
    html = plots.table([{"preset": "qwen3-0.6b", "GB": "1.19", "ratio": "2.10x"}])._repr_html_()
    cells = re.findall(r'<(t[hd]) style="([^"]*)">([^<]*)<', html)
    assert len(cells) == 6 and all("padding: 0.2em 0.8em" in style for _, style, _ in cells)
    aligned = {text: style.rsplit("text-align: ", 1)[-1] for tag, style, text in cells
               if tag == "td"}
    assert aligned == {"qwen3-0.6b": "left", "1.19": "right", "2.10x": "right"}


@pytest.mark.parametrize("call, message", [
    (lambda s: sim_plots.timeline("abc"), r"sims\[''\] is a str; a figure of a simulated"),
    (lambda s: sim_plots.bubble_bars({"a": 3}), r"sims\['a'\] is a int"),
    (lambda s: sim_plots.timeline(s, layers=(1, 0)), r"layers=\(1, 0\) must be \(first, last\)"),
    (lambda s: sim_plots.timeline(s, layers=(0, 1.5)), r"layers=\(0, 1\.5\) must be"),
    (lambda s: sim_plots.timeline(s, window_s=(0.0, math.nan)), r"window_s=\(0\.0, nan\)")])
def test_simulation_figures_refuse_what_is_no_simulation_or_an_empty_span(call, message):
    """Issue 65: a string was an AttributeError inside the figure, and layers the wrong way
    round drew an empty figure silently."""
    step = simulated_step(mk.preset("tiny"), "v6e", context=64)
    with pytest.raises(ValueError, match=message):
        call(step)
    assert sim_plots.timeline(step, layers=(0, 0), window_s=(0, 1e-3)).data
