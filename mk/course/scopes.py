"""Notebook 08's exercise: named scopes in the compiled code. `norm_then_matmul` (a small
kernel whose norm is in no scope; the student adds one), `scoped_bundles` (compile a
kernel for a chip with libtpu's dumps and list its bundles by scope) and `check_scope`
(the new scope has bundles). Not here: the other exercises (`mk.course.course`), reading
dumps (`mk.cost.bundles`)."""

from __future__ import annotations

import inspect
import tempfile
import textwrap

import jax
import jax.numpy as jnp

from mk.cost import bundles
from mk.course.grading import ExerciseFailed, described


def norm_then_matmul(x_ref, w_ref, o_ref):
    """The 08 exercise's kernel: an RMS norm of x [M, D] f32, then x @ w [D, N] bf16 in a
    scope named "matmul"; the norm is in no scope."""
    x = x_ref[...]
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    with jax.named_scope("matmul"):
        o_ref[...] = jnp.dot(x.astype(w_ref.dtype), w_ref[...],
                             preferred_element_type=jnp.float32)


SCOPE_SHAPES = ((8, 256), (256, 256))  # x [M, D] f32 and w [D, N] bf16 of `scoped_bundles`
_COMPILE_SCOPED = """import sys, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import mk.measure.tpu

{source}

def call(x, w):
    return pl.pallas_call({name}, out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]),
                                                               jnp.float32), name="mk_scoped")(x, w)

(m, d), (_, n) = {shapes}
report = mk.measure.tpu.compile_for_chip(call, [jax.ShapeDtypeStruct((m, d), jnp.float32),
                                        jax.ShapeDtypeStruct((d, n), jnp.bfloat16)], sys.argv[1])
if not report.ok:
    sys.exit(report.summary())
"""


def scoped_bundles(kernel, chip: str = "v6e") -> dict[str, list]:
    """Compile `kernel(x_ref, w_ref, o_ref)` (a Pallas kernel on x [M, D] f32 and w [D, N]
    bf16, `SCOPE_SHAPES`, writing o [M, N] f32; its source may use `jax`, `jnp` and `pl`)
    for `chip` ahead of time with libtpu's dumps and the named-scope markers on
    (`mk.cost.bundles.compile_with_dumps`: a child process, so the kernel goes there as its
    source, `inspect.getsource`), and return {scope: its bundles, in program order}: the
    innermost scope holding each bundle (`mk.cost.bundles.scopes`). Raises RuntimeError with the
    compiler's words if it does not compile."""
    try:
        source = textwrap.dedent(inspect.getsource(kernel))
    except (OSError, TypeError):
        raise ValueError(f"kernel={getattr(kernel, '__name__', kernel)!r}: its source is "
                         "compiled in a child process; define it in a file or a notebook "
                         "cell") from None
    code = _COMPILE_SCOPED.format(source=source, name=kernel.__name__,
                                  shapes=SCOPE_SHAPES)
    with tempfile.TemporaryDirectory(prefix="mk-scoped-") as folder:
        jf = bundles.compile_with_dumps(code, [chip], folder)
        found = bundles.read_bundles(bundles.dump_file(jf, "mk_scoped",
                                                       "final_bundles.txt").read_text())
    out: dict[str, list] = {}
    for bundle, scope in zip(found, bundles.scopes(found)):
        if scope is not None:
            out.setdefault(scope, []).append(bundle)
    return out


def check_scope(found: dict[str, list], scope: str) -> int:
    """The number of bundles in `scope` (of `scoped_bundles`); ExerciseFailed if none."""
    wanted = "scoped_bundles' {scope: [mk.cost.bundles.Bundle, ...]}"
    if not isinstance(found, dict) or not all(
            isinstance(v, list) and all(isinstance(b, bundles.Bundle) for b in v)
            for v in found.values()):
        raise ExerciseFailed(f"check_scope: expected {wanted}; got {described(found)}")
    if not found.get(scope):
        raise ExerciseFailed(f"no bundle lies in a scope named {scope!r} (scopes with "
                             f"bundles: {sorted(found)}): wrap the code in "
                             f"`with jax.named_scope({scope!r}):`")
    return len(found[scope])
