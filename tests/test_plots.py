"""mk.plots: one colour per category in every timeline, the kernel source on the page, the
TPU picture from the chip rows."""

import pytest

import mk
from mk import plots, sim
from mk.chips import all_chips
from mk.kernels.ring import Ring


def test_every_bubble_cause_has_its_own_fixed_colour():
    assert set(plots.IDLE_COLOURS) == set(sim.CAUSES)
    assert len(set(plots.IDLE_COLOURS.values())) == len(sim.CAUSES)


def test_timeline_colours_by_category_the_same_in_every_figure():
    colours = {}
    for name in ("tiny", "tiny-moe"):
        fig = plots.timeline(sim.simulate(mk.preset(name), "v6e", context=64))
        for trace in fig.data:
            assert colours.setdefault(trace.name, trace.marker.color) == trace.marker.color
    busy = {n for n in colours if not n.startswith("idle: ")}
    assert busy <= set(plots.CATEGORY_COLOURS) and {"DMA", "MXU", "vector"} <= busy


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
        bubbles=[sim.Bubble(0.0, 10e-6, "ring empty", 0, 4.4e-6),  # idle 44 % of its span
                 sim.Bubble(10e-6, 11e-6, "step end", None, 1e-6)])
    opacity = {t.name: list(t.marker.opacity) for t in plots.timeline(run).data}
    assert opacity["idle: ring empty"] == pytest.approx([0.44])
    assert opacity["idle: step end"] == pytest.approx([1.0])
