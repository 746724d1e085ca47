"""mk.course.derivations: 11b's check passes a right all-reduce time however it is written,
and fails, naming the case, on each typical mistake (one phase's rounds, the whole message
on the wire, one phase's bytes, a unit, the algorithm or the round given ignored, rounds
at tp = 1) and on answers that are not a number of seconds. mk's own time model is
`tests/test_collectives.py`'s.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mk.course import course, derivations
from mk.kernels.collectives import (allreduce_s, choose_algorithm, ici_bandwidth, round_s,
                                    rounds)


def _allreduce(phases=2, share=lambda tp: 2 * (tp - 1) / tp, scale=1.0,
               algorithm_given=True, latency_given=True, rounds_at_one=None):
    """A learner's all-reduce time, right by default, else with one of the mistakes."""
    def fn(nbytes, tp, spec, algorithm=None, latency_s=None):
        algorithm = choose_algorithm(tp, algorithm if algorithm_given else None)
        n = rounds(algorithm, tp) if rounds_at_one is None or tp > 1 else rounds_at_one
        latency = round_s(spec, latency_s if latency_given else None)
        return scale * (phases * n * latency + share(tp) * nbytes / ici_bandwidth(spec))
    return fn


def test_a_right_time_written_from_the_pieces_passes_and_gives_the_derivation():
    assert all(case.nbytes % 1024 == 0 for case in derivations.ALLREDUCE_CASES)  # KiB rows
    rows = course.check_allreduce_s(_allreduce())
    assert len(rows) == len(derivations.ALLREDUCE_CASES)
    for row, case in zip(rows, derivations.ALLREDUCE_CASES):
        total = row["rounds µs"] + row["bytes µs"]
        assert math.isclose(total, row["yours µs"], rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(row["yours µs"] * 1e-6, allreduce_s(
            case.nbytes, case.tp, derivations.spec_of(case.chip), case.algorithm,
            case.latency_s), rel_tol=1e-9, abs_tol=1e-15)
    kimi = rows[0]  # the release's headline: latency-bound at TPU7x's measured round
    assert kimi["rounds µs"] > kimi["bytes µs"] > 0 and rows[-1]["yours µs"] == 0


@pytest.mark.parametrize("mistake, match", [
    (dict(phases=1), "differ .*Kimi K3"),
    (dict(share=lambda tp: 1), "differ .*Kimi K3"),
    (dict(share=lambda tp: (tp - 1) / tp), "differ .*Kimi K3"),
    (dict(scale=1e6), "yours is the time in µs"),
    (dict(scale=1e3), "yours is the time in ms"),
    (dict(algorithm_given=False), "differ .*algorithm='recursive'.*log2"),
    (dict(latency_given=False), "differ .*latency_s=2.5e-06.*round given"),
    (dict(rounds_at_one=1), "differ .*tp=1.*nothing to exchange"),
])
def test_each_typical_mistake_fails_naming_its_case(mistake, match):
    with pytest.raises(course.ExerciseFailed, match=match):
        course.check_allreduce_s(_allreduce(**mistake))


@pytest.mark.parametrize("answer", [None, "11.5 us", float("nan"), True, np.ones(2)])
def test_an_answer_that_is_not_seconds_fails_saying_what_came_back(answer):
    with pytest.raises(course.ExerciseFailed, match="expected a finite number of seconds"):
        course.check_allreduce_s(lambda nbytes, tp, spec, algorithm, latency_s: answer)


def test_a_numpy_or_float32_jax_scalar_is_a_number_of_seconds():
    course.check_allreduce_s(lambda *args: np.float64(allreduce_s(*args)))
    course.check_allreduce_s(lambda *args: jnp.asarray(allreduce_s(*args), jnp.float32))


def test_a_function_that_raises_or_takes_other_arguments_fails_the_exercise():
    def raises(nbytes, tp, spec, algorithm=None, latency_s=None):
        return nbytes / 0
    with pytest.raises(course.ExerciseFailed, match="raised ZeroDivisionError"):
        course.check_allreduce_s(raises)
    with pytest.raises(course.ExerciseFailed, match="cannot take them"):
        course.check_allreduce_s(lambda nbytes, tp: 0.0)
