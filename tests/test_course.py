"""mk.course.course and mk.course.teach: every break-it exercise's check fails with the planted
mistake and passes without it (the real kernels on the tiny presets, interpret mode); each fix
exercise's check fails on the broken piece and passes on the fixed one; the mystery lab's
plant is caught by its check and the named tool and a fixed copy passes; each teaching
kernel equals the real module on the same inputs and stays short; and the notebooks'
defaults hit the hard paths (non-zero, tile-straddling positions; experts that are not a
prefix; accepted drafts), read from the notebooks' own parameters cells.

Interpret mode checks numerics and races, not time; the shallow-ring exercise is the
simulator's.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import jupytext
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import mk
import mk.kernels.common
from mk.kernels import backend, jax_private
from mk.course import course, grading, scopes, teach
from mk.model import ops, reference
from mk.cost import sim
from mk.speculative import spec
from mk.kinds.attention import attention_prologue as prologue_module
from mk.kernels import collectives, ring
from mk.kinds.mlp import mlp
from mk.step import one_layer
from mk.kinds.attention.attention_prologue import attention_prologue
from mk.kinds.attention.decode_attention import decode_attention
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan
from mk.kernels.stream import TileStream
from mk.kernels.weight_streaming import stream_matmul
from multidevice import run
from builders import simulated_step

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@functools.cache
def parameters(notebook: str) -> dict:
    """The values the `parameters` cell of notebooks/<notebook>.py assigns."""
    text = (NOTEBOOKS / f"{notebook}.py").read_text()
    cell = text.split('# %% tags=["parameters"]\n', 1)[1].split("\n# %%", 1)[0]
    out = {}
    for node in ast.parse(cell).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        out[target.id] = ast.literal_eval(node.value)
    return out


# -- Exercises: planted mistake caught, no mistake passes --------------------------------------
def _ring_check(plant):
    w = jax.random.normal(jax.random.key(0), (256, 256)).astype("bfloat16")
    x = jax.random.normal(jax.random.key(1), (1, 256))
    with course.planted(plant), backend.use("interpret", detect_races=True):
        jax.block_until_ready(stream_matmul(x, w, block=BlockSizes(slots=3, tile_rows=128,
                                                                    tile_cols=128)))
        course.check_race_free("ring", backend.races_found())


def test_ring_race_exercise_caught_by_the_race_detector():
    _ring_check(None)
    with pytest.raises(course.ExerciseFailed, match="race detector flagged"):
        _ring_check("ring_race")


def _rope_check(plant, positions, rows=2):
    config = mk.preset("tiny")
    params = mk.init_params(config)
    x = jax.random.normal(jax.random.key(0), (len(positions), rows, config.hidden))
    positions = np.asarray(positions, np.int32)
    want = reference.attention_inputs(config, params, 0, x, positions)
    with course.planted(plant), backend.use("interpret"):
        got = jax.block_until_ready(attention_prologue(
            config, params, x, positions, layer=0,
            block=BlockSizes(slots=3, tile_rows=128, tile_cols=128)))
    course.check_close("q", got[0], want[0], atol=1e-4)


def test_rope_off_is_caught_at_a_nonzero_position_and_missed_at_zero():
    _rope_check(None, [127])
    with pytest.raises(course.ExerciseFailed, match="q: kernel and reference differ"):
        _rope_check("rope_off", [127])
    _rope_check("rope_off", [0], rows=1)  # why the defaults start away from position 0


def _moe_check(plant, router_seed):
    config = mk.preset("tiny-moe")
    weights, h, _ = course.moe_inputs(config, 0, router_seed, 1)
    want = ops.moe(h, *weights, config.experts_per_token, config.norm_topk)
    with course.planted(plant), backend.use("interpret"):
        got = jax.block_until_ready(mlp.moe(
            h, *weights, top_k=config.experts_per_token, renormalise=config.norm_topk,
            block=BlockSizes(slots=3, tile_rows=128, tile_cols=128)))
    course.check_close("moe", got, want, atol=1e-3)


def test_wrong_expert_exercise_caught_with_the_default_router_seed():
    seed = parameters("04_mlp_and_moe")["router_seed"]
    _moe_check(None, seed)
    with pytest.raises(course.ExerciseFailed, match="moe: kernel and reference differ"):
        _moe_check("wrong_expert", seed)
    _moe_check("wrong_expert", 0)  # seed 0 picks experts [0, 1]: the mistake hides


def dropped_all_reduce_results(n):
    """Runs in the subprocess: the all-reduce kernel on n devices, with and without the
    planted mistake."""
    x = np.random.default_rng(0).standard_normal((n, 8, 128), np.float32)
    out = {"x": x}
    for plant in ("", "dropped_all_reduce"):
        with course.planted(plant), backend.use("interpret"):
            out[plant or "clean"] = jax.block_until_ready(
                collectives.all_reduce(x, collectives.tp_mesh(n)))
    return out


def test_dropped_all_reduce_exercise_caught_and_the_teaching_all_reduce_equals_the_kernel():
    got = run("test_course:dropped_all_reduce_results", 2)
    want = np.stack([collectives.tree_sum(got["x"])] * 2)  # each device: the same sum
    course.check_close("all-reduce", got["clean"], want, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(teach.all_reduce(got["x"])), got["clean"])
    with pytest.raises(course.ExerciseFailed, match="all-reduce: kernel and reference differ"):
        course.check_close("all-reduce", got["dropped_all_reduce"], want, atol=1e-5)


def test_shallow_ring_exercise_caught_against_littles_law_depth():
    p = parameters("11_design_review")
    config, chip = mk.preset(p["preset"]), p["chip"]
    block = DecodePlan.make(config, position=p["context"]).block
    deep = dataclasses.replace(block, slots=sim.latency_slots(config, chip, block))

    def step(b):
        return simulated_step(config, chip, context=p["context"], block=b)

    deep_sim = step(deep)
    assert course.check_ring_depth(deep_sim, deep_sim) == 1.0
    with pytest.raises(course.ExerciseFailed, match="ring too shallow"):
        course.check_ring_depth(step(dataclasses.replace(block, slots=2)), deep_sim)


def test_a_wrong_up_rotation_is_caught_against_the_kernels_split():
    """05c's exercise: up's 32 lanes come to lane 0 by a rotation of 96 (jnp.roll's
    direction), not 32 (the other way)."""
    with backend.use("interpret"):
        course.check_up_rotation(96)
        with pytest.raises(course.ExerciseFailed, match="up's lanes after your rotation"):
            course.check_up_rotation(32)


def test_check_up_rotation_outside_backend_use_grades_the_answer():
    """Run on the CPU outside `backend.use`, the check runs the split in interpret mode
    and grades the rotation (issue 65: it failed deep in Pallas lowering)."""
    assert not backend.active()
    course.check_up_rotation(96)
    with pytest.raises(course.ExerciseFailed, match="up's lanes after your rotation"):
        course.check_up_rotation(32)


def test_check_tokens_names_the_first_difference():
    course.check_tokens("tp", np.array([[1, 2, 3]]), np.array([[1, 2, 3]]))
    with pytest.raises(course.ExerciseFailed, match="sequence 0, step 2: got 4, reference 3"):
        course.check_tokens("tp", np.array([[1, 2, 4]]), np.array([[1, 2, 3]]))
    with pytest.raises(course.ExerciseFailed, match="its only token: got 3, reference 4"):
        course.check_tokens("t", 3, 4)  # two different single tokens once passed
    with pytest.raises(course.ExerciseFailed, match="step 1: got 5, reference 2"):
        course.check_tokens("t", [1, 5], np.array([1, 2]))


def test_planted_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="planted name='rope'"):
        with course.planted("rope"):
            pass


def test_missing_rescale_fails_the_attention_check_and_the_fix_passes():
    with pytest.raises(course.ExerciseFailed, match="attention over two KV tiles"):
        course.check_attend_update(course.update_without_rescale)
    assert course.check_attend_update(teach.online_softmax_update) < 2e-2


def _one_layer_error(plant, fix=None):
    """The fused layer against the reference, with plant `plant` in, or `fix` in its place."""
    config = mk.preset("tiny")
    params = mk.init_params(config, 0)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (1, 2, config.hidden))
    shape = (config.layers, 1, config.kv_heads, 256, config.head_dim)
    k, v = (jax.random.normal(key, shape).astype(config.dtype) for key in keys[1:])
    positions = jnp.asarray(course.hard_positions(1, 2, 256))
    want = reference.decoder_layer(config, params, 0, x, k[0], v[0], positions)[0]
    patch = course.replaced(plant, fix) if fix is not None else course.planted(plant)
    with patch, backend.use("interpret"):
        got = one_layer.one_layer(config, params, x, k, v, positions, layer=0)[0]
    course.check_close("layer output", got, want, rtol=2e-2, atol=3e-2)


def test_wrong_residual_exercise_caught_in_one_layer():
    _one_layer_error(None)
    with pytest.raises(course.ExerciseFailed, match="layer output"):
        _one_layer_error("wrong_residual")


def test_accept_on_the_wrong_row_caught_by_forced_acceptance():
    config = mk.preset("tiny")
    params = mk.init_params(config, 0)
    prompt = jax.random.randint(jax.random.key(0), (1, 5), 0, config.vocab)
    assert course.check_acceptance(config, params, prompt, 8) == 3
    with course.planted("accept_wrong_row"), pytest.raises(course.ExerciseFailed,
                                                           match="measured tau"):
        course.check_acceptance(config, params, prompt, 8)


def test_a_window_masked_but_not_skipped_loads_tiles_it_need_not():
    """05d's exercise: with "window_unskipped" the kernel's output is unchanged on a finite
    cache (the mask keeps the window) but it loads every tile from 0: the count the
    notebook checks sees it."""
    W, tile, H = 16, 16, 128
    positions = jnp.array([70], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, 4 * H))
    new = [jax.random.normal(k, (1, 2 * H)) for k in keys[1:3]]
    cache = jax.random.normal(keys[3], (1, 1, 2, 128, H))

    def loaded():
        with mk.kernels.common.dma_log() as log, backend.use("interpret"):
            o, _, _ = decode_attention(q, *new, cache, cache, positions, sinks=jnp.zeros(4),
                                       window=W, block=BlockSizes(kv_tile=tile, kv_slots=2))
            jax.block_until_ready(o)
        return o, sum(what == "k_tile" for what, _ in log)

    right, tiles = loaded()
    with course.planted("window_unskipped"):
        wrong, planted_tiles = loaded()
    np.testing.assert_allclose(wrong, right, rtol=1e-5, atol=1e-5)
    assert (tiles, planted_tiles) == (2, 5)  # positions 55 .. 70: tiles 3, 4; or 0 .. 4


# Mystery 0 in CI (and notebook 06 runs its lab); the others, ~25 CPU s each, under slow.
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow)
                                       for s in range(1, len(course.MYSTERIES)))])
def test_mystery_is_caught_localised_and_fixed(seed):
    m = course.mystery(seed)
    with pytest.raises(course.ExerciseFailed, match="megakernel step"):
        m.check()
    real = {"ring_race": ring.Ring.slot, "rope_off": prologue_module.rope_rows,
            "wrong_residual": one_layer.residual}[m._plant]
    assert m.released() is real
    assert "Found it" in m.suspect(m.where()).data
    if m._plant == "ring_race":
        assert m.races()
    else:
        first, _ = m.divergence()
        assert first == (0, "attn" if m._plant == "rope_off" else "mlp"), first
    assert "runs as released" in m.suspect("mk.kinds.mlp.mlp.moe_fetch").data
    assert m.confirm(real).startswith("fixed")


def test_reveal_refuses_an_unknown_key_and_shows_a_known_one():
    shown = course.reveal("03-rescale").data
    assert "alpha" in shown and inspect.getsource(teach.online_softmax_update) in shown
    with pytest.raises(ValueError, match="answer key='nope'"):
        course.reveal("nope")


# -- Fix exercises: stubs in the notebooks, worked solutions in mk.course.solutions
# ------------------
def _stub_like(fn):
    """A stub of fn's arguments whose body is `...` (it returns None), as a notebook ships."""
    space: dict = {}
    exec(f"def stub({', '.join(inspect.signature(fn).parameters)}):\n    ...\n", space)
    return space["stub"]


def _accept_check(fn):
    config = mk.preset("tiny")
    params = mk.init_params(config, 0)
    prompt = jax.random.randint(jax.random.key(0), (1, 5), 0, config.vocab)
    with course.replaced("accept_wrong_row", fn):
        return course.check_acceptance(config, params, prompt, 8)


# Each fix exercise's check, as its notebook runs it; "08-scope" compiles with libtpu, so
# its two ways are test_a_scope_added_to_the_kernel_has_its_own_bundles_in_the_dump's.
FIX_CHECKS = {"00c-copy": course.check_copy_kernel,
              "01-ring": course.check_ring_kernel,
              "03-tile": course.check_attend_tile,
              "03-rescale": course.check_attend_update,
              "04-compact": course.check_compact_experts,
              "05-residual": lambda fn: _one_layer_error("wrong_residual", fn),
              "09-accept": _accept_check,
              "11b-allreduce": course.check_allreduce_s}


def test_every_worked_solution_has_a_fix_check_and_an_answer():
    assert set(FIX_CHECKS) | {"08-scope"} == set(course.SOLUTIONS)
    assert set(course.SOLUTIONS) <= set(course.ANSWERS)


@pytest.mark.parametrize("key", FIX_CHECKS)
def test_a_fix_check_fails_the_stub_and_passes_the_worked_solution(key):
    with pytest.raises(course.ExerciseFailed, match="expected|differ"):
        FIX_CHECKS[key](_stub_like(course.SOLUTIONS[key]))
    FIX_CHECKS[key](course.SOLUTIONS[key])


def _ring_kernel_with(refill_first=False, read_hbm=False):
    """`teach.ring_matmul_kernel` with one of a learner's likely mistakes: the refill of
    tile g + slots started before the dot that reads slot g % slots, or W read straight
    from HBM with no copy."""
    def kernel(x_vmem, w_hbm, out_vmem, slots_vmem, sems, *, tile):
        K, N = w_hbm.shape
        slots, steps = slots_vmem.shape[0], K // tile
        total = steps * (N // tile)

        def dma(g):
            i, j = g % steps, g // steps
            src = w_hbm.at[pl.ds(i * tile, tile), pl.ds(j * tile, tile)]
            return pltpu.make_async_copy(src, slots_vmem.at[g % slots], sems.at[g % slots])

        if read_hbm:
            out_vmem[...] = jnp.dot(x_vmem[...], w_hbm[...], preferred_element_type=jnp.float32)
            return
        for g in range(min(slots, total)):
            dma(g).start()

        def consume(g, carry):
            i, j = g % steps, g // steps
            dma(g).wait()
            if refill_first:
                @pl.when(g + slots < total)
                def early():
                    dma(g + slots).start()
            part = jnp.dot(x_vmem[:, pl.ds(i * tile, tile)], slots_vmem[g % slots],
                           preferred_element_type=jnp.float32)
            cols = pl.ds(j * tile, tile)
            out_vmem[:, cols] = jnp.where(i == 0, part, out_vmem[:, cols] + part)
            if not refill_first:
                @pl.when(g + slots < total)
                def refill():
                    dma(g + slots).start()
            return carry

        lax.fori_loop(0, total, consume, 0)
    return kernel


@pytest.mark.parametrize("mistake, message", [
    (dict(refill_first=True), "flagged a race"),
    (dict(read_hbm=True), "cannot be referenced directly")])
def test_the_ring_kernels_check_catches_a_learners_likely_mistakes(mistake, message):
    """The guard of check_ring_kernel's pass: the same kernel with the copies right
    passes, and each mistake fails the exercise, the race with a right product."""
    assert course.check_ring_kernel(_ring_kernel_with()) < 1e-2
    with pytest.raises(course.ExerciseFailed, match=message):
        course.check_ring_kernel(_ring_kernel_with(**mistake))


def _copy_without_waiting_out(x_hbm, o_hbm, buf_vmem, sems, *, block_rows):
    """`teach.hand_copy_kernel` with `copy_out.wait()` dropped: no copy out is waited for."""
    def one_block(i, carry):
        rows = pl.ds(i * block_rows, block_rows)
        copy_in = pltpu.make_async_copy(x_hbm.at[rows], buf_vmem, sems.at[0])
        copy_in.start()
        copy_in.wait()
        pltpu.make_async_copy(buf_vmem, o_hbm.at[rows], sems.at[1]).start()
        return carry

    lax.fori_loop(0, x_hbm.shape[0] // block_rows, one_block, 0)


def _copy_of_the_first_block(x_hbm, o_hbm, buf_vmem, sems, *, block_rows):
    """Every block of the output copied from x's first block: the window never moves."""
    def one_block(i, carry):
        copy_in = pltpu.make_async_copy(x_hbm.at[pl.ds(0, block_rows)], buf_vmem, sems.at[0])
        copy_out = pltpu.make_async_copy(buf_vmem, o_hbm.at[pl.ds(i * block_rows, block_rows)],
                                         sems.at[1])
        copy_in.start()
        copy_in.wait()
        copy_out.start()
        copy_out.wait()
        return carry

    lax.fori_loop(0, x_hbm.shape[0] // block_rows, one_block, 0)


@pytest.mark.parametrize("kernel, message", [
    (course.copy_out_before_wait, "flagged a race"),
    (_copy_without_waiting_out, "never waited for"),
    (_copy_of_the_first_block, "differ")])
def test_the_copy_kernels_check_catches_a_learners_likely_mistakes(kernel, message):
    """00c's exercise: the copy out started before the copy in is waited for (right values
    in interpret mode, a race), a copy out never waited for, a window that never moves."""
    with pytest.raises(course.ExerciseFailed, match=message):
        course.check_copy_kernel(kernel)
def _attend_tile_with(mask="right"):
    """`teach.attend_tile` as a learner might write it: mask "right" (s <= position + t),
    "own key hidden" (s < position + t), "none", or "head's row" (t read as r // T, the
    head, in place of r % T)."""
    def tile(m, l, acc, q, k, v, start, position, *, rows, update):
        q = q.astype(k.dtype)
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) / math.sqrt(q.shape[1])
        r = lax.broadcasted_iota(jnp.int32, scores.shape, 0)
        s = start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        t = r // rows if mask == "head's row" else r % rows
        visible = {"own key hidden": s < position + t, "none": s >= 0}.get(
            mask, s <= position + t)
        return update(m, l, acc, jnp.where(visible, scores, -jnp.inf), v)
    return tile


@pytest.mark.parametrize("mask", ["own key hidden", "none", "head's row"])
def test_the_attend_tiles_check_catches_a_learners_likely_masks(mask):
    """The guard of check_attend_tile's pass: the right mask written another way passes;
    a mask off by one key, no mask, or the head's index for the row's fails."""
    assert course.check_attend_tile(_attend_tile_with()) < 5e-3
    with pytest.raises(course.ExerciseFailed, match="differ"):
        course.check_attend_tile(_attend_tile_with(mask))


def _compaction_with(mistake=None):
    """`teach.compact_experts_kernel` written another way (each expert in order, kept if
    some pick equals it), or with one of a learner's likely mistakes: "unsorted" (the
    picks appended in row order, each once), "duplicates kept" (every pick appended),
    "counted" (a count per expert where the spec says a flag), "half the picks" or
    "E - 1" (an expert dropped), "unpadded" (the slots after count left as they were)."""
    def kernel(picked_smem, ids_smem, count_smem, seen_smem):
        E, slots, n = seen_smem.shape[0], ids_smem.shape[0], picked_smem.shape[0]

        def clear(e, carry):
            seen_smem[e] = 0
            return carry

        def flag(i, carry):
            e = picked_smem[i]
            seen_smem[e] = seen_smem[e] + 1 if mistake == "counted" else 1
            return carry

        def take(e, count):
            @pl.when(seen_smem[e] > 0)
            def write():
                ids_smem[count] = e
            return count + seen_smem[e]

        def append(i, count):
            e = picked_smem[i]
            fresh = (seen_smem[e] == 0) | (mistake == "duplicates kept")

            @pl.when(fresh)
            def write():
                ids_smem[count] = e
                seen_smem[e] = 1
            return count + fresh.astype(jnp.int32)

        def member(e, count):
            hit = lax.fori_loop(0, n, lambda i, h: h | (picked_smem[i] == e), False)

            @pl.when(hit)
            def write():
                ids_smem[count] = e
            return count + hit.astype(jnp.int32)

        def pad(s, carry):
            ids_smem[s] = ids_smem[s - 1]
            return carry

        lax.fori_loop(0, E, clear, 0)
        if mistake in (None, "E - 1"):
            count = lax.fori_loop(0, E - (mistake == "E - 1"), member, jnp.int32(0))
        elif mistake in ("unsorted", "duplicates kept"):
            count = lax.fori_loop(0, n, append, jnp.int32(0))
        else:
            lax.fori_loop(0, n // 2 if mistake == "half the picks" else n, flag, 0)
            count = lax.fori_loop(0, E, take, jnp.int32(0))
        if mistake != "unpadded":
            lax.fori_loop(count, slots, pad, 0)
        count_smem[0] = count
    return kernel


@pytest.mark.parametrize("mistake", ["unsorted", "duplicates kept", "counted",
                                     "half the picks", "E - 1", "unpadded"])
def test_the_compactions_check_catches_a_learners_likely_mistakes(mistake):
    """The guard of check_compact_experts's pass: a right compaction written another way
    passes, through the teaching experts too; each mistake fails, saying the ids."""
    assert course.check_compact_experts(_compaction_with()) < 1e-3
    with pytest.raises(course.ExerciseFailed, match=r"expected ids \[2, 5, 7, 7, 7, 7\]"):
        course.check_compact_experts(_compaction_with(mistake))


def test_the_teaching_compaction_gives_the_slots_routed_gives():
    config = mk.preset("tiny-moe")
    weights, h, experts = course.moe_inputs(config, 0, 3, 4)
    _, ids, count = course.routed(config, h, weights[0])
    _, picked = ops.route(h, weights[0], config.experts_per_token, config.norm_topk)
    with backend.use("interpret"):
        got_ids, got_count = teach.compact_experts(picked, config.experts)
    assert got_ids.tolist() == ids and got_count.tolist() == [count] == [len(experts)]


def my_update(m, l, acc, scores, v):
    """A learner's untouched stub."""
    ...


def test_attempt_fails_an_untouched_stub_saying_what_to_do(capsys):
    with pytest.raises(course.ExerciseFailed, match=r"your my_update is still the stub .*"
                       r"write its body in place of the `...`.*course.reveal\('03-rescale'\)"):
        course.attempt("03-rescale", my_update, False)
    assert course.attempt("03-rescale", teach.attend, False) is teach.attend
    assert course.attempt("03-rescale", my_update, True) is teach.online_softmax_update
    assert "runs the worked solution, mk.course.teach.online_softmax_update, in place of your " \
        "my_update" in capsys.readouterr().out
    for call, message in ((lambda: course.attempt("03-rescal", my_update, False), "answer key"),
                          (lambda: course.attempt("03-rescale", my_update, "yes"),
                           "solutions='yes' must be True or False")):
        with pytest.raises(ValueError, match=message):
            call()


def _body(fn: ast.FunctionDef) -> str:
    """A function's body without its docstring, as AST text (comments and layout dropped)."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def _source_body(fn) -> str:
    return _body(ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0])


def _attempts():
    """(notebook, key, the learner's function's definition) of every course.attempt call of
    the notebooks' code cells; the function is defined in the call's cell."""
    out = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.py")):
        for cell in jupytext.read(path).cells:
            if cell.cell_type != "code" or "course.attempt(" not in cell.source:
                continue
            tree = ast.parse(cell.source)
            defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "course.attempt":
                    key, fn, _ = node.args
                    out.append((path.stem, key.value, defs[fn.id]))
    return out


def test_notebooks_ship_each_fix_as_a_stub_never_the_worked_solution():
    """Each worked solution is attempted by a notebook cell whose function is a stub: its
    body `...`, or the exercise's given code to edit (08: `norm_then_matmul`)."""
    given = {"08-scope": _source_body(scopes.norm_then_matmul)}
    stub = _body(ast.parse("def f():\n    ...\n").body[0])
    found = _attempts()
    assert sorted(key for _, key, _ in found) == sorted(course.SOLUTIONS), found
    for notebook, key, fn in found:
        assert _body(fn) in (stub, given.get(key)), (notebook, key, ast.unparse(fn))
        assert _body(fn) != _source_body(course.SOLUTIONS[key]), (notebook, key)


# -- Teaching kernels equal the real modules -------------------------------------------------
@pytest.mark.parametrize("block_rows", [8, 16])
def test_teaching_copies_equal_their_input_and_are_race_free(block_rows):
    x = jax.random.normal(jax.random.key(0), (32, 256)).astype("bfloat16")
    with backend.use("interpret", detect_races=True, strict_dma=True):
        by_blocks = teach.block_copy(x, block_rows=block_rows)
        by_hand = teach.hand_copy(x, block_rows=block_rows)
        assert not backend.races_found()
    for got in (by_blocks, by_hand):
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_teaching_ring_equals_stream_matmul_and_is_race_free(slots):
    x = jax.random.normal(jax.random.key(1), (2, 256))
    w = jax.random.normal(jax.random.key(0), (256, 384)).astype("bfloat16")
    with backend.use("interpret", detect_races=True):
        got = teach.ring_matmul(x, w, slots=slots)
        want = stream_matmul(x, w, block=BlockSizes(slots=slots, tile_rows=128,
                                                     tile_cols=128))
        assert not backend.races_found()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_teaching_attend_equals_decode_attention():
    config = mk.preset("tiny")
    B, T, S, N, K, H = 2, 2, 256, config.heads, config.kv_heads, config.head_dim
    G = N // K
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B * T, N * H))
    k_new, v_new = (jax.random.normal(k, (B * T, K * H)) for k in keys[1:3])
    k_cache, v_cache = (jax.random.normal(k, (1, B, K, S, H)).astype(config.dtype)
                        for k in keys[3:])
    positions = jnp.asarray(course.hard_positions(B, T, S), jnp.int32)

    def head_group(o, b, k):  # [B*T, N*H] -> sequence b, kv head k's rows (g, t)
        return o.reshape(B, T, N, H)[b][:, k * G:(k + 1) * G].transpose(1, 0, 2).reshape(
            G * T, H)
    with backend.use("interpret"):
        o, k_got, v_got = decode_attention(q, k_new, v_new, k_cache, v_cache, positions)
        for b in range(B):
            for k in range(K):
                got = teach.attend(head_group(q, b, k), k_got[0, b, k], v_got[0, b, k],
                                   positions[b], rows=T)
                np.testing.assert_allclose(np.asarray(got), np.asarray(head_group(o, b, k)),
                                           rtol=1e-6, atol=1e-6)


def test_teaching_moe_experts_equal_the_moe_kernel():
    config = mk.preset("tiny-moe")
    (router, gate, up, down), h, experts = course.moe_inputs(
        config, 0, parameters("04_mlp_and_moe")["router_seed"], 2)
    assert not course.is_prefix(experts), experts
    combine, padded, count = course.routed(config, h, router)
    assert count == len(experts)
    with backend.use("interpret"):
        got = teach.moe_experts(h, combine, gate, up, down, padded, count)
        want = mlp.moe(h, router, gate, up, down, top_k=config.experts_per_token,
                       renormalise=config.norm_topk)
    course.check_close("teaching experts", got, want, atol=1e-5, rtol=1e-5)


def test_teaching_all_reduce_sums_in_the_kernels_tree_order():
    x = np.random.default_rng(0).standard_normal((8, 8, 256), np.float32)
    got = np.asarray(teach.all_reduce(jnp.asarray(x)))
    for device in got:
        np.testing.assert_array_equal(device, np.asarray(collectives.tree_sum(x)))


@pytest.mark.parametrize("kernel", [teach.block_copy_kernel, teach.hand_copy_kernel,
                                    teach.ring_matmul_kernel, teach.attend_kernel,
                                    teach.attend_tile, teach.online_softmax_update,
                                    teach.compact_experts_kernel, teach.moe_experts_kernel,
                                    teach.all_reduce])
def test_teaching_versions_fit_on_a_page(kernel):
    assert teach.lines_of(kernel) <= 40


def test_excerpt_follows_the_code_and_refuses_a_missing_anchor():
    page = teach.excerpt(ring.Ring.matmul, [("def tile(", "out_ref[:, cols] = part", "x")])
    start = inspect.getsourcelines(ring.Ring.matmul)[1]
    assert f"from line {start}" in page.data and "<details>" in page.data
    with pytest.raises(ValueError, match="no line holding 'nowhere'"):
        teach.excerpt(ring.Ring.matmul, [("nowhere", "x", "y")])


# -- The notebooks' defaults hit the hard paths ----------------------------------------------
@pytest.mark.parametrize("notebook", ["02_attention_prologue", "03_decode_attention",
                                      "05_one_layer"])
def test_default_positions_are_nonzero_and_straddle_a_tile_edge(notebook):
    p = parameters(notebook)
    tile = p.get("kv_tile", 128)
    positions = course.hard_positions(p["batch"], p["rows"], p["context"], tile)
    assert all(positions > 0), positions
    assert course.straddles(positions, p["rows"], tile)[0], (positions, p["rows"])


def test_teaching_helpers_name_a_bad_argument_instead_of_crashing():
    for call, message in (
            (lambda: course.hard_positions("1", 2, 256), "batch='1' must be a positive"),
            (lambda: course.hard_positions(1, 2, 256, tile=0), "tile=0 must be a positive"),
            (lambda: teach.all_reduce(jnp.zeros((0, 8, 8))), r"n=0 must be a power of two"),
            (lambda: teach.all_reduce(jnp.zeros((8, 8))), "x must be an array of 3 dim"),
            (lambda: teach.attend(None, None, None, 0, rows=1), "q must be an array of 2"),
            (lambda: teach.ring_schedule(None, slots="3", latency_s=0, dma_s=0, compute_s=0),
             "slots='3' must be a positive integer"),
            (lambda: teach.ring_schedule(None, slots=3, latency_s=float("inf"), dma_s=0,
                                         compute_s=0), r"latency_s=inf must be a finite"),
            (lambda: course.straddles("abc", 2), r"positions=.*'abc'.* must be \[B\] non-"),
            (lambda: course.straddles([3.5], 2), r"must be \[B\] non-negative integers"),
            (lambda: course.straddles([127], 0), "rows=0 must be a positive integer"),
            (lambda: course.is_prefix(None), "experts=None must be a list of expert ids"),
            (lambda: teach.tile_times(None, BlockSizes(), 2, 1), "spec=None must be a mk"),
            (lambda: teach.tile_times("v6e", None, 2, 1), "block=None must be a mk"),
            (lambda: teach.tile_times("v6e", BlockSizes(), 0, 1), "itemsize=0 must be a"),
            (lambda: course.moe_inputs(mk.preset("tiny"), 0, 0, 2),
             r"tiny has no MoE layers, so no router or experts for moe_inputs")):
        with pytest.raises(ValueError, match=message):
            call()
    assert teach.tile_times("v6e", BlockSizes(), 2, 1)["dma_s"] > 0


def test_teaching_kernels_refuse_bad_arguments_by_name_before_any_kernel_runs():
    """Issue 65: a zero tile divided by zero, an expert id or a position outside its
    array crashed inside an interpret-mode callback, and a combine or we_down of the wrong
    shape returned numbers (1.7e7, nan) silently; each is now a ValueError naming it."""
    x, combine = jnp.ones((8, 256)), jnp.ones((8, 4))
    gate, down = jnp.ones((4, 256, 128)), jnp.ones((4, 128, 256))
    q, kv = jnp.ones((4, 128)), jnp.ones((256, 128))
    moe = mk.preset("tiny-moe")
    stream = TileStream.build(BlockSizes(slots=1, tile_rows=128, tile_cols=128),
                              [("wq", 256, 256)])
    for call, message in (
            (lambda: teach.hand_copy(x, block_rows=0), "block_rows=0 must be a positive"),
            (lambda: teach.block_copy(x, block_rows=3), r"x \(8, 256\): its rows must be"),
            (lambda: teach.hand_copy(x[0]), "x must be an array of 2 dim"),
            (lambda: teach.ring_matmul(x, x.T, tile=0), "tile=0 must be a positive integer"),
            (lambda: teach.ring_matmul(x, x.T, slots="3"), "slots='3' must be a positive"),
            (lambda: teach.attend(q, kv, kv, 3, rows=0), "rows=0 must be a positive integer"),
            (lambda: teach.attend(q, kv, kv, 3, rows=2, kv_tile=0), "kv_tile=0 must be a"),
            (lambda: teach.attend(q, kv, kv, -5, rows=2),
             r"position\[0\]=-5 must be in \[0, S - rows \+ 1=255\)"),
            (lambda: teach.attend(q, kv, kv, jnp.asarray(255), rows=2),
             r"position\[0\]=255 must be in \[0, S - rows \+ 1=255\)"),
            (lambda: teach.attend(q, kv, kv, "3", rows=2), "position has dtype <U1"),
            (lambda: teach.attend(q, kv, kv[:, :64], 3, rows=2), r"v \(256, 64\)"),
            (lambda: teach.moe_experts(x, combine[:, :3], gate, gate, down, [0, 1], 2),
             r"combine has shape \(8, 3\); .* it must be \(8, 4\)"),
            (lambda: teach.moe_experts(x, combine, gate, gate, gate, [0, 1], 2),
             r"we_down has shape \(4, 256, 128\); .* it must be \(4, 128, 256\)"),
            (lambda: teach.moe_experts(x, combine, gate, gate, down, [0, 9], 2),
             r"ids\[1\]=9 must be in \[0, E=4\)"),
            (lambda: teach.moe_experts(x, combine, gate, gate, down, [], 0),
             "ids=.* must be a non-empty list of expert ids"),
            (lambda: teach.moe_experts(x, combine, gate, gate, down, [0, 1], 3),
             r"count=3 must be an integer in \[0, 2\]"),
            (lambda: teach.first_copies("a"), "count='a' must be a non-negative integer"),
            (lambda: teach.ring_schedule(None, slots=2, latency_s=0, dma_s=0, compute_s=0),
             "stream=None must be a mk.kernels.stream.TileStream"),
            (lambda: teach.ring_schedule(stream, slots=2, latency_s=0, dma_s=0, compute_s=0,
                                         active=2), "active=2 must be a function"),
            (lambda: course.routed(moe, None, None), r"h=NoneType None must be an array of "
             r"shape \('M', 256\) for tiny-moe"),
            (lambda: course.routed(moe, jnp.ones((2, 256)), jnp.ones((256, 3))),
             r"router=.*\(256, 3\).* must be an array of shape \(256, 8\)"),
            (lambda: course.check_up_rotation(96, used="a"), "used='a' must be a positive")):
        with pytest.raises(ValueError, match=message):
            call()
    assert teach.first_copies(0)("wq") and not teach.first_copies(0)("we_gate[0]")


def test_hard_positions_refuses_rows_past_the_context():
    with pytest.raises(ValueError, match="rows=256 must be in"):
        course.hard_positions(1, 256, 256)


def test_default_router_seed_picks_experts_that_are_not_a_prefix():
    p = parameters("04_mlp_and_moe")
    _, _, experts = course.moe_inputs(mk.preset("tiny-moe"), p["seed"], p["router_seed"],
                                      p["batch"] * p["rows"])
    assert not course.is_prefix(experts), experts
    assert course.is_prefix(course.moe_inputs(mk.preset("tiny-moe"), 0, 0, 1)[2])


def test_default_megakernel_demo_of_09_accepts_drafts():
    p = parameters("09_speculative_sweep")
    config = mk.preset(p["preset"])
    params = mk.init_params(config, p["seed"])
    prompt = jax.random.randint(jax.random.key(p["seed"]), (p["batch"], 5), 0, config.vocab)
    options = ({"acceptance_length": p["demo_acceptance"]}
               if p["demo_drafter"] == "forced" else {})
    _, stats = spec.generate(config, params, prompt, p["megakernel_steps"],
                             drafter=p["demo_drafter"], gamma=p["gamma"],
                             verifier="reference", max_context=p["context"], **options)
    assert stats.acceptance_length > 1, stats


def test_a_scope_added_to_the_kernel_has_its_own_bundles_in_the_dump():
    """08's exercise both ways, compiled for v6e by libtpu with the dumps on: the given
    kernel (the notebook's stub) has its norm in no scope (the check fails), the worked
    solution, the kernel with the scope added, has
    bundles in it, among them the norm's reciprocal square root; the matmul scope stays."""
    given = scopes.scoped_bundles(scopes.norm_then_matmul)
    with pytest.raises(course.ExerciseFailed, match="no bundle lies in a scope named 'norm'"):
        scopes.check_scope(given, "norm")
    done = scopes.scoped_bundles(course.SOLUTIONS["08-scope"])
    assert scopes.check_scope(done, "norm") > 0 and scopes.check_scope(done, "matmul") > 0
    ops = {op for b in done["norm"] for op in b.ops}
    assert any("rsqrt" in op for op in ops), sorted(ops)
    assert not any("rsqrt" in op for b in given.get("matmul", []) for op in b.ops)
    with pytest.raises(ValueError, match="its source is compiled in a child process"):
        scopes.scoped_bundles(eval("lambda x_ref, w_ref, o_ref: None"))


# -- The checks as graders: any wrong answer fails the exercise, none crashes or passes --------
def _garbage(*args, **kwargs):
    return "garbage"


def _raises(*args, **kwargs):
    raise RuntimeError("the student's own error")


def _returns_none(*args, **kwargs):
    ...


# Wrong answers of every type, fed to every check: each must fail with ExerciseFailed.
WRONG = {"None": None, "string": "96", "float": 3.5, "empty": [], "nested": [[1], [1, 2]],
         "wrong shape": np.zeros((5, 7), np.int32), "returns garbage": _garbage,
         "returns None": _returns_none,
         "raises": _raises, "dict": {"norm": 5}, "complex": np.ones((2, 2)) + 1j}


@functools.cache
def _deep_ring():
    return simulated_step(mk.preset("tiny"), "v6e", context=256)


@functools.cache
def _mystery():
    return course.mystery(0)


def _accept_with(fn):
    with course.replaced("accept_wrong_row", fn):
        n, bonus = spec.accept_greedy(np.array([[1, 2]]), np.array([[1, 2, 3]]))
    course.check_tokens("bonus token", bonus, np.array([3]))


def _up_rotation(rotation):
    with backend.use("interpret"):
        course.check_up_rotation(rotation)


CHECKS = {
    "check_tokens": lambda a: course.check_tokens("tokens", a, np.array([[1, 2, 3]])),
    "check_close": lambda a: course.check_close("output", a, np.ones((2, 2)), atol=1e-3),
    "check_race_free": lambda a: course.check_race_free("ring", a),
    "check_up_rotation": _up_rotation,
    "check_ring_depth": lambda a: course.check_ring_depth(a, _deep_ring()),
    "check_attend_update": course.check_attend_update,
    "check_ring_kernel": course.check_ring_kernel,
    "check_copy_kernel": course.check_copy_kernel,
    "check_attend_tile": course.check_attend_tile,
    "check_compact_experts": course.check_compact_experts,
    "check_scope": lambda a: scopes.check_scope(a, "norm"),
    "replaced": _accept_with,
    "Mystery.confirm": lambda a: _mystery().confirm(a),
    "Mystery.suspect": lambda a: _mystery().suspect(a),
}
# Answers of the right type that are still wrong (each check's own planted ones are above).
WRONG_BUT_TYPED = {
    "check_tokens": [3, np.array([[1, 2, 4]]), np.array([[1.0, 2.0, 3.0]]),
                     np.array([[True, True, True]]), np.array([[1, 2, 3]], np.uint8) + 255,
                     [[1, 2, 2**70]]],
    "check_close": [np.ones((2, 2)) + 1, np.full((2, 2), np.nan), np.ones((2, 2, 1)),
                    np.ones((2, 2)) + 1j, np.full((2, 2), np.inf), np.full((2, 2), 1e300)],
    "check_race_free": [True, np.bool_(True), 0],
    "check_up_rotation": [32, True],
    "check_ring_depth": [simulated_step(mk.preset("tiny"), "v5e", context=256)],
    "check_attend_update": [lambda m, l, acc, scores, v: (m, l), teach.attend],
    "check_ring_kernel": [teach.attend, _ring_kernel_with(refill_first=True)],
    "check_copy_kernel": [teach.ring_matmul_kernel, course.copy_out_before_wait],
    "check_attend_tile": [teach.online_softmax_update, _attend_tile_with("none"),
                          lambda m, l, acc, q, k, v, start, position, *, rows, update:
                          (m, l)],
    "check_compact_experts": [teach.moe_experts_kernel, _compaction_with("unsorted")],
    "check_scope": [{}, {"matmul": [1]}, {"norm": "abc"}, {"norm": [1, 2]}],
    "replaced": [course.accept_on_the_next_row, lambda drafts: drafts],
    "Mystery.confirm": [lambda self: 0],
    "Mystery.suspect": [["mk.kernels.ring.Ring.slot"]],
}
CASES = [(check, name, answer) for check in CHECKS for name, answer in WRONG.items()
         # a wrong function is run once in the slow mystery step: enough
         if not (check.startswith("Mystery") and name in ("raises", "returns None"))
         and not (check == "Mystery.suspect" and name == "string")]  # a wrong guess: a hint
CASES += [(check, f"typed {i}", answer) for check, answers in WRONG_BUT_TYPED.items()
          for i, answer in enumerate(answers)]


@pytest.mark.parametrize("check, name, answer", CASES,
                         ids=[f"{c}-{n}" for c, n, _ in CASES])
def test_every_check_fails_any_wrong_answer_saying_what_came_back(check, name, answer):
    """Each course check, fed a wrong answer of any type, fails the exercise with
    ExerciseFailed (never a TypeError from inside mk, never a pass) and its message says
    what was expected or what differs."""
    with pytest.raises(course.ExerciseFailed) as failed:
        CHECKS[check](answer)
    text = str(failed.value)
    assert any(word in text for word in ("expected", "differ", "flagged", "too shallow",
                                         "no bundle", "tau", "another configuration")), text


@pytest.mark.parametrize("call, message", [
    (lambda: course.check_close("x", [1.0], [2.0], atol=math.inf), "atol=inf must be a finite"),
    (lambda: course.check_close("x", [1.0], [2.0], atol=0, rtol=math.nan), "rtol=nan must be"),
    (lambda: course.check_close("x", [1.0], [2.0], atol=0, rtol="1"), "rtol='1' must be a"),
    (lambda: course.check_ring_depth(_deep_ring(), _deep_ring(), tolerance=math.nan),
     "tolerance=nan must be a finite number")])
def test_a_checks_tolerance_is_finite_so_no_tolerance_passes_any_answer(call, message):
    """Issue 65: atol=inf passed [1] against [2]; a nan tolerance passed a shallow ring."""
    with pytest.raises(ValueError, match=message):
        call()
    assert course.check_close("x", [1.0], [2.0], atol=1.0, rtol=0) == 1.0


def test_check_tokens_fails_one_token_against_another():
    with pytest.raises(course.ExerciseFailed, match="its only token: got 3, reference 4"):
        course.check_tokens("t", 3, 4)


def test_an_error_inside_a_jax_callback_is_shown_by_its_inner_error_not_a_traceback():
    """Interpret mode raises a learner's out-of-bounds slot inside a callback: the message
    is JAX's traceback text, whose last line (cut off at 300 characters) says what broke."""
    inner = ("INTERNAL: CpuCallback error calling callback: Traceback (most recent call "
             "last):\n" + '  File "interpret_pallas_call.py", line 663, in get\n' * 9
             + "IndexError: Out-of-bounds read of (0 0 vmem 149): reading [(7, ...)] but "
               "buffer has shape (3, 128, 512).")
    with pytest.raises(course.ExerciseFailed, match=r"your slot raised RuntimeError: "
                       r"'IndexError: Out-of-bounds read .* \(3, 128, 512\)\.'") as failed:
        with grading.learners_code("your slot", "a slot of the ring"):
            raise RuntimeError(inner)
    assert "Traceback" not in str(failed.value)


def test_a_failing_callback_in_a_learners_code_logs_no_traceback(caplog):
    """Interpret mode's bounds checks fail inside an io_callback, and JAX logs the whole
    traceback (on stderr, above the cell's result) before raising: a wrong fix to the
    mystery lab looked like a crash in mk/kernels/ring.py. The exercise's message says
    what broke; nothing is logged."""
    from jax.experimental import io_callback

    def bad(x):
        raise IndexError("Out-of-bounds read of slot 7")

    def step(x):
        return io_callback(bad, jax.ShapeDtypeStruct((), jnp.int32), x)
    with pytest.raises(course.ExerciseFailed, match="Out-of-bounds read of slot 7"):
        with grading.learners_code("your slot", "a slot of the ring"):
            jax.block_until_ready(jax.jit(step)(jnp.int32(1)))
    assert not [r for r in caplog.records if "callback" in r.name], caplog.text
    assert not jax_private.callback.logger.disabled  # held back only inside the block


def test_course_helpers_refuse_a_key_or_seed_of_the_wrong_type_by_name():
    with pytest.raises(ValueError, match=r"answer key=\[1\] must be one of"):
        course.reveal([1])
    with pytest.raises(ValueError, match="seed='x' must be a non-negative integer"):
        course.mystery("x")


def test_the_right_answers_still_pass_the_grading_checks():
    course.check_tokens("t", 3, 3)
    course.check_tokens("t", np.array([[1, 2, 3]]), [[1, 2, 3]])
    course.check_race_free("ring", np.bool_(False))
    assert course.check_close("c", np.ones((2, 2), jnp.bfloat16), np.ones((2, 2)),
                              atol=0) == 0
    _accept_with(spec.accept_greedy)
    assert "Found it" in _mystery().suspect(_mystery().where()).data
