"""What the course notebooks share: the hard-path defaults, the break-it exercises (the
mistakes a student plants) and the checks that catch them.

Here: the hard-path defaults (`hard_positions`, `moe_inputs`, `routed`, `compacted`); the
break-it exercises (`planted(name)` swaps ONE line of the real kernel code for a wrong one
in a `with` block; `replaced(name, fn)` runs the student's `fn` there); the from-spec
exercises' checks (00c `check_copy_kernel`, `copy_out_before_wait` its race; 01
`check_ring_kernel`; 03 `check_attend_tile`; 04 `check_compact_experts`); the fix
exercises' (`update_without_rescale` with `check_attend_update`, 08's in
`mk.course.scopes`, `check_up_rotation`, `check_ring_depth`, 11b's `check_allreduce_s` of
`mk.course.derivations`); the mystery
lab (`mystery(seed)`: one unnamed plant in the step, found with the race detector or
`first_divergence`); `mk.course.solutions`' worked answers re-exported (`reveal`, `attempt`).
Checks are graders (`mk.course.grading`'s, re-exported: `ExerciseFailed`, `check_close`,
`check_tokens`, `check_race_free`): any wrong answer fails saying what was expected and
what came back, never with a traceback from inside mk, and never passes.

Not here: the kernels (`mk.kernels`), the simulator (`mk.cost.sim`), drawing (`mk.plots`).
Every plant, which notebook uses it and what it breaks: docs/design/mk.course.course.md.
"""

from __future__ import annotations

import contextlib
import html
import inspect
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from IPython.display import Markdown

from mk.kernels import backend
from mk.step import megakernel
from mk.model import ops, reference
from mk.speculative import spec
from mk.course import teach
from mk.measure import tpu
from mk.model.checkpoint import init_params
from mk.model.config import ModelConfig, finite_number, positive_int
from mk.model.errors import shown
from mk.course.grading import (ExerciseFailed, answer_array, check_close,  # noqa: F401
                               check_function,  # noqa: F401
                        check_race_free, check_tokens, described, learners_code)
from mk.cost.machine import Simulation
from mk.model.presets import preset
from mk.course.solutions import ANSWERS, SOLUTIONS, attempt, is_stub, reveal  # noqa: F401
from mk.course.derivations import check_allreduce_s  # noqa: F401
from mk.kinds.attention import attention_prologue
from mk.kernels import collectives, kv_stream, ring
from mk.kinds.linear import deltanet
from mk.kinds.mlp import joined_experts, mlp
from mk.step import one_layer
from mk.step.plan import DecodePlan

PLANTS = ("ring_race", "rope_off", "wrong_expert", "dropped_all_reduce",
          "conv_unshifted", "head_decay", "wrong_residual", "accept_wrong_row",
          "window_unskipped")


# -- Defaults that exercise the hard paths ----------------------------------------------------
def hard_positions(batch: int, rows: int, context: int, tile: int = 128) -> np.ndarray:
    """[B] int32 first positions: sequence b at the last row of tile b (capped so its T rows
    fit in `context`), so every position is non-zero and, with T >= 2, rows p .. p+T-1
    straddle a tile edge."""
    batch, rows, context = (positive_int(f, v) for f, v in (("batch", batch), ("rows", rows),
                                                            ("context", context)))
    tile = positive_int("tile", tile)
    if not 1 <= rows < context:
        raise ValueError(f"rows={rows} must be in [1, context={context})")
    return np.asarray([min((b + 1) * tile - 1, context - rows) for b in range(batch)],
                      np.int32)


def straddles(positions, rows: int, tile: int = 128) -> list[bool]:
    """Whether each sequence's new rows p .. p + T - 1 cross a tile edge (positions: [B]
    non-negative integers)."""
    rows, tile = positive_int("rows", rows), positive_int("tile", tile)
    positions = np.asarray(positions)
    if positions.ndim != 1 or positions.dtype.kind not in "iu" or (positions < 0).any():
        raise ValueError(f"positions={shown(positions)} must be [B] non-negative integers")
    return [int(p) // tile != (int(p) + rows - 1) // tile for p in positions]


def moe_inputs(config: ModelConfig, seed: int, router_seed: int, rows: int):
    """Layer 0's MoE weights (router, we_gate, we_up, we_down) of `init_params(config,
    seed)`, activations h [rows, D] drawn with `router_seed`, and the distinct experts the
    reference router picks for them (sorted)."""
    if not config.moe_layers:
        raise ValueError(f"{config.name} has no MoE layers, so no router or experts for "
                         "moe_inputs (take a MoE preset, e.g. mk.preset('tiny-moe'))")
    rows = positive_int("rows", rows)
    params = init_params(config, seed)
    weights = [params[n][0] for n in ("router", "we_gate", "we_up", "we_down")]
    h = jax.random.normal(jax.random.key(router_seed), (rows, config.hidden))
    _, experts = ops.route(h, weights[0], config.experts_per_token, config.norm_topk)
    return weights, h, sorted(set(np.asarray(experts).ravel().tolist()))


def routed(config: ModelConfig, h, router):
    """What the teaching experts (`mk.course.teach.moe_experts`) take from the reference router
    for rows h [M, D]: (combine [M, E] routing weights, ids [slots] the distinct experts
    sorted and padded with the last one, count)."""
    for name, value, want in (("h", h, (None, config.hidden)),
                              ("router", router, (config.hidden, config.experts))):
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) != 2 or any(w not in (None, n) for w, n in
                                                   zip(want, shape)):
            raise ValueError(f"{name}={described(value)} must be an array of shape "
                             f"{tuple('M' if w is None else w for w in want)} for "
                             f"{config.name} (moe_inputs gives both)")
    weights, picked = ops.route(h, router, config.experts_per_token, config.norm_topk)
    combine = jnp.zeros((h.shape[0], config.experts)).at[
        jnp.arange(h.shape[0])[:, None], picked].set(weights)
    return (combine, *compacted(picked, config.experts))


def compacted(picked, experts: int) -> tuple[list[int], int]:
    """The reference compaction of picked [M, X] expert ids (in [0, experts)): (ids
    [slots], the distinct experts sorted and padded with the last, count), slots =
    `mlp.expert_slots(experts, X, M)` (what `teach.compact_experts` computes in SMEM)."""
    picked = np.asarray(picked)
    distinct = sorted(set(picked.ravel().tolist()))
    slots = mlp.expert_slots(experts, picked.shape[1], picked.shape[0])
    return distinct + [distinct[-1]] * (slots - len(distinct)), len(distinct)


def is_prefix(experts) -> bool:
    """Whether the experts are 0 .. count - 1, where loading slot s instead of ids[s] is
    harmless."""
    if isinstance(experts, (str, bytes)) or not hasattr(experts, "__iter__"):
        raise ValueError(f"experts={shown(experts)} must be a list of expert ids")
    return list(experts) == list(range(len(experts)))


# -- Planted mistakes -------------------------------------------------------------------------
def _slot_of_next_tile(ring, index, segment=None):
    name = "ring" if segment is None else ring.stream.buffer_name(segment)
    return ring.buffers[name].at[(index + 1) % ring.n]  # the mistake: the next slot's


def _rope_off(x, pos, theta, dims=None, yarn=None):
    return x  # the mistake: no rotation


class _SlotIsId:
    """Stands in for ids_smem: reading slot s gives s (the mistake: the slot, not its id)."""

    def __getitem__(self, s):
        return s


def _partial_sum_only(x, s, **_):
    return x  # the mistake: no exchange, each device keeps its own partial sum


def _conv_state_before_row(window_vmem, b, t, taps):
    return window_vmem[b, t:t + taps - 1]  # the mistake: rows t.., not t + 1..


def _one_decay_per_head(row):
    return jnp.zeros((row.shape[1], 1), row.dtype) + row[:, :1]  # the mistake: channel 0's


def _residual_dropped(x, block_out):
    return block_out  # the mistake: the stream x is not added back


def accept_on_the_next_row(drafts, target):
    """`mk.speculative.spec.accept_greedy` with a mistake (notebook 09's exercise: find it)."""
    n = np.cumprod(drafts == target[:, 1:], axis=1).sum(axis=1)  # the mistake: row i + 1
    return n, target[np.arange(len(n)), n]


def update_without_rescale(m, l, acc, scores, v):
    """`mk.course.teach.online_softmax_update` with a mistake (notebook 03's exercise: find it)."""
    m_next = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    probs = jnp.exp(scores - m_next)
    l_next = l + jnp.sum(probs, axis=1, keepdims=True)
    acc_next = acc + jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_next, l_next, acc_next


def _from_tile_zero(position, kv_tile, window=0):
    """`kv_stream.first_kv_tile` with a mistake (05d's exercise): every sequence's tiles
    start at tile 0, the window's or not."""
    return 0


# The one place each single-seam plant patches, and what it puts there.
SEAMS = {"ring_race": (ring.Ring, "slot", _slot_of_next_tile),
         "rope_off": (attention_prologue, "rope_rows", _rope_off),
         "conv_unshifted": (deltanet, "conv_state_after", _conv_state_before_row),
         "head_decay": (deltanet, "channel_column", _one_decay_per_head),
         "wrong_residual": (one_layer, "residual", _residual_dropped),
         "accept_wrong_row": (spec, "accept_greedy", accept_on_the_next_row),
         "window_unskipped": (kv_stream, "first_kv_tile", _from_tile_zero)}


@contextlib.contextmanager
def replaced(name: str, fn):
    """Run the block with the student's `fn` where plant `name` (a key of SEAMS) patches.
    `fn` must be a function callable as the released one is (else ExerciseFailed before
    anything runs), and an exception the block raises with it in place fails the exercise
    (ExerciseFailed naming it and what was expected), not the notebook inside mk."""
    if name not in SEAMS:
        raise ValueError(f"replaced name={name!r} must be one of {tuple(SEAMS)}")
    owner, attr, _ = SEAMS[name]
    released = getattr(owner, attr)
    check_function(f"your replacement for {attr}", fn, released)
    with _patched(owner, attr, fn), learners_code(
            f"with your {attr} in place, the step",
            f"{attr} to return what the released one returns"):
        yield


@contextlib.contextmanager
def _patched(owner, attr: str, fn):
    """`owner.attr` is `fn` in the block. Jitted traces are dropped on entry and exit, so
    a step traced before (or inside) does not keep the other code."""
    jax.clear_caches()
    try:
        with mock.patch.object(owner, attr, fn):
            yield
    finally:
        jax.clear_caches()


@contextlib.contextmanager
def planted(name: str | None):
    """Run the block with the mistake `name` (one of PLANTS) in the kernel code; None or
    "" plants nothing. Build and call the kernels inside the block."""
    if not name:
        yield
        return
    if name not in PLANTS:
        raise ValueError(f"planted name={name!r} must be one of {PLANTS}")
    if name in SEAMS:
        owner, attr, plant = SEAMS[name]
        with _patched(owner, attr, plant):
            yield
        return
    with contextlib.ExitStack() as stack:
        if name == "wrong_expert":
            real = mlp.moe_fetch

            def wrong(weights, row, ids_smem, count_smem):
                return real(weights, row, _SlotIsId(), count_smem)

            for module in (mlp, one_layer):
                if hasattr(module, "moe_fetch"):
                    stack.enter_context(mock.patch.object(module, "moe_fetch", wrong))
        else:
            for module in (collectives, megakernel):
                if hasattr(module, "all_reduce_body"):
                    stack.enter_context(mock.patch.object(module, "all_reduce_body",
                                                          _partial_sum_only))
        yield


# -- Checks -----------------------------------------------------------------------------------
def check_up_rotation(rotation: int, used: int = 32, lanes: int = 128) -> None:
    """05c's exercise: `rotation` (jnp.roll's direction) must bring up's `used` values of a
    joined gate|up product of `lanes` lanes to lanes [0, used), as the kernel's own split
    does (`mk.kinds.mlp.joined_experts.gate_up`, on a product whose lanes hold their index;
    run on the backend in `use`, else the machine's own: interpret mode on a CPU)."""
    if isinstance(rotation, (bool, np.bool_)) or not isinstance(rotation, (int, np.integer)):
        raise ExerciseFailed(f"up_rotation: expected a whole number of lanes (an int, "
                             f"jnp.roll's shift); got {described(rotation)}")
    used, lanes = positive_int("used", used), positive_int("lanes", lanes)
    joined = jnp.tile(jnp.arange(lanes, dtype=jnp.float32), (8, 1))
    with contextlib.nullcontext() if backend.active() else backend.use("auto"):
        _, up = joined_experts.gate_up(joined, used, lanes)
    check_close("up's lanes after your rotation", np.roll(np.arange(lanes), rotation)[:used],
                np.asarray(up)[0, :used], atol=0, rtol=0)


def check_ring_depth(sim, deep, *, tolerance: float = 0.05) -> float:
    """`sim` and `deep` are simulated steps (`mk.cost.machine.Simulation`) of one configuration,
    `deep` with a ring as deep as Little's law asks (`mk.cost.sim.latency_slots`). Returns
    sim's step / deep's; raises when `sim` is more than `tolerance` slower: its ring holds
    too few bytes in flight to cover the DMA latency, and HBM idles ("ring empty").
    `tolerance` is a finite number >= 0."""
    tolerance = finite_number("tolerance", tolerance)
    for name, value in (("your simulated step", sim), ("the deep ring's step", deep)):
        if not isinstance(value, Simulation):
            raise ExerciseFailed(f"{name}: expected a mk.cost.sim.simulate result (a "
                                 f"Simulation); got {described(value)}")
    fields = ("config_name", "chip_name", "batch", "rows", "context", "tp")
    other = [f"{f}={getattr(sim, f)!r}, not {getattr(deep, f)!r}" for f in fields
             if getattr(sim, f) != getattr(deep, f)]
    if other:
        raise ExerciseFailed(f"your simulated step is of another configuration than the "
                             f"deep ring's ({'; '.join(other)}): simulate the same step "
                             "with only the ring's slots changed")
    ratio = sim.step_s / deep.step_s
    if ratio > 1 + tolerance:
        empty = sim.bubble_share().get("ring empty", 0.0) / sim.step_s
        raise ExerciseFailed(
            f"ring too shallow: {sim.block.slots} slots make the simulated step {ratio:.2f}x "
            f"the one with {deep.block.slots} slots (Little's law depth); HBM idles "
            f"{empty:.0%} of it waiting for tiles (ring empty)")
    return ratio


def copy_out_before_wait(x_hbm, o_hbm, buf_vmem, sems, *, block_rows: int):
    """00c's question: `teach.hand_copy_kernel` with one line moved, the copy out of
    buf_vmem started before the copy into it is waited for (a race with the right values in
    interpret mode, which runs a DMA when it is waited for)."""
    def one_block(i, carry):
        rows = pl.ds(pl.multiple_of(i * block_rows, block_rows), block_rows)
        copy_in = pltpu.make_async_copy(x_hbm.at[rows], buf_vmem, sems.at[0])
        copy_out = pltpu.make_async_copy(buf_vmem, o_hbm.at[rows], sems.at[1])
        copy_in.start()
        copy_out.start()  # moved up: reads buf_vmem while block i may still be landing
        copy_in.wait()
        copy_out.wait()
        return carry

    lax.fori_loop(0, x_hbm.shape[0] // block_rows, one_block, 0)


def check_copy_kernel(kernel, *, seed: int = 0) -> int:
    """00c's exercise: `kernel` (`teach.hand_copy_kernel`'s refs and `block_rows`) in
    `teach.hand_copy` copies a [64, 256] float32 array in blocks of 8 and of 32 rows with the
    race detector on, bit for bit, leaving no DMA unwaited. Returns the blocks it copied."""
    check_function("your copy kernel", kernel, teach.hand_copy_kernel)
    x = jax.random.normal(jax.random.key(seed), (64, 256))
    wanted = "o_hbm = x_hbm, each block copied into buf_vmem, waited for, then copied out"
    for block_rows in (8, 32):
        what = f"your copy kernel at block_rows={block_rows}"
        with backend.use("interpret", detect_races=True), learners_code(what, wanted):
            got = teach.hand_copy(x, block_rows=block_rows, kernel=kernel)
            jax.block_until_ready(got)
        check_race_free(what, backend.races_found())
        left = backend.dma_leftovers()
        if left:
            raise ExerciseFailed(f"{what}: expected every copy started to be waited for; "
                                 f"left at the kernel's exit: {shown('; '.join(left), 300)}")
        check_close(what, got, x, atol=0.0, rtol=0.0)
    return 64 // 8 + 64 // 32


def check_ring_kernel(kernel, *, chip: str = "v5e", seed: int = 0) -> float:
    """01's from-spec exercise: `kernel` (`teach.ring_matmul_kernel`'s refs and `tile`) in
    `teach.ring_matmul` streams a [384, 256] bf16 weight, six 128 x 128 tiles, through 1, 2
    and 3 slots, each against the reference product with the race detector on; then it
    must compile for `chip` (Mosaic refuses what interpret mode lets pass, such as a tile
    slice it cannot prove aligned). Returns the largest error."""
    check_function("your ring kernel", kernel, teach.ring_matmul_kernel)
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (8, 384))
    w = jax.random.normal(keys[1], (384, 256)).astype(jnp.bfloat16)
    want = ops.matmul(x.astype(jnp.bfloat16), w)
    wanted = "out_vmem = x @ W, each tile of W copied into a slot, waited for, then read"
    worst = 0.0
    for slots in (1, 2, 3):
        what = f"your ring kernel at slots={slots}"
        with backend.use("interpret", detect_races=True), learners_code(what, wanted):
            got = teach.ring_matmul(x, w, slots=slots, tile=128, kernel=kernel)
        check_race_free(what, backend.races_found())
        worst = max(worst, check_close(what, got, want, atol=1e-2, rtol=1e-2))
    with learners_code(f"your ring kernel, compiled for {chip}", wanted):
        report = tpu.compile_for_chip(
            lambda a, b: teach.ring_matmul(a, b, slots=3, tile=128, kernel=kernel), (x, w),
            chip, name="your ring kernel")
    if not report.ok:
        raise ExerciseFailed(f"your ring kernel runs in interpret mode but does not compile "
                             f"for {chip}: expected a kernel Mosaic lowers; the compiler "
                             f"said {shown(report.error, 300)}")
    return worst


def _two_tile_case(kv_tile: int, seed: int):
    """The attention checks' case: one sequence's G*T = 4 rows (T = 2) just past the first
    KV tile edge, so every row reads two tiles, and a strong key at the start of the second
    that moves most rows' running max. Returns (q, k, v, position, T, the reference
    output [G*T, H])."""
    G, T, H, S = 2, 2, 128, 2 * kv_tile
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (G * T, H))
    k, v = (jax.random.normal(key, (S, H)).astype(jnp.bfloat16) for key in keys[1:])
    p = kv_tile + 2
    k = k.at[kv_tile].multiply(8.0)  # the second tile's first key: a new max for most rows
    want = ops.attention(q.reshape(G, T, H).transpose(1, 0, 2)[None], k[None, None],
                         v[None, None], jnp.asarray([p]))  # [1, T, G, H]
    return q, k, v, p, T, want[0].transpose(1, 0, 2).reshape(G * T, H)


def check_attend_update(update, *, kv_tile: int = 128, seed: int = 0) -> float:
    """`mk.course.teach.attend` with the online-softmax step `update` against the reference, for
    one sequence whose two rows sit just past the first KV tile edge: every row reads two
    tiles, and a strong key at the start of the second moves every row's running max.
    Returns the largest error."""
    q, k, v, p, T, want = _two_tile_case(kv_tile, seed)
    _check_update(update, q.shape[0], kv_tile, q.shape[1])  # a wrong type or shape first
    with backend.use("interpret"), learners_code(
            "attention with your update", "(m_next, l_next, acc_next) as "
            "teach.online_softmax_update returns them"):
        got = teach.attend(q, k, v, p, rows=T, kv_tile=kv_tile, update=update)
    return check_close("attention over two KV tiles", got, want, atol=2e-2, rtol=2e-2)


def check_attend_tile(tile_body, *, kv_tile: int = 128, seed: int = 0) -> float:
    """03's from-spec exercise: `tile_body` (`teach.attend_tile`'s arguments) as the KV
    tile of `mk.course.teach.attend`, against the reference, on `check_attend_update`'s case: the
    rows just past the first tile edge read all of the first tile and part of the second,
    so a mask off by one key, or none, changes every row (the tolerance is 6x the right
    tile's error: a row's mask read as its head's also fails). Returns the largest error."""
    check_function("your attend_tile", tile_body, teach.attend_tile)
    q, k, v, p, T, want = _two_tile_case(kv_tile, seed)
    with backend.use("interpret"), learners_code(
            "attention with your attend_tile", "the new (m, l, acc) of one KV tile, as "
            "teach.attend_tile's spec says"):
        got = teach.attend(q, k, v, p, rows=T, kv_tile=kv_tile, tile_body=tile_body)
    return check_close("attention with your attend_tile over two KV tiles", got, want,
                       atol=5e-3, rtol=5e-3)


def _check_update(update, rows: int, tile: int, width: int) -> None:
    """ExerciseFailed unless `update` is an online-softmax step (`teach.online_softmax_update`'s
    arguments) that returns (m_next [R, 1], l_next [R, 1], acc_next [R, H]) of numbers, run
    once outside any kernel on one tile of inputs."""
    check_function("your update", update, teach.online_softmax_update)
    keys = jax.random.split(jax.random.key(1), 2)
    m, l, acc = (jnp.zeros((rows, 1)), jnp.ones((rows, 1)), jnp.zeros((rows, width)))
    scores = jax.random.normal(keys[0], (rows, tile))
    v = jax.random.normal(keys[1], (tile, width)).astype(jnp.bfloat16)
    shapes = ((rows, 1), (rows, 1), (rows, width))
    wanted = f"(m_next, l_next, acc_next) of shapes {shapes}"
    with learners_code("your update, on one tile", wanted):
        out = update(m, l, acc, scores, v)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ExerciseFailed(f"your update: expected {wanted}; got {described(out)}")
    for name, value, shape in zip(("m_next", "l_next", "acc_next"), out, shapes):
        got = answer_array(f"your update's {name}", value)
        if got.shape != shape:
            raise ExerciseFailed(f"your update's {name}: expected shape {shape}; got "
                                 f"{got.shape}")


def check_compact_experts(kernel, *, router_seed: int = 3, rows: int = 4) -> float:
    """04's from-spec exercise: `kernel` (`teach.compact_experts_kernel`'s refs) in
    `teach.compact_experts` against the reference compaction (`compacted`), on rows whose
    picks repeat, skip experts and are not in order ([[5, 2], [2, 7], [7, 5]] of E = 8,
    then `rows` rows of tiny-moe's router, `moe_inputs(..., router_seed, rows)`); then its
    slots drive `teach.moe_experts` on those rows against the reference MoE. Returns the
    MoE's largest error."""
    check_function("your compaction", kernel, teach.compact_experts_kernel)
    config = preset("tiny-moe")
    weights, h, _ = moe_inputs(config, 0, router_seed, rows)
    combine, *_ = routed(config, h, weights[0])
    _, picked = ops.route(h, weights[0], config.experts_per_token, config.norm_topk)
    for case in (np.asarray([[5, 2], [2, 7], [7, 5]], np.int32), np.asarray(picked)):
        want_ids, want_count = compacted(case, config.experts)
        what = f"your compaction of picked={case.tolist()}"
        wanted = (f"ids {want_ids} (the distinct experts sorted, padded with the last) and "
                  f"count [{want_count}]")
        with backend.use("interpret"), learners_code(what, wanted):
            ids, count = teach.compact_experts(case, config.experts, kernel=kernel)
        got = (answer_array(f"{what}: ids", ids, integer=True).tolist(),
               answer_array(f"{what}: count", count, integer=True).tolist())
        if got != (want_ids, [want_count]):
            raise ExerciseFailed(f"{what}: expected {wanted}; got ids {got[0]} and count "
                                 f"{got[1]}")
    with backend.use("interpret"):
        out = teach.moe_experts(h, combine, *weights[1:], ids, got[1][0])
    want = ops.moe(h, *weights, config.experts_per_token, config.norm_topk)
    return check_close("the teaching experts on your slots", out, want, atol=1e-3)


def check_acceptance(config: ModelConfig, params, prompt, steps: int, *, gamma: int = 4,
                     acceptance_length: int = 3) -> float:
    """Speculative decoding with the forced drafter (L - 1 drafts of each step equal the
    target's greedy tokens, the L-th does not) keeps exactly L tokens a step, and the tokens
    are the target's greedy ones (the L = 1 run's). Returns the measured tau."""
    def run(L):
        return spec.generate(config, params, prompt, steps, drafter="forced", gamma=gamma,
                             acceptance_length=L, verifier="reference")
    want, _ = run(1)
    got, stats = run(acceptance_length)
    check_tokens("speculative decoding", got, want)
    if abs(stats.acceptance_length - acceptance_length) > 1e-9:
        raise ExerciseFailed(f"forced acceptance L={acceptance_length}: measured tau = "
                             f"{stats.acceptance_length:.2f}; acceptance compares each draft "
                             "with the wrong row of the target")
    return stats.acceptance_length


# -- The mystery lab --------------------------------------------------------------------------
MYSTERIES = ("ring_race", "rope_off", "wrong_residual")


class Mystery:
    """One megakernel step of the tiny preset (B=1, T=2 rows straddling a KV tile edge)
    with one unnamed plant of MYSTERIES in the kernel code (interpret mode)."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed={shown(seed)} must be a non-negative integer")
        self._plant = MYSTERIES[seed % len(MYSTERIES)]
        self.config = config = preset("tiny")
        self.params = init_params(config, seed)
        keys = jax.random.split(jax.random.key(seed), 3)
        shape = (config.layers, 1, config.kv_heads, 256, config.head_dim)
        self.cache = reference.KVCache(*(jax.random.normal(k, shape).astype(config.dtype)
                                         for k in keys[:2]))
        self.tokens = jax.random.randint(keys[2], (1, 2), 0, config.vocab)
        self.positions = jnp.asarray(hard_positions(1, 2, 256))
        self.want = reference.decode_step(config, self.params, self.cache, self.tokens,
                                          self.positions)[0]

    def _plan(self) -> DecodePlan:
        """The step's plan (made inside the plant: its code may be the planted one)."""
        return DecodePlan.make(self.config, batch=1, rows=2, context=256)

    def _step(self, fix=None, detect_races=False):
        patch = (replaced(self._plant, fix) if fix is not None else planted(self._plant))
        with patch, backend.use("interpret", detect_races=detect_races):
            plan = self._plan()
            weights = megakernel.prepare(plan, self.params)
            logits = megakernel.decode_step(plan, weights, self.cache, self.tokens,
                                            self.positions)[1]
            return jax.block_until_ready(logits), backend.races_found()

    def check(self, fix=None) -> float:
        """The step's logits against the reference's, within 5 % of their largest magnitude
        (the two round to bf16 in different places); raises ExerciseFailed. With the plant,
        or with `fix` in its place."""
        logits, _ = self._step(fix)
        scale = float(jnp.abs(self.want).max())
        return check_close("megakernel step", logits, self.want, atol=5e-2 * scale, rtol=0)

    def races(self) -> bool:
        """Whether the race detector flags the step."""
        return self._step(detect_races=True)[1]

    def divergence(self):
        """`mk.step.megakernel.first_divergence` of the step with the plant in: (the first (layer,
        op) off the reference, or None; the per-op report)."""
        with planted(self._plant):
            return megakernel.first_divergence(self._plan(), self.params, self.cache,
                                               self.tokens, self.positions,
                                               backend="interpret")

    def suspect(self, where: str) -> Markdown:
        """`where`: "module.attribute" of a function you suspect (e.g.
        "mk.kernels.ring.Ring.slot"). Shows its planted code if you are right."""
        fn = SEAMS[self._plant][2]
        if not isinstance(where, str):
            raise ExerciseFailed(f"suspect: expected a name such as "
                                 f"\"mk.kernels.ring.Ring.slot\"; got {described(where)}")
        if where != self.where():
            return Markdown(f"`{html.escape(where)}` runs as released: look elsewhere.")
        return Markdown("Found it. The code running in its place:\n```python\n"
                        + inspect.getsource(fn) + "```\nWrite a fixed copy with the same "
                        "arguments and pass it to `confirm`.")

    def where(self) -> str:
        """The answer: the planted function's module path (what `suspect` checks)."""
        owner, attr, _ = SEAMS[self._plant]
        return (f"{owner.__module__}.{owner.__qualname__}.{attr}" if isinstance(owner, type)
                else f"{owner.__name__}.{attr}")

    def released(self):
        """The answer's fix: the function as released (what the plant replaces)."""
        owner, attr, _ = SEAMS[self._plant]
        return getattr(owner, attr)

    def confirm(self, fix) -> str:
        """Run the step with `fix` in the planted function's place; raises ExerciseFailed
        if the step is still wrong or still races, or `fix` is not a function taking the
        released one's arguments (checked before anything runs)."""
        check_function("your fix", fix, self.released())
        self.check(fix)
        logits, races = self._step(fix, detect_races=True)
        check_race_free("megakernel step with your fix", races)
        return "fixed: the step matches the reference and the race detector is quiet"


def mystery(seed: int) -> Mystery:
    """The mystery lab's step with one plant picked by `seed` (not named)."""
    return Mystery(seed)
