"""mk.kernels.collectives: in-kernel all-reduce, all-gather and greedy argmax over remote DMA.

Each device count n runs in one subprocess with 2n virtual CPU devices (tests/multidevice.py
says why), in TPU interpret mode with the race detector on; the parent compares every
device's copy with jnp, for each algorithm (`collectives.ALGORITHMS`). The all-reduce
must be bit-identical to `tree_sum` (its fixed order) on every device by either
algorithm; three collectives run back to back in one kernel so the second buffer slot and
the reuse of the first are exercised. Interpret mode does not cover time,
ICI routing or the scoped VMEM limit; the ahead-of-time compiles cover lowering for real
multi-chip topologies.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk  # noqa: F401  (sets the CPU platform before jax initialises)
from mk.kernels import backend
from mk.measure import tpu
from mk.kernels import collectives
from multidevice import planted_race_caught, race_free, run

DEVICES = (2, 4, 8)
ROWS, COLS, VOCAB_SHARD = 8, 256, 128
TIMES = {"all_reduce": 3, "all_gather": 2, "argmax": 2}  # back to back in one kernel


def inputs(n: int):
    """The same arrays in the subprocess and in the parent (numpy: no compiles here)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n * TIMES["all_reduce"], ROWS, COLS), np.float32)
    # Small integers as logits: many exact ties, across shard boundaries too.
    logits = rng.integers(0, 6, (TIMES["argmax"], ROWS, n * VOCAB_SHARD)).astype(np.float32)
    logits[0, 0, :] = 1.0
    logits[0, 0, -1] = 9.0  # the best logit is a padding column: it must not win
    # NaN is larger than any number (mk.model.reference.greedy's contract, numpy's argmax): the
    # first NaN wins, on the last shard alone, on two shards, and a whole row of NaN.
    logits[1, 1, -2] = np.nan
    logits[1, 2, [VOCAB_SHARD - 1, n * VOCAB_SHARD - 2]] = np.nan
    logits[1, 3, :] = np.nan
    return x, logits, n * VOCAB_SHARD - 1


def collective_results(_) -> dict:
    """Runs in the subprocess: every collective by each algorithm on 2, 4 and 8 devices,
    race detector on."""
    out = {}
    with backend.use("interpret", detect_races=True):
        for n in DEVICES:
            x, logits, vocab = inputs(n)
            mesh = collectives.tp_mesh(n)
            for a in collectives.ALGORITHMS:
                out[f"all_reduce_{a}_{n}"] = collectives.all_reduce(x, mesh, algorithm=a)
                out[f"all_gather_{a}_{n}"] = collectives.all_gather(
                    x[:n * TIMES["all_gather"]], mesh, algorithm=a)
                out[f"argmax_{a}_{n}"] = collectives.greedy_argmax(logits, mesh, vocab=vocab,
                                                                   algorithm=a)
                jax.block_until_ready(out)
        out["races"] = backend.races_found()
    out["planted_caught"] = planted_race_caught(2)
    return out


@functools.cache
def results() -> dict:
    """One subprocess for every multi-device check of this module."""
    return run("test_collectives:collective_results", max(DEVICES))


def test_tree_sum_adds_halves_not_left_to_right():
    parts = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
    # (1e8 + -1e8) + (1 + 1) = 2, while ((1e8 + 1) + -1e8) + 1 = 1 in float32.
    assert collectives.tree_sum(parts) == 2.0
    assert ((parts[0] + parts[1]) + parts[2]) + parts[3] == 1.0


def test_collectives_equal_numpy_on_every_device_race_free():
    got = results()
    for n in DEVICES:
        x, logits, vocab = inputs(n)
        parts = x.reshape(n, -1, ROWS, COLS)
        want_sum = collectives.tree_sum(parts)
        want_gather = x[:n * TIMES["all_gather"]].reshape(n, -1, ROWS, COLS).transpose(
            1, 0, 2, 3)
        want_tokens = np.argmax(logits[..., :vocab], axis=-1)  # the first maximum
        assert want_tokens[0, 0] == 0  # all real logits tied: the lowest id wins
        for a in collectives.ALGORITHMS:
            reduced = got[f"all_reduce_{a}_{n}"].reshape(n, *want_sum.shape)
            gathered = got[f"all_gather_{a}_{n}"].reshape(n, *want_gather.shape)
            tokens = got[f"argmax_{a}_{n}"].reshape(n, *want_tokens.shape)
            for device in range(n):
                where = f"{a} n={n} device {device}"
                np.testing.assert_array_equal(reduced[device], want_sum, where)
                np.testing.assert_array_equal(gathered[device], want_gather, where)
                np.testing.assert_array_equal(tokens[device], want_tokens, where)
        np.testing.assert_allclose(want_sum, parts.sum(0), rtol=1e-5, atol=1e-5)
        assert want_tokens[1, 2] == VOCAB_SHARD - 1 and want_tokens[1, 3] == 0  # NaN wins
    # The planted race ran in the same subprocess: only a detector that caught it there
    # vouches for "no race" in this run. It misses the planted race now and then (issue 15:
    # 54 of 60 runs caught it at n=2; measured again, 58 of 60 at n=2, in 20 fresh
    # processes and 40 runs in one, and 40 of 40 at n=4 and at n=8): then it is unknown.
    race_free(got["races"], got["planted_caught"])


@pytest.mark.parametrize("n", DEVICES)
def test_exchange_schedule_leaves_chunk_i_on_device_i_then_everything_everywhere(n):
    rows = collectives.exchanges(n)
    held = {me: set(range(n)) for me in range(n)}  # chunks whose partial sum it updates
    for e in (r for r in rows if r["phase"] == "reduce-scatter"):
        give = set(range(e["first"], e["first"] + e["count"]))
        assert give <= held[e["device"]] and e["partner"] == e["device"] ^ e["count"]
        held[e["device"]] -= give
    assert held == {me: {me} for me in range(n)}
    for r in sorted({e["round"] for e in rows if e["phase"] == "all-gather"}):
        sent = {e["device"]: set(range(e["first"], e["first"] + e["count"])) for e in rows
                if e["phase"] == "all-gather" and e["round"] == r}
        assert all(sent[me] == held[me] for me in range(n))  # it sends all it holds
        for me in range(n):
            held[me] = held[me] | sent[me ^ (1 << r)]
    assert held == {me: set(range(n)) for me in range(n)}
    sent = collectives.all_reduce_bytes(n * 1024, n)
    assert sent == 2 * (n - 1) * 1024  # the bandwidth optimum, 2 (n-1)/n of the array


@pytest.mark.parametrize("n", DEVICES)
def test_two_phase_sends_each_chunk_to_its_owner_then_each_sum_to_every_peer(n):
    rows = collectives.exchanges(n, "two_phase")
    assert {r["round"] for r in rows} == {0}  # one message round a phase
    for phase, chunk in (("reduce-scatter", lambda r: r["partner"]),
                         ("all-gather", lambda r: r["device"])):
        mine = [r for r in rows if r["phase"] == phase]
        pairs = sorted((r["device"], r["partner"]) for r in mine)
        assert pairs == sorted((a, b) for a in range(n) for b in range(n) if a != b)
        assert all(r["first"] == chunk(r) and r["count"] == 1 for r in mine)
    # as many bytes as "recursive" sends, in 2 rounds instead of 2 log2(n)
    assert sum(r["count"] for r in rows if r["device"] == 0) == sum(
        r["count"] for r in collectives.exchanges(n) if r["device"] == 0)
    assert collectives.rounds("two_phase", n) == 1
    assert collectives.rounds("recursive", n) == n.bit_length() - 1
    assert collectives.choose_algorithm(n) == ("recursive" if n == 2 else "two_phase")


def test_an_unknown_collective_algorithm_is_refused():
    with pytest.raises(ValueError, match=r"algorithm='ring' must be one of"):
        collectives.choose_algorithm(4, "ring")


@pytest.mark.parametrize("bad", [0, 3, 6, True, 2.0])
def test_a_device_count_that_is_not_a_power_of_two_is_refused(bad):
    with pytest.raises(ValueError, match=r"tp=.* must be a power of two"):
        collectives.check_devices(bad)


def test_an_all_reduce_whose_columns_do_not_split_is_refused():
    with pytest.raises(ValueError, match=r"C=101 must be a multiple of 2"):
        collectives.all_reduce(jnp.zeros((2, 8, 101)), _abstract_mesh(2))


def _abstract_mesh(n):
    return jax.sharding.Mesh(np.array(tpu.devices("v5e:2x2")[:n]), (collectives.AXIS,))


@pytest.mark.parametrize("topology", ["tpu7x:2x2x1", "v5e:2x2"])
def test_collectives_compile_for_a_multi_chip_topology(topology):
    mesh = jax.sharding.Mesh(np.array(tpu.devices(topology)), (collectives.AXIS,))
    n = mesh.shape[collectives.AXIS]
    x = jax.ShapeDtypeStruct((2 * n, 8, 5120), jnp.float32)
    logits = jax.ShapeDtypeStruct((1, 8, n * 1024), jnp.float32)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for fn, arg in ((collectives.all_reduce, x), (collectives.all_gather, x),
                        (collectives.greedy_argmax, logits)):
            for a in collectives.ALGORITHMS:
                compiled = jax.jit(lambda v, fn=fn, a=a: fn(v, mesh, algorithm=a)).lower(
                    arg).compile()
                assert compiled.memory_analysis() is not None


def test_a_missed_planted_race_makes_the_run_inconclusive_not_green():
    with pytest.raises(pytest.skip.Exception, match="inconclusive"):
        race_free(False, planted_caught=False)
    with pytest.raises(AssertionError, match="flagged a race"):
        race_free(True, planted_caught=True)
    race_free(False, planted_caught=True)  # the only green verdict
