"""mk.step.preparation: the megakernel's weights laid out one tensor at a time.

Each output equals the whole layout's, donated params are freed, and the peak of preparing
qwen3-4b (8 GB of bf16 weights), replayed from each step's v5e compile on abstract shapes
(no arrays), stays at the prepared weights plus one tensor's relayout: under the chip's
HBM, where keeping the params (the old path) is over it. Nothing here runs on a TPU; the
runtime's own peak (`device.memory_stats()`) is measured on one (issue 60).
"""

import jax
import numpy as np
import pytest

import mk
from mk.step import megakernel, preparation
from mk.model import quant, reference
from mk.measure import tpu
from mk.model.chips import chip
from mk.step.plan import DecodePlan
from mk.model.weights import abstract_params


@pytest.mark.parametrize("name, formats", [
    ("tiny", {}), ("tiny-moe", dict(dense="fp4", experts="int4", lm_head="int8"))])
def test_one_tensor_at_a_time_equals_the_whole_layout_and_donating_frees_the_params(
        name, formats):
    config = mk.preset(name)
    params = quant.quantize(config, mk.init_params(config), **formats)
    plan = DecodePlan.make(config, batch=1, context=128, formats=quant.formats_of(params))
    want = megakernel.Layout(plan)(params)
    given = jax.tree.map(lambda a: a.copy(), params)
    for got in (megakernel.prepare(plan, params),
                megakernel.prepare(plan, given, donate=True)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    assert all(not a.is_deleted() for a in jax.tree.leaves(params))
    read = {n for s in preparation.steps(megakernel.Layout(plan),
                                         preparation.signature(params)) for n in s.reads}
    assert read == set(params)
    assert all(a.is_deleted() for a in jax.tree.leaves(given))


def test_preparing_qwen3_4b_holds_one_copy_and_a_tensor_on_v5e():
    """Replayed from v5e compiles: donated, 9.89 GiB = 8.22 prepared + w_gate's 1.67 in
    flight (a stacked matrix relaid a layer at a time; whole it took a temporary of twice
    its size: 11.56); the params kept, 15.71 (both copies), and the old path's 16.24
    (eager, whole tensors) was over v5e's 15.75: the OOM seen on the chip."""
    config = mk.preset("qwen3-4b")
    plan = DecodePlan.make(config, batch=1, context=1024, chip="v5e")
    step = tpu.step_compiler("v5e")
    layout, params = megakernel.Layout(plan), abstract_params(config)
    kept = preparation.peak(layout, params, donate=False, compile_step=step)
    given = preparation.peak(layout, params, donate=True, compile_step=step)
    assert kept["peak"] >= kept["params"] + kept["prepared"]
    assert given["prepared"] + given["largest"] <= given["peak"]
    assert given["peak"] <= (given["prepared"] + given["largest"]) * 1.01
    assert given["peak"] + plan.fits("v5e").hbm_bytes - given["prepared"] < chip(
        "v5e").hbm_compile_bytes  # with the KV cache


def test_generate_with_donated_params_gives_the_references_tokens_and_frees_them():
    config = mk.preset("tiny")
    params = mk.init_params(config)
    given = jax.tree.map(lambda a: a.copy(), params)
    want = reference.generate(config, params, [[3, 1, 4]], 3, max_context=16)
    got = megakernel.generate(config, given, [[3, 1, 4]], 3, max_context=16, donate=True)
    np.testing.assert_array_equal(got, want)
    assert all(a.is_deleted() for a in jax.tree.leaves(given))
