"""mk.cost.draft: the DSpark draft's shapes are the release's (kimi/dspark.py, copied by hand
below), a wrong field is caught, and its simulated step is positive, grows with its layers,
pays its collectives and adds to the verify step as a sum."""

import dataclasses

import pytest

from mk.cost import draft, perf
from mk.cost.machine import Assumptions
from mk.kernels.collectives import allgather_s
from mk.model.chips import RATE_ENDS, spec_of
from mk.model.presets import preset

# Inferact/tpu-megakernels at aa0094e, kimi/dspark.py: DraftConfig's defaults, ROWS, RANKS
RELEASE = dict(hidden=7168, layers=5, heads=96, kv_heads=16, head_dim=64, ffn=14_336,
               vocab=163_840, taps=(24, 48, 72, 88, 92), window=2048, markov_rank=256,
               rows=8, tp=32)
# its kernel_weight_shapes (one rank's, [K, N] as the kernel multiplies them) and the
# lm_head's 10 chunks of [7168, 512]
PER_RANK = {"fc": (8960, 896), "q": (7168, 192), "kv": (7168, 128), "o": (192, 7168),
            "gate": (7168, 512), "up": (7168, 512), "down": (512, 7168),
            "lm_head": (7168, 10 * 512), "w2t": (256, 5120)}


def _elements(shape):
    return shape[0] * shape[1]


def test_dspark_fields_are_the_releases():
    for field, value in RELEASE.items():
        assert getattr(draft.DSPARK, field) == value, field
    assert draft.DSPARK.fc_in == 5 * 7168 and draft.DSPARK.target == "kimi-k3"
    assert draft.DSPARK.cache_bytes() == 5 * 2048 * 128 * 2  # [layers, window, 128] bf16


def test_a_ranks_matrices_hold_the_releases_per_rank_weights():
    mats = draft.DSPARK.matrices()
    assert mats["fc"] == PER_RANK["fc"] and mats["lm_head"] == PER_RANK["lm_head"]
    assert mats["w2t"] == PER_RANK["w2t"]
    for i in range(5):
        assert mats[f"kv.{i}"] == PER_RANK["kv"]
        assert _elements(mats[f"q_o.{i}"]) == _elements(PER_RANK["q"]) + _elements(
            PER_RANK["o"])
        for name in ("gate", "up", "down"):
            assert mats[f"{name}.{i}"] == PER_RANK[name]
    weights = sum(map(_elements, PER_RANK.values())) + 4 * sum(
        _elements(PER_RANK[n]) for n in ("q", "kv", "o", "gate", "up", "down"))
    assert sum(map(_elements, mats.values())) == weights
    stream = draft.draft_stream(draft.DSPARK)
    assert sum(s.tiles * s.copies * s.tile[0] * s.tile[1]  # each element streams once
               for s in stream.segments + stream.tail) == weights


def test_the_draft_checks_out_against_kimi_k3():
    assert draft.check_draft(draft.DSPARK, preset("kimi-k3"), verify_rows=8) is draft.DSPARK


@pytest.mark.parametrize("field, value", [
    ("vocab", 16_384),  # an lm_head of 16384 columns: not the target's tokens
    ("hidden", 4096),  # fc reads the target's 7168-wide hidden states
    ("taps", (24, 48, 72, 88, 93)),  # Kimi K3 has layers 0..92
    ("taps", (48, 24, 72, 88, 92)),
    ("rows", 7),  # the verify checks 8 rows
    ("heads", 100),  # 100 heads do not split over 32 ranks
    ("kv_heads", 64),  # more kv heads than ranks: none replicated, the kernel's layout
])
def test_a_planted_wrong_field_is_caught(field, value):
    bad = dataclasses.replace(draft.DSPARK, **{field: value})
    with pytest.raises(ValueError, match=field):
        draft.check_draft(bad, preset("kimi-k3"), verify_rows=8)
    if field == "vocab":  # and the simulator refuses to replay it
        with pytest.raises(ValueError, match="vocab"):
            draft.simulate_draft(bad, "tpu7x")


def test_the_draft_step_is_positive_and_grows_with_its_layers():
    steps = [draft.simulate_draft(dataclasses.replace(draft.DSPARK, layers=n), "tpu7x")
             for n in (1, 3, 5)]
    assert steps[0].step_s > 0
    assert steps[0].step_s < steps[1].step_s < steps[2].step_s
    for s in steps:
        assert s.step_s >= max(s.hbm_floor_s, s.compute_s) * (1 - 1e-12)
    layer = 7168 * 2048 * 2  # a layer's weights on a rank: q, k | v, o, gate, up, down
    assert steps[2].dma_bytes - steps[1].dma_bytes == pytest.approx(
        2 * (layer + 2 * 2048 * 128 * 2))  # two layers more, and their cache read and written


def test_the_draft_step_pays_each_of_its_collectives():
    """11 all-reduces of [8, 7168] float32 (fc and two a layer) and 10 exchanges (the
    verify's argmax, the anchor's row, one per drafted token) on the compute lane."""
    spec, a = spec_of("tpu7x"), Assumptions()
    s = draft.simulate_draft(draft.DSPARK, spec, assumptions=a)
    lane = sum(e.busy_s for e in s.events if e.lane == "compute" and e.what == "collective")
    want = (11 * perf.allreduce_s(8 * 7168 * 4, 32, spec)
            + allgather_s(8 * 128 * 4, 32, spec) + allgather_s(7168 * 2, 32, spec)
            + 8 * allgather_s(128 * 4, 32, spec))
    assert lane == pytest.approx(want)
    longer = draft.simulate_draft(draft.DSPARK, spec, assumptions=dataclasses.replace(
        a, ici_latency_s=2 * spec.collective_round_s))
    assert longer.step_s > s.step_s


def test_verify_plus_draft_is_their_sum_at_each_end():
    ends = draft.draft_ends(draft.DSPARK, "tpu7x")
    assert set(ends) == set(RATE_ENDS)
    assert ends["slow"].step_s >= ends["fast"].step_s
    row = {"run": "kimi-k3 on 16 tpu7x, tau=6", "tau": 6.0, "rows": 8,
           "published_step_ms": 8.46, "simulated_ms": 16.0, "compiled_slow_ms": 29.0,
           "compiled_fast_ms": 26.0}
    out = draft.with_draft(row, ends)
    assert [(r["verify step (simulated)"], r["bundle rate"]) for r in out] == [
        ("simulated step, plan's ring", "slow"), ("compiled-kernel step", "slow"),
        ("compiled-kernel step", "fast")]
    for r, verify in zip(out, (16.0, 29.0, 26.0)):
        draft_ms = ends[r["bundle rate"]].step_ms
        assert r["verify ms"] == verify and r["draft ms"] == draft_ms
        assert r["verify + draft ms"] == pytest.approx(verify + draft_ms)
        assert r["published ms"] == 8.46
        assert r["tokens/s per user (simulated)"] == pytest.approx(6e3 / (verify + draft_ms))
    with pytest.raises(ValueError, match="rows=8"):
        draft.with_draft(row | {"rows": 4}, ends)
    with pytest.raises(ValueError, match="simulated_ms"):
        draft.with_draft({k: v for k, v in row.items() if k != "simulated_ms"}, ends)
