"""mk.speculative.spec: speculative decoding is lossless, forced acceptance is exact, rejected cache
rows never leak, and the statistics and throughput formulas are what they say.

Which runs use which verifier, and why (the budget is 150 s on one core; the XLA
reference compiles in ~3 s per shape and runs in ~10 ms, the megakernel in interpret mode
compiles in ~11 s (tiny) / ~33 s (tiny-moe) per [B, T] shape and runs in ~0.5-2 s):
- Full matrix with the XLA reference verifier: every drafter x gamma 1..7 x batch 1..4 x
  {tiny, tiny-moe}, STEPS tokens each, in one shape bucket (mk.speculative.spec module docstring) so
  each preset compiles its verifier and each drafter once (CI: tiny-moe with "self" only).
- Megakernel verifier in interpret mode, the smallest set that covers each drafter, the
  extreme gammas 1 and 7, batch 1 and 4 and both presets: two kernel shapes (tiny B=4 T=8
  with the forced, ngram and model drafters; tiny-moe B=1 T=2 with self), MK_STEPS tokens
  each. A third shape would cost another ~11-33 s compile; T=4 is covered by
  test_megakernel.py's verification test. The poisoned-cache test reuses tiny B=4 T=8.
- The distribution test runs a vocab-8 float32 model with the reference verifier (the
  rejection step is host-side numpy, the same for both verifiers).
Interpret mode does not cover time; nothing here is timed. The module runs on one xdist
worker (`make test` uses --dist loadgroup) so its compiles are shared, not repeated.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import mk
from mk.cost import perf
from mk.model import reference
from mk.speculative import runners, spec
from mk.model.config import ModelConfig
from builders import bar_count

STEPS = 6  # tokens per run of the reference matrix
MK_STEPS = 4  # tokens per megakernel run (each verification costs ~0.5-2 s)
BUCKET = 4  # the batch every XLA call is padded to: one compile per model
PRESETS = ("tiny", "tiny-moe")
pytestmark = pytest.mark.xdist_group("spec")


@pytest.fixture(scope="module")
def models():
    """preset -> (config, params, prompts [4, 6], the reference's greedy tokens [4, STEPS],
    the "model" drafter's draft model (made once: it is random noise on the target))."""
    out = {}
    for name in PRESETS:
        config = mk.preset(name)
        params = mk.init_params(config)
        prompts = np.asarray(jax.random.randint(jax.random.key(1), (4, 6), 0, config.vocab))
        want = np.asarray(reference.generate(config, params, prompts, STEPS))
        out[name] = config, params, prompts, want, spec.noisy_copy(config, params)
    return out


def options(drafter, gamma, models, name):
    if drafter == "forced":
        return {"acceptance_length": min(3, gamma + 1)}
    return {"draft": models[name][4]} if drafter == "model" else {}


# -- Validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0, 8, -1, True, 2.0])
def test_gamma_outside_1_to_7_is_a_clear_error(gamma):
    config = mk.preset("tiny")
    with pytest.raises(ValueError, match=r"gamma=.* must be an integer in \[1, 7\]"):
        spec.generate(config, {}, np.zeros((1, 4), int), 4, drafter="ngram", gamma=gamma)


def test_bad_options_are_named_before_anything_runs():
    config = mk.preset("tiny")
    prompt = np.zeros((1, 4), int)
    with pytest.raises(ValueError, match=r"acceptance_length=5 must be an integer in \[1, "
                                         r"gamma \+ 1 = 4\]"):
        spec.generate(config, {}, prompt, 4, drafter="forced", gamma=3, acceptance_length=5)
    with pytest.raises(ValueError, match="acceptance_length=2 is for drafter='forced' only"):
        spec.generate(config, {}, prompt, 4, drafter="ngram", gamma=3, acceptance_length=2)
    with pytest.raises(ValueError, match="drafter='medusa' must be one of"):
        spec.generate(config, {}, prompt, 4, drafter="medusa", gamma=3)
    with pytest.raises(ValueError, match=r"P=4 \+ steps=251 \+ gamma=3 - 1 exceeds .*=256"):
        spec.generate(config, {}, prompt, 251, drafter="ngram", gamma=3)
    with pytest.raises(ValueError, match=r"batch\*\(gamma\+1\)=72 exceeds MAX_ROWS=64"):
        spec.generate(config, {}, np.zeros((9, 4), int), 4, drafter="ngram", gamma=7)
    with pytest.raises(NotImplementedError, match="greedy decoding only"):
        spec.generate(config, {}, prompt, 4, drafter="forced", gamma=3, acceptance_length=2,
                      sampling=spec.Sampling(temperature=0.7))
    other = dataclasses.replace(config, vocab=640)
    with pytest.raises(ValueError, match="draft vocab=640 must equal the target's vocab=512"):
        spec.make_drafter("model", config, {}, gamma=3, draft=(other, {}))
    with pytest.raises(ValueError, match=r"the verifier's rows=2 must be >= gamma \+ 1 = 4"):
        spec.generate(config, {}, prompt, 4, drafter="ngram", gamma=3,
                      verifier=runners.XLA(config, {}, rows=2))
    with pytest.raises(ValueError, match="top_p=0 must be in"):
        spec.Sampling(top_p=0)


@pytest.mark.parametrize("options, message", [
    (dict(drafter=3), r"drafter=3 must be one of \('model'"),
    (dict(sampling="hot"), r"sampling='hot' must be a mk\.speculative\.spec\.Sampling, or None"),
    (dict(verifier=8), r"verifier=8 must be one of \('megakernel', 'reference'\) or a"),
    (dict(bucket="8"), r"bucket='8' must be a positive integer"),
    (dict(drafter="model", draft=("x", {})), r"draft=\('x', \{\}\) must be \(config, params\)")])
def test_options_of_the_wrong_type_are_named_not_attribute_errors(options, message):
    """Issue 65: each ended in an AttributeError from inside mk.speculative.spec."""
    options = {"drafter": "ngram"} | options
    with pytest.raises(ValueError, match=message):
        spec.generate(mk.preset("tiny"), {}, np.zeros((1, 4), int), 4, gamma=3, **options)


@pytest.mark.parametrize("fields, message", [
    (dict(temperature="1"), r"temperature='1' must be a finite number > 0"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number > 0"),
    (dict(top_p=float("nan")), r"top_p=nan must be in \(0, 1\]"),
    (dict(top_p=True), r"top_p=True must be in \(0, 1\]")])
def test_sampling_fields_are_finite_numbers_in_range(fields, message):
    with pytest.raises(ValueError, match=message):
        spec.Sampling(**fields)
    assert spec.Sampling(temperature=2, top_p=0.5).top_p == 0.5


# -- Greedy speculative decoding is the target's greedy decoding ---------------------------------
# CI: every drafter on tiny and the "self" drafter (the MoE target drafting for itself) on
# tiny-moe; tiny-moe's other drafters (~25 s: the drafters' host logic is tiny's) in
# make test-slow.
@pytest.mark.parametrize("name, drafter", [
    pytest.param(name, drafter, marks=pytest.mark.slow)
    if name == "tiny-moe" and drafter != "self" else (name, drafter)
    for name in PRESETS for drafter in spec.DRAFTERS])
def test_greedy_tokens_equal_the_target_for_every_gamma_and_batch(models, name, drafter):
    config, params, prompts, want, _ = models[name]
    for gamma in range(1, spec.MAX_GAMMA + 1):
        for batch in range(1, 5):
            got, stats = spec.generate(config, params, prompts[:batch], STEPS, drafter=drafter,
                                       gamma=gamma, verifier="reference", bucket=BUCKET,
                                       **options(drafter, gamma, models, name))
            np.testing.assert_array_equal(got, want[:batch], err_msg=f"{gamma=} {batch=}")
            assert stats.steps >= batch and stats.verifier_calls >= 1
            assert 1 <= stats.acceptance_length <= gamma + 1


# (preset, batch, gamma, drafters): one kernel shape each. The "self" drafter's case runs
# in make test-slow; CI checks that drafter with the reference verifier (the test above).
MEGAKERNEL_RUNS = [
    ("tiny", 4, 7, ("forced", "ngram", "model")),
    pytest.param("tiny-moe", 1, 1, ("self",), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, batch, gamma, drafters", MEGAKERNEL_RUNS)
def test_greedy_tokens_equal_the_target_with_the_megakernel_verifier(models, name, batch,
                                                                     gamma, drafters):
    config, params, prompts, want, _ = models[name]
    for drafter in drafters:
        got, stats = spec.generate(config, params, prompts[:batch], MK_STEPS, drafter=drafter,
                                   gamma=gamma, verifier="megakernel", backend="interpret",
                                   bucket=BUCKET, **options(drafter, gamma, models, name))
        np.testing.assert_array_equal(got, want[:batch, :MK_STEPS], err_msg=drafter)
        assert stats.verifier == "megakernel"
        if drafter == "forced":
            assert stats.acceptance_length == 3


# -- Forced acceptance ------------------------------------------------------------------------
@pytest.mark.parametrize("gamma, L", [(7, L) for L in range(1, 9)] + [(g, g + 1) for g in
                                                                       range(1, 7)])
def test_forced_acceptance_L_measures_tau_exactly_L(models, gamma, L):
    config, params, prompts, want, _ = models["tiny"]
    got, stats = spec.generate(config, params, prompts, 2 * spec.MAX_GAMMA + 2,
                               drafter="forced", gamma=gamma, acceptance_length=L,
                               verifier="reference", bucket=BUCKET)
    assert stats.acceptance_length == L
    assert stats.histogram[L - 1] == stats.steps  # every step kept exactly L tokens
    np.testing.assert_array_equal(got[:, :STEPS], want)


def test_the_progress_bar_counts_the_tokens_every_sequence_has(models, capsys):
    """tau = 2 from the prefill's token: 1, 3, 5, 7, 9 tokens; the bar stops at 8 of 8 (fed
    the overshoot, tqdm drops the total and the last "n/total" drawn is 7/8; fed one
    token per step, it ends at 5/8)."""
    config, params, prompts, _, _ = models["tiny"]
    spec.generate(config, params, prompts, 8, drafter="forced", gamma=3, acceptance_length=2,
                  verifier="reference", bucket=BUCKET, progress=True)
    assert bar_count(capsys.readouterr().err) == (8, 8)


def test_forced_acceptance_is_exact_with_the_bf16_megakernel_verifier():
    """The oracle drafts on the XLA reference, whose rounding differs from the bf16
    megakernel's: with these params and prompts (seed 4; before `Forced.settle` steps kept
    fewer than L tokens) the oracle's draft disagrees with the verifier at least once (the
    control: otherwise this case could not fail), yet every step keeps exactly L tokens and
    the tokens are the megakernel's own teacher-forced greedy tokens."""
    config = mk.preset("tiny")
    params = mk.init_params(config, seed=4)
    prompts = np.array([[2, 5], [7, 1], [3, 3], [9, 4]])
    L, gamma, steps = 6, 7, 24  # the megakernel's shape is MEGAKERNEL_RUNS[0]'s: compiled once
    oracle = spec.make_drafter("forced", config, params, gamma=gamma, acceptance_length=L,
                               batch=BUCKET)
    got, stats = spec.generate(config, params, prompts, steps, drafter=oracle, gamma=gamma,
                               backend="interpret", bucket=BUCKET)
    assert oracle.settled > 0, "the oracle agreed with the verifier: pick params that differ"
    assert stats.verifier == "megakernel" and stats.acceptance_length == L
    assert stats.histogram[L - 1] == stats.steps
    runner = runners.Megakernel(config, params, rows=gamma + 1, backend="interpret")
    last, cache = runner.prefill(prompts, config.max_context)
    greedy, fed, P = [np.argmax(last, -1)[:, None]], np.asarray(got)[:, :-1], prompts.shape[1]
    for start in range(0, steps - 1, runner.rows):
        nxt, _, cache = runner.step(cache, fed[:, start:start + runner.rows],
                                    np.full(len(prompts), P + start, np.int32))
        greedy.append(nxt)
    np.testing.assert_array_equal(np.concatenate(greedy, axis=1), got)


# -- Rejected rows of the KV cache ------------------------------------------------------------
class Poisoned(runners.Runner):
    """Wraps a verifier; before each step writes `value` into every cache row at or past
    each sequence's position (`below=True`: the rows before it instead)."""

    def __init__(self, inner, value=30.0, below=False):
        super().__init__(inner.config, inner.rows)
        self.inner, self.value, self.below, self.name = inner, value, below, inner.name

    def prefill(self, prompt, capacity):
        return self.inner.prefill(prompt, capacity)

    def step(self, cache, tokens, positions):
        S = cache.k.shape[3]
        pos = np.zeros(cache.k.shape[1], np.int32)
        pos[:len(positions)] = positions
        rows = np.arange(S)[None, :] >= pos[:, None]  # [B, S]
        if self.below:
            rows = (np.arange(S)[None, :] < pos[:, None]) & (np.arange(S)[None, :] > 0)
        mask = jnp.asarray(rows)[None, :, None, :, None]
        cache = reference.KVCache(*(jnp.where(mask, jnp.asarray(self.value, c.dtype), c)
                                    for c in cache))
        self.calls += 1
        return self.inner.step(cache, tokens, positions)


@pytest.mark.parametrize("verifier", ["reference", "megakernel"])
def test_rows_past_the_position_are_never_read(models, verifier):
    """Rejected drafts' rows (and every other row past a sequence's position) are
    overwritten or masked: poisoning them before each verification changes no token,
    while the same poison on the kept rows does (so the poison is strong enough)."""
    config, params, prompts, want, _ = models["tiny"]
    batch, gamma = 4, 7  # the megakernel's shape is MEGAKERNEL_RUNS[0]'s: compiled once
    inner = (runners.XLA(config, params, rows=8, batch=BUCKET) if verifier == "reference"
             else runners.Megakernel(config, params, rows=8, backend="interpret"))
    run = dict(drafter="ngram", gamma=gamma, bucket=BUCKET)  # ngram: mostly rejected
    got, stats = spec.generate(config, params, prompts[:batch], MK_STEPS,
                               verifier=Poisoned(inner), **run)
    assert stats.acceptance_length < gamma + 1  # some drafts were rejected
    np.testing.assert_array_equal(got, want[:batch, :MK_STEPS])
    spoiled, _ = spec.generate(config, params, prompts[:batch], MK_STEPS,
                               verifier=Poisoned(inner, below=True), **run)
    assert (np.asarray(spoiled) != want[:batch, :MK_STEPS]).any()


# -- Sampling -----------------------------------------------------------------------------------
MICRO = ModelConfig(name="micro", vocab=8, hidden=16, layers=1, heads=2, kv_heads=1,
                    head_dim=8, ffn=32, dtype="float32", max_position=64, max_context=16)


@pytest.mark.parametrize("sampling", [spec.Sampling(temperature=4.0),
                                      spec.Sampling(temperature=4.0, top_p=0.8)])
def test_rejection_sampling_keeps_the_target_distribution(sampling):
    """Tokens 2 and 3 of 3000 sequences drawn with a deliberately wrong draft model (other
    weights) follow the target's exact joint distribution (chi-square, fixed seeds), while
    samples from a verifier that kept every draft would not (the test can fail)."""
    n, prompt = 3000, np.array([[1, 5, 2]])
    params = mk.init_params(MICRO, seed=0)
    draft = (MICRO, mk.init_params(MICRO, seed=7))
    got, stats = spec.generate(MICRO, params, np.repeat(prompt, n, 0), 3, drafter="model",
                               gamma=2, sampling=sampling, verifier="reference", seed=3,
                               draft=draft)
    assert 1.1 < stats.acceptance_length < 2.9  # drafts both kept and rejected

    def conditionals(model_params):  # p(t0), p(t1 | t0), p(t2 | t0, t1)
        pairs = np.stack(np.meshgrid(np.arange(8), np.arange(8), indexing="ij"), -1)
        tokens = np.concatenate([np.repeat(prompt, 64, 0), pairs.reshape(64, 2)], 1)
        p = sampling.probs(reference.prefill(MICRO, model_params, tokens)[0])  # [64, 5, 8]
        return p[0, 2], p[::8, 3], p[:, 4].reshape(8, 8, 8)

    def rejects(samples, expected):  # the test's verdict on (t1, t2) samples [n, 2]
        counts = np.bincount(samples[:, 0] * 8 + samples[:, 1], minlength=64)
        if counts[expected == 0].any():
            return True  # a token outside the target's nucleus
        keep = expected > 0
        return scipy_stats.chisquare(counts[keep], expected[keep] * n).pvalue < 1e-3

    (p0, p1, p2), (_, q1, q2) = conditionals(params), conditionals(draft[1])
    target = np.einsum("a,ab,abc->bc", p0, p1, p2).ravel()
    assert not rejects(np.asarray(got)[:, 1:3], target)
    # A verifier that kept every draft would give sum_t0 p(t0) q(t1|t0) q(t2|t0,t1):
    wrong = np.einsum("a,ab,abc->bc", p0, q1, q2).ravel()
    draws = np.random.default_rng(0).choice(64, size=n, p=wrong / wrong.sum())
    assert rejects(np.stack([draws // 8, draws % 8], 1), target)


# -- Statistics and throughput --------------------------------------------------------------
def test_stats_by_hand():
    # gamma 3; steps kept 1, 1, 2, 3, 4, 4 tokens.
    s = spec.SpecStats(drafter="x", verifier="y", gamma=3, batch=1, histogram=(2, 1, 1, 2),
                       verifier_calls=6, drafter_calls=18)
    assert s.steps == 6
    assert s.acceptance_length == pytest.approx(15 / 6)
    assert s.position_rate == pytest.approx((4 / 6, 3 / 4, 2 / 3))
    # 9 drafts kept, 4 steps ended with a rejection: alpha = 9 / 13.
    assert s.per_token_rate == pytest.approx(9 / 13)
    assert spec.expected_length(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert spec.expected_length(1.0, 3) == 4.0
    assert spec.expected_length(0.0, 7) == 1.0


@pytest.mark.parametrize("call, message", [
    (lambda: spec.expected_length(float("nan"), 3), r"alpha=nan must be a probability"),
    (lambda: spec.expected_length(2.0, 3), r"alpha=2\.0 must be a probability"),
    (lambda: spec.expected_length("0.5", 3), r"alpha='0\.5' must be a probability"),
    (lambda: spec.expected_length([0.5, -0.1], 3), r"alpha=\[0\.5, -0\.1\] must be a"),
    (lambda: spec.expected_length(0.5, 0), r"gamma=0 must be a positive integer"),
    (lambda: spec.fit_rate([]), r"runs hold no verification step \(0 runs\)"),
    (lambda: spec.fit_rate("abc"), r"runs='abc' must be a list of SpecStats"),
    (lambda: spec.fit_rate([0.5]), r"runs\[0\]=0\.5 is a float, not a SpecStats"),
    (lambda: spec.noisy_copy(mk.preset("tiny"), {}, noise=float("nan")),
     r"noise=nan must be a finite number in \[0, inf\)")])
def test_statistics_refuse_values_that_are_no_probability_or_no_runs(call, message):
    """Issue 65: alpha = nan or 2 gave nan or 31 tokens a step, a string was parsed, no
    runs fitted nan, and a draft of noise nan was all nan."""
    with pytest.raises(ValueError, match=message):
        call()
    assert spec.expected_length(np.array([0.0, 1.0]), 2).tolist() == [1.0, 3.0]


def test_throughput_is_tau_over_verify_plus_draft_time():
    target, draft = mk.preset("qwen3-8b"), mk.preset("qwen3-0.6b")
    t = spec.throughput(target, "v6e", gamma=4, acceptance_length=3.0, batch=2, context=1024,
                        draft=draft)
    verify = perf.modelled_step_ms(target, "v6e", batch=2, rows=5, context=1024)
    one = perf.modelled_step_ms(draft, "v6e", batch=2, rows=1, context=1024)
    assert t.verify_ms == verify and t.draft_ms == pytest.approx(4 * one)
    assert t.tokens_per_s_per_user == pytest.approx(3.0 / ((verify + 4 * one) / 1e3))
    free = spec.throughput(target, "v6e", gamma=4, acceptance_length=3.0, batch=2,
                           context=1024)
    assert free.draft_ms == 0 and free.tokens_per_s_per_user > t.tokens_per_s_per_user


def test_the_step_time_is_the_ledgers_modelled_step_with_the_mxu_rule():
    """spec.step_ms's default timing is `mk.cost.perf.modelled_step_ms`, the modelled step of
    `mk.cost.ledger.TERMS`. kimi-k3-like's fp4 experts make its MXU floor the larger one, so
    `perf.predict`'s step (the FLOP floor, the former "roofline" timing) would differ."""
    kimi, kw = mk.preset("kimi-k3-like"), dict(batch=1, rows=8, context=1024, tp=1)
    got = spec.step_ms(kimi, "tpu7x", **kw)
    assert got == perf.modelled_step_ms(kimi, "tpu7x", **kw)
    assert got > 2 * perf.predict(kimi, "tpu7x", **kw).step_ms
    with pytest.raises(ValueError, match=r"timing='roofline' must be one of \('modelled'"):
        spec.step_ms(kimi, "tpu7x", timing="roofline", **kw)


def test_the_megakernel_runner_steps_quantised_weights_as_the_reference():
    """The runner's plan streams the params' own formats (`prepare` packs them so):
    a plan made without them refused the step ("weights streamed packed in ...")."""
    from mk.model import quant

    config = mk.preset("tiny")
    params = quant.quantize(config, mk.init_params(config), dense="int8")
    prompt = np.asarray(jax.random.randint(jax.random.key(0), (1, 5), 0, config.vocab))
    runner = runners.Megakernel(config, params, rows=2, backend="interpret")
    logits, cache = runner.prefill(prompt, 128)
    want, _ = runners.XLA(config, quant.dequantize(params), rows=2).prefill(prompt, 128)
    np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(want, -1))
