"""Grading a learner's answer: `ExerciseFailed` (a check caught a mistake), the checks
every notebook uses (`check_close`, `check_tokens`, `check_race_free`) and what the
exercise checks of `mk.course.course` build on (`check_function`: a function of the right
arguments; `learners_code`: an exception from the learner's code fails the exercise;
`answer_array`: an answer as an array of numbers; `described`: an answer, bounded, for a
message).

A check is a grader: an answer of any type (None, a string, a ragged list, the wrong
shape, a function that returns garbage or raises) fails with ExerciseFailed saying what
was expected and what came back, never with a traceback from inside mk, and a wrong
answer never passes. Not here: the exercises and their planted mistakes (`mk.course.course`,
which re-exports these names).
"""

from __future__ import annotations

import contextlib
import inspect

import jax.numpy as jnp
import numpy as np

from mk.kernels import backend, jax_private
from mk.model.config import finite_number
from mk.model.errors import shown


class ExerciseFailed(AssertionError):
    """A course check caught a mistake (planted or real)."""


def check_function(what: str, fn, like) -> None:
    """ExerciseFailed unless `fn` is a function that takes `like`'s arguments as a caller
    of `like` may pass them (positionally, but its keyword-only ones by name)."""
    params = inspect.signature(like).parameters
    names = list(params)
    by_name = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    wanted = f"a function ({', '.join(names)}) like {like.__qualname__}"
    if not callable(fn):
        raise ExerciseFailed(f"{what}: expected {wanted}; got {described(fn)}")
    try:
        inspect.signature(fn).bind(*[n for n in names if n not in by_name],
                                   **{n: n for n in by_name})
    except TypeError as err:
        raise ExerciseFailed(f"{what}: expected {wanted}; got {_name(fn)}"
                             f"{inspect.signature(fn)}, which cannot take them ({err})"
                             ) from None
    except ValueError:  # a builtin without a signature: its call will say
        pass


@contextlib.contextmanager
def learners_code(what: str, expected: str):
    """Turn an exception raised in the block, where a student's code runs, into
    ExerciseFailed: `what` raised it, `expected` says what it should have done. JAX's log
    of a failing callback (interpret mode's bounds checks: a whole traceback on stderr,
    before the error itself is raised) is held back meanwhile: the message says it."""
    log = jax_private.callback.logger
    disabled, log.disabled = log.disabled, True
    try:
        yield
    except ExerciseFailed:
        raise
    except Exception as err:  # noqa: BLE001 - the student's code: any failure is theirs
        raise ExerciseFailed(f"{what} raised {type(err).__name__}: "
                             f"{shown(_last_words(err), 300)}; expected {expected}") from err
    finally:
        log.disabled = disabled


def _last_words(err: Exception) -> str:
    """`err`'s text; of one carrying a traceback's text (an error inside a JAX callback:
    interpret mode's bounds checks), only its last line, the inner error itself."""
    text = str(err).strip()
    return text.splitlines()[-1] if "Traceback (most recent call last)" in text else text


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def described(value) -> str:
    """A student's value for a message: its type and its (bounded) repr, and the shape
    and dtype of an array."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} of shape {tuple(value.shape)}, dtype {value.dtype}"
    if isinstance(value, (tuple, list)) and any(hasattr(v, "shape") for v in value):
        return (f"{type(value).__name__} of {len(value)}: "
                + ", ".join(described(v) for v in value[:4]))
    return f"{type(value).__name__} {shown(value)}"


def answer_array(what: str, value, kind: str = "numbers", integer: bool = False) -> np.ndarray:
    """A student's `value` as a numpy array of numbers (integers if `integer`), or
    ExerciseFailed saying what came back."""
    wanted = f"an array of {kind}"
    if value is None or isinstance(value, (str, bytes)) or callable(value):
        raise ExerciseFailed(f"{what}: expected {wanted}; got {described(value)}")
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - a ragged list, an object that will not convert
        raise ExerciseFailed(f"{what}: expected {wanted}; got {described(value)}, "
                             "which is not an array") from None
    kinds = (jnp.integer,) if integer else (jnp.integer, jnp.floating, jnp.bool_)
    if not any(jnp.issubdtype(array.dtype, k) for k in kinds):  # complex: no real answer
        dtype = "" if hasattr(value, "dtype") else f" (as an array: dtype {array.dtype})"
        raise ExerciseFailed(f"{what}: expected {wanted}; got {described(value)}{dtype}")
    return array


def check_race_free(what: str, races: bool | None) -> None:
    """`races` is `mk.kernels.backend.races_found()` after the step: True or False, or None on a
    TPU, where no race detector runs (nothing to check); None elsewhere, or a string, is
    not an answer and fails."""
    if races is None and backend.on_tpu():
        return
    if not isinstance(races, (bool, np.bool_)):
        raise ExerciseFailed(f"{what}: expected True or False (mk.kernels.backend.races_found() "
                             f"after the step); got {described(races)}")
    if races:
        raise ExerciseFailed(f"{what}: the race detector flagged a race (a slot read while "
                             "a DMA into it was in flight)")


def check_close(what: str, got, want, *, atol: float, rtol: float = 1e-5) -> float:
    """The largest |got - want|; raises when any element is outside atol + rtol * |want|,
    or `got` is not an array of numbers of want's shape (saying what came back). The
    tolerances are finite numbers >= 0 (an infinite one would pass any answer)."""
    atol, rtol = finite_number("atol", atol), finite_number("rtol", rtol)
    want = np.asarray(want, np.float32)
    with np.errstate(over="ignore"):  # 1e300 is inf in float32: it differs, as it should
        got = answer_array(what, got).astype(np.float32)
    if got.shape != want.shape:
        raise ExerciseFailed(f"{what}: expected an array of shape {want.shape} (the "
                             f"reference's); got shape {got.shape}")
    error = np.abs(got - want)
    if not np.all(error <= atol + rtol * np.abs(want)):
        raise ExerciseFailed(f"{what}: kernel and reference differ (max |kernel - reference| "
                             f"= {_largest(error)}, "
                             f"atol={atol}, rtol={rtol}, shapes {got.shape} {want.shape})")
    return float(error.max()) if error.size else 0.0


def _largest(error) -> str:
    if not error.size:
        return "n/a"
    if np.isnan(error).all():
        return "nan everywhere"
    return f"{float(np.nanmax(error))}"


def check_tokens(what: str, got, want) -> None:
    """Greedy tokens equal, exactly: integer ids of the reference's shape; names the first
    sequence and step that differ (any shape, a single token too)."""
    want = np.asarray(want)
    got = answer_array(what, got, "integer token ids", integer=True)
    if got.shape != want.shape:
        raise ExerciseFailed(f"{what}: expected tokens of shape {want.shape} (the "
                             f"reference's); got shape {got.shape}")
    bad = np.argwhere(np.atleast_1d(got != want))
    if bad.size:
        index = tuple(int(i) for i in bad[0][:got.ndim])
        where = (f"sequence {index[0]}, step {index[1]}" if got.ndim >= 2 else
                 f"step {index[0]}" if got.ndim == 1 else "its only token")
        raise ExerciseFailed(f"{what}: tokens differ from the reference first at {where}: "
                             f"got {got[index]}, reference {want[index]}")
