"""Notebook 11b's exercise: read a verdict line back to its derivation. Every collective
line of a review (the step's collectives term, the latency grid's collective chain) sums
all-reduces that `mk.kernels.collectives.allreduce_s` prices; the learner writes one from
its inputs (message rounds at the chip's round, bytes at one device's link bandwidth), and
`check_allreduce_s` compares it with mk's own on `ALLREDUCE_CASES` (each algorithm, a
latency-bound and a bandwidth-bound message, a round given, an empty message, tp = 1),
failing on the first case it gets wrong, saying what that case exercises, and returning
the derivation's terms as table rows.

Not here: the other exercises (`mk.course.course`, which re-exports `check_allreduce_s`),
the worked answer (`mk.course.solutions`), the time model itself (`mk.kernels.collectives`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from mk.cost.ledger import VERIFY_ROWS
from mk.course.grading import ExerciseFailed, check_function, described, learners_code
from mk.kernels import collectives
from mk.model.chips import spec_of
from mk.model.presets import preset


class Case(NamedTuple):
    """One all-reduce the check prices both ways, and what it exercises."""
    chip: str
    nbytes: int
    tp: int
    algorithm: str | None
    latency_s: float | None
    what: str


# Kimi K3's all-reduce in a verification step: B=1 x T=VERIFY_ROWS rows of float32 partial sums
KIMI_SUMS = VERIFY_ROWS * preset("kimi-k3").hidden * collectives.PARTIAL_SUM_BYTES
ALLREDUCE_CASES = (
    Case("tpu7x", KIMI_SUMS, 32, None, None,
         "Kimi K3's verification step at TP32 on TPU7x: two_phase, the chip's measured round"),
    Case("tpu7x", KIMI_SUMS, 8, "recursive", None,
         "the algorithm given: recursive takes log2(tp) rounds a phase"),
    Case("tpu7x", 64 * 2**20, 8, None, None,
         "a 64 MiB message: bandwidth-bound, each device sends 2 (tp - 1) / tp of it"),
    Case("v5e", 2**20, 4, None, 2.5e-6,
         "a round given (latency_s), on a chip with no measured round or link"),
    Case("tpu7x", 0, 2, None, None, "an empty message: the rounds alone"),
    Case("v6e", 2**20, 1, None, None, "tp = 1: nothing to exchange, 0 s"),
)
UNITS = {1e3: "ms", 1e6: "µs", 1e9: "ns"}  # got / want of an answer in the wrong unit


def _seconds(what: str, value) -> float:
    """A learner's answer as a finite number of seconds, or ExerciseFailed."""
    number = (isinstance(value, (int, float, np.integer, np.floating))
              or (hasattr(value, "shape") and getattr(value, "shape", None) == ()
                  and np.issubdtype(np.asarray(value).dtype, np.number)))
    if isinstance(value, (bool, np.bool_)) or not number or not math.isfinite(float(value)):
        raise ExerciseFailed(f"{what}: expected a finite number of seconds; got "
                             f"{described(value)}")
    return float(value)


def _unit_slip(got: float, want: float) -> str:
    """A hint where got is want in ms, µs or ns (or the reverse)."""
    if got <= 0 or want <= 0:
        return ""
    for factor, unit in UNITS.items():
        for ratio, said in ((factor, f"in {unit}"), (1 / factor, f"divided by {factor:g}")):
            if math.isclose(got / want, ratio, rel_tol=1e-5):
                return (f"; yours is the time {said}: the answer is in seconds (round_s "
                        "gives seconds, ici_bandwidth bytes/s)")
    return ""


def check_allreduce_s(fn) -> list[dict]:
    """11b's exercise: `fn(nbytes, tp, spec, algorithm, latency_s)` (arguments as
    `mk.kernels.collectives.allreduce_s` takes them) must give its seconds on every case of
    ALLREDUCE_CASES (to 1e-6 relative: float32 will do). Returns a row per case: the rounds'
    and the bytes' terms of mk's own and your total, in µs."""
    check_function("your all-reduce time", fn, collectives.allreduce_s)
    rows = []
    for case in ALLREDUCE_CASES:
        spec = spec_of(case.chip)
        args = (case.nbytes, case.tp, spec, case.algorithm, case.latency_s)
        shown_args = (f"nbytes={case.nbytes}, tp={case.tp}, spec={case.chip}, "
                      f"algorithm={case.algorithm!r}, latency_s={case.latency_s!r}")
        want = collectives.allreduce_s(*args)
        rounds_s = collectives.allreduce_s(0, *args[1:])
        with learners_code(f"your function on ({shown_args})", "a number of seconds"):
            got = fn(*args)
        got = _seconds(f"your function on ({shown_args})", got)
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-15):
            raise ExerciseFailed(
                f"your all-reduce time and mk's differ on ({shown_args}), {case.what}: got "
                f"{got:.6g} s, expected {want:.6g} s = {rounds_s:.6g} s of message rounds + "
                f"{want - rounds_s:.6g} s of bytes{_unit_slip(got, want)}")
        algorithm = collectives.choose_algorithm(case.tp, case.algorithm)
        rows.append({"case": case.what, "chip": case.chip, "tp": case.tp,
                     "algorithm": algorithm if case.tp > 1 else "-",
                     "message KiB": case.nbytes // 1024,  # every case's is whole KiB
                     "rounds": 2 * collectives.rounds(algorithm, case.tp),
                     "rounds µs": rounds_s * 1e6, "bytes µs": (want - rounds_s) * 1e6,
                     "yours µs": got * 1e6})
    return rows
