"""The worked answers of the course's fix exercises: their prose (`ANSWERS`), their code
(`SOLUTIONS`, keyed alike), `reveal(key)` (both, for Jupyter and Colab) and `attempt(key,
fn, solutions)` (what a fix cell checks: the learner's function, or the worked one).

A notebook ships each fix cell as a stub the learner fills (a body of `...`, or the given
code to edit); no worked solution is in a notebook. With the notebook's `solutions`
parameter True (headless runs: notebooks/runs.yaml's `every_run`), `attempt` hands the
check the worked solution and prints that it did. The worked solution of a planted mistake
is the released code itself (`mk.course.teach.online_softmax_update`, `one_layer.residual`,
`spec.accept_greedy`), and so is a derivation's (`collectives.allreduce_s`): one copy, the
one the kernels and the models run. Design notes:
docs/design/mk.course.course.md.

Not here: the exercises, their plants and their checks (`mk.course.course`, which re-exports
these names).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from IPython.display import Markdown

from mk.speculative import spec
from mk.course import teach
from mk.kernels import collectives
from mk.model.errors import shown
from mk.course.grading import ExerciseFailed
from mk.step import one_layer


def norm_in_its_scope(x_ref, w_ref, o_ref):
    """08's exercise, done: `mk.course.scopes.norm_then_matmul` with its norm in a scope "norm"."""
    with jax.named_scope("norm"):  # the added scope
        x = x_ref[...]
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    with jax.named_scope("matmul"):
        o_ref[...] = jnp.dot(x.astype(w_ref.dtype), w_ref[...],
                             preferred_element_type=jnp.float32)


SOLUTIONS = {
    "00c-copy": teach.hand_copy_kernel,
    "01-ring": teach.ring_matmul_kernel,
    "03-tile": teach.attend_tile,
    "03-rescale": teach.online_softmax_update,
    "04-compact": teach.compact_experts_kernel,
    "05-residual": one_layer.residual,
    "08-scope": norm_in_its_scope,
    "09-accept": spec.accept_greedy,
    "11b-allreduce": collectives.allreduce_s,
}

ANSWERS = {
    "00c-copy": (
        "In a `lax.fori_loop` over the blocks i: `rows = pl.ds(pl.multiple_of(i * "
        "block_rows, block_rows), block_rows)`; `copy_in = pltpu.make_async_copy(x_hbm.at["
        "rows], buf_vmem, sems.at[0])`, `copy_out = pltpu.make_async_copy(buf_vmem, o_hbm."
        "at[rows], sems.at[1])`; then `copy_in.start()`, `copy_in.wait()`, "
        "`copy_out.start()`, `copy_out.wait()`, in that order. Starting the copy out before "
        "the copy in is waited for races on buf_vmem (the race detector says so, though "
        "interpret mode's values come out right); a copy never waited for is left at the "
        "kernel's exit (as `mk.course.teach.hand_copy_kernel`)."),
    "01-ring": (
        "Name a tile's copy once: `dma(g)` = `pltpu.make_async_copy(w_hbm.at[rows, cols], "
        "slots_vmem.at[g % slots], sems.at[g % slots])` with rows the `g % steps`-th and "
        "cols the `g // steps`-th block of `tile` (`pl.ds(pl.multiple_of(i * tile, tile), "
        "tile)`). Start `dma(g)` for the first min(slots, total) tiles. In a `lax.fori_loop` "
        "over g: `dma(g).wait()`; `part = jnp.dot(x_vmem[:, rows_g], slots_vmem[g % slots], "
        "preferred_element_type=jnp.float32)`; write `part` into the panel's columns where "
        "the row block is 0, else add it; then, under `pl.when(g + slots < total)`, "
        "`dma(g + slots).start()`. Starting the refill before the dot races it (the race "
        "detector says so), and `w_hbm` cannot be read but through a copy (as "
        "`mk.course.teach.ring_matmul_kernel`)."),
    "03-tile": (
        "Round q to k's dtype, then `scores = lax.dot_general(q, k, (((1,), (1,)), ((), "
        "())), preferred_element_type=jnp.float32) * (1 / math.sqrt(H))` ([R, tile]). Row r "
        "is new row t = r % rows (`lax.broadcasted_iota(jnp.int32, scores.shape, 0) % "
        "rows`), key column j is position s = start + j (the iota along axis 1); keep "
        "`jnp.where(s <= position + t, scores, -jnp.inf)`, since row t sits at position + t "
        "and sees its own key. Then `return update(m, l, acc, scores, v)`. A mask of "
        "`s < position + t` hides each row's own key, and no mask lets rows see the keys "
        "after them: both change every row here (as `mk.course.teach.attend_tile`)."),
    "03-rescale": (
        "The sum and the accumulator of the first tile were taken under the first tile's "
        "max; when the second tile raises the max to m', those terms must be scaled by "
        "alpha = exp(m - m') before the second tile's terms (taken under m') are added. "
        "Without alpha the first tile's weight is too large by exp(m' - m). With one tile "
        "(positions < kv_tile - T + 1) the error cannot show: alpha is 1 for the first "
        "tile. Fixed: `alpha = jnp.exp(m - m_next)`, `l_next = alpha * l + ...`, "
        "`acc_next = alpha * acc + ...` (as `mk.course.teach.online_softmax_update`)."),
    "04-compact": (
        "Four `lax.fori_loop`s over scalars. Clear: `seen_smem[e] = 0` for e in [0, E) "
        "(scratch starts as garbage). Flag: `seen_smem[picked_smem[i]] = 1` for i in [0, "
        "M*X): a flag, not a count, so an expert two rows picked is still one. Take: over "
        "e in [0, E) in order (which sorts them), carry count from 0; under "
        "`pl.when(seen_smem[e] > 0)` write `ids_smem[count] = e`, and return `count + "
        "seen_smem[e]`. Pad: for s in [count, slots), `ids_smem[s] = ids_smem[s - 1]`. "
        "Then `count_smem[0] = count`. Appending the picks in row order keeps them "
        "unsorted (and twice where rows share one), counting instead of flagging leaves "
        "holes, and a loop that stops at E - 1 or at the first row drops an expert (as "
        "`mk.course.teach.compact_experts_kernel`)."),
    "05-residual": (
        "first_divergence names (layer 0, 'mlp'), not 'attn': the kernel's 'attn' tap is "
        "written by the tap code itself (x + the attention output), so it is right, and the "
        "first wrong value is the layer's output. Between the two taps run the first residual "
        "add, the MLP norm, the MLP and the second add: read that stretch of `layer_body`; "
        "both adds call `residual`, which drops x. Fixed: `return x + block_out`."),
    "08-scope": (
        "Inside the scope, the norm's bundles are a handful of vector instructions: vld "
        "loads x into vector registers, vmul squares it, a cross-lane vadd (on the XLU) "
        "sums each row, vrsqrt takes the reciprocal square root, vmul scales; the first "
        "bundle, vtrace, is the scope's own marker. The matmul lists several times more: "
        "vld of w's tiles, vmatprep/vmatpush feeding them into the MXU, one vmatmul "
        "streaming x, vst of the result. Bundles count code, not time: on a TPU the trace "
        "event of each scope gives its time."),
    "09-accept": (
        "tau collapses to about 1: draft i is the guess for row i's greedy token, and the "
        "plant compares it with row i + 1's, which it matches only by chance. The tokens "
        "stay right (the bonus is still the target's token at the first reject), so only "
        "the speed check catches it. Fixed: compare `drafts == target[:, :-1]`."),
    "11b-allreduce": (
        "Two phases, a reduce-scatter then an all-gather, each of `collectives.rounds("
        "collectives.choose_algorithm(tp, algorithm), tp)` message rounds (1 for "
        "two_phase, log2(tp) for recursive, 0 at tp = 1) of `collectives.round_s(spec, "
        "latency_s)` seconds; and the bytes: in the reduce-scatter each device sends the "
        "tp - 1 chunks (1/tp of the message each) that the others own, in the all-gather "
        "its own summed chunk to the tp - 1 others, so 2 (tp - 1) / tp of nbytes at "
        "`collectives.ici_bandwidth(spec)` bytes/s. `return 2 * rounds * round_s(spec, "
        "latency_s) + 2 * (tp - 1) / tp * nbytes / ici_bandwidth(spec)`. One phase's rounds "
        "halves the latency term, the whole message on the wire misses the bandwidth term "
        "by 2 (tp - 1) / tp, and a time in µs is 1e6 times too large. Kimi K3's 224 KiB at "
        "TP32 is latency-bound: its two rounds cost more than its bytes (the check's first "
        "row), as the release measured (as `collectives.allreduce_s`)."),
}


def _key(key) -> str:
    if not isinstance(key, str) or key not in ANSWERS:
        raise ValueError(f"answer key={shown(key)} must be one of {tuple(ANSWERS)}")
    return key


def _where(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def reveal(key: str) -> Markdown:
    """A worked answer (one of ANSWERS) and, for a fix exercise, its worked solution's code;
    for Jupyter and Colab (the site shows no solution)."""
    text = f"**Answer ({_key(key)}).** {ANSWERS[key]}"
    if key in SOLUTIONS:
        fn = SOLUTIONS[key]
        text += (f"\n\nThe worked solution, `{_where(fn)}`:\n```python\n"
                 f"{textwrap.dedent(inspect.getsource(fn))}```")
    return Markdown(text)


def is_stub(fn) -> bool:
    """Whether `fn` is an unwritten stub: a function whose body (after its docstring) is
    only `...` or `pass`. False when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr)
               and isinstance(s.value, ast.Constant)
               and (s.value.value is Ellipsis or isinstance(s.value.value, str)))
               for s in node.body)


def attempt(key: str, fn, solutions: bool):
    """What a fix cell's check runs: the learner's `fn`; with `solutions` True the worked
    solution SOLUTIONS[key], printing that it is the worked one (so no output passes it off
    as the learner's). An unwritten stub fails here (ExerciseFailed), saying what to do."""
    if _key(key) not in SOLUTIONS:
        raise ValueError(f"key={key!r} has no worked solution; one of {tuple(SOLUTIONS)}")
    if not isinstance(solutions, (bool, np.bool_)):
        raise ValueError(f"solutions={shown(solutions)} must be True or False")
    name = getattr(fn, "__name__", "function")
    if solutions:
        print(f"solutions = True: the check runs the worked solution, "
              f"{_where(SOLUTIONS[key])}, in place of your {name} "
              f"(course.reveal({key!r}) shows it)")
        return SOLUTIONS[key]
    if is_stub(fn):
        raise ExerciseFailed(
            f"your {name} is still the stub (its body is `...`, so it returns None): write "
            f"its body in place of the `...` and run its cell again; course.reveal({key!r}) "
            "shows the answer, and solutions = True in the parameters cell runs the worked one")
    return fn
