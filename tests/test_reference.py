"""mk.model.reference and its blocks (mk.model.ops): hand-computed cases for each op, and the
decoder's self-consistency.

The external oracle (transformers) is in test_oracle_transformers.py; here the reference
is checked against arithmetic done by hand and against itself (prefill vs. step by step,
T rows at once vs. one at a time, ragged positions vs. one sequence at a time).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mk.model import ops
from mk.model import reference as R
from mk.model.presets import preset
from builders import tiny_moe_in_ci


def _check_rms_norm_by_hand(rms_norm):
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    out = rms_norm(x, jnp.array([1.0, 2.0]), eps=0.0)
    np.testing.assert_allclose(out, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)
    # eps sits inside the square root: [3, 4] / sqrt(12.5 + 1)
    out = rms_norm(x, jnp.array([1.0, 1.0]), eps=1.0)
    np.testing.assert_allclose(out, [[3 / np.sqrt(13.5), 4 / np.sqrt(13.5)]], rtol=1e-6)


def test_rms_norm_by_hand():
    _check_rms_norm_by_hand(ops.rms_norm)


RMS_NORM_MUTANTS = {  # planted bugs the by-hand cases must reject
    "eps outside the sqrt": lambda x, w, eps: x / (
        jnp.sqrt(jnp.mean(x * x, -1, keepdims=True)) + eps) * w,
    "(1 + w) weight": lambda x, w, eps: ops.rms_norm(x, 1 + w, eps),
    "eps ignored": lambda x, w, eps: ops.rms_norm(x, w, 0.0),
}


@pytest.mark.parametrize("mutant", RMS_NORM_MUTANTS)
def test_rms_norm_by_hand_rejects_a_planted_bug(mutant):
    with pytest.raises(AssertionError):
        _check_rms_norm_by_hand(RMS_NORM_MUTANTS[mutant])


def test_rope_rotates_each_half_pair_by_position_times_frequency():
    # H=4: pairs (x0, x2) rotate at frequency 1, (x1, x3) at theta^(-1/2).
    x = jnp.array([1.0, 0.0, 0.0, 1.0]).reshape(1, 1, 4)  # [T, heads, H]
    theta, p = 100.0, 3
    out = ops.rope(x, jnp.array([p]), theta)[0, 0]
    a0, a1 = p * 1.0, p / 10.0
    expected = [np.cos(a0), -np.sin(a1), np.sin(a0), np.cos(a1)]
    np.testing.assert_allclose(out, expected, atol=1e-6)
    np.testing.assert_allclose(ops.rope(x, jnp.array([0]), theta), x)


def test_attention_by_hand_two_keys_and_causal_mask():
    # One head, H=2, keys at positions 0 and 1; query row 0 sits at position 0.
    k = jnp.array([[[[1.0, 0.0], [0.0, 1.0]]]])  # [B, K, S, H]
    v = jnp.array([[[[10.0, 0.0], [0.0, 20.0]]]])
    q = jnp.array([[[[2.0, 0.0]], [[0.0, 2.0]]]])  # [B, T=2, N=1, H]
    out = ops.attention(q, k, v, jnp.array([0]))
    np.testing.assert_allclose(out[0, 0, 0], [10.0, 0.0])  # row 0 sees only key 0
    s = 2 / np.sqrt(2)
    w = np.exp([0.0, s]) / np.exp([0.0, s]).sum()  # row 1 sees both keys
    np.testing.assert_allclose(out[0, 1, 0], [10 * w[0], 20 * w[1]], rtol=1e-6)


def test_swiglu_by_hand():
    x = jnp.array([[1.0, 2.0]])
    gate, up, down = jnp.eye(2), 2 * jnp.eye(2), jnp.array([[1.0], [1.0]])
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    np.testing.assert_allclose(ops.swiglu(x, gate, up, down),
                               [[silu(1) * 2 + silu(2) * 4]], rtol=1e-6)


def test_router_renormalises_top_k_and_breaks_ties_to_the_lower_expert():
    x = jnp.array([[1.0, 0.0]])
    router = jnp.array([[2.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w, e = ops.route(x, router, top_k=2, renormalise=False)
    p = np.exp([2.0, 1, 1, 0]) / np.exp([2.0, 1, 1, 0]).sum()
    assert e.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [[p[0], p[1]]], rtol=1e-6)
    w, _ = ops.route(x, router, top_k=2, renormalise=True)
    np.testing.assert_allclose(w, [[p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])]], rtol=1e-6)


def test_moe_equals_the_weighted_sum_of_the_selected_experts():
    key = jax.random.split(jax.random.key(0), 5)
    M, D, E, F, X = 3, 8, 4, 6, 2
    x = jax.random.normal(key[0], (M, D))
    router = jax.random.normal(key[1], (D, E))
    wg, wu = jax.random.normal(key[2], (2, E, D, F))
    wd = jax.random.normal(key[3], (E, F, D))
    out = ops.moe(x, router, wg, wu, wd, X, renormalise=True)
    weights, experts = ops.route(x, router, X, True)
    for m in range(M):
        expected = sum(weights[m, j] * ops.swiglu(x[m:m + 1], wg[e], wu[e], wd[e])[0]
                       for j, e in enumerate(experts[m].tolist()))
        np.testing.assert_allclose(out[m], expected, rtol=1e-5, atol=1e-5)


def test_greedy_ties_go_to_the_lowest_token_id():
    assert R.greedy(jnp.array([[1.0, 3.0, 3.0, 2.0]])).tolist() == [1]


def _prompt(config, batch, length, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, config.vocab)


@tiny_moe_in_ci("tiny_model_f32")
def test_generate_matches_argmax_of_teacher_forced_prefill(tiny_model_f32):
    config, params = tiny_model_f32
    prompt = _prompt(config, 2, 7)
    tokens = R.generate(config, params, prompt, 6)
    logits, _ = R.prefill(config, params, jnp.concatenate([prompt, tokens[:, :-1]], 1))
    assert (R.greedy(logits[:, 6:]) == tokens).all()


@tiny_moe_in_ci("tiny_model_f32")
def test_t_rows_in_one_step_equal_prefill_of_the_same_tokens(tiny_model_f32):
    config, params = tiny_model_f32
    seq = _prompt(config, 2, 9)
    full, _ = R.prefill(config, params, seq)
    _, cache = R.prefill(config, params, seq[:, :5])
    rows, _ = R.decode_step(config, params, cache, seq[:, 5:], jnp.array([5, 5]))
    np.testing.assert_allclose(rows, full[:, 5:], rtol=1e-5, atol=1e-4)


@tiny_moe_in_ci("tiny_model_f32")
def test_ragged_positions_equal_each_sequence_decoded_alone(tiny_model_f32):
    config, params = tiny_model_f32
    a, b = _prompt(config, 1, 4, seed=2), _prompt(config, 1, 6, seed=3)
    nxt = _prompt(config, 2, 2, seed=4)
    _, ca = R.prefill(config, params, a)
    _, cb = R.prefill(config, params, b)
    cache = R.KVCache(jnp.concatenate([ca.k, cb.k], 1), jnp.concatenate([ca.v, cb.v], 1))
    both, cache = R.decode_step(config, params, cache, nxt, jnp.array([4, 6]))
    alone_a, _ = R.decode_step(config, params, ca, nxt[:1], jnp.array([4]))
    alone_b, _ = R.decode_step(config, params, cb, nxt[1:], jnp.array([6]))
    np.testing.assert_allclose(both, jnp.concatenate([alone_a, alone_b]), rtol=1e-5,
                               atol=1e-4)
    # Rows past each sequence's last written position stay untouched (zero).
    assert not cache.k[:, 0, :, 6:].any() and cache.k[:, 0, :, 5].any()


def test_taps_lead_to_the_logits(tiny_model):
    config, params = tiny_model
    cache = R.init_cache(config, 1)
    logits, _, taps = R.decode_step(config, params, cache, _prompt(config, 1, 3),
                                    jnp.array([0]), taps=True)
    assert taps["attn"].shape == taps["mlp"].shape == (config.layers, 1, 3, config.hidden)
    np.testing.assert_allclose(R.lm_head(config, params, taps["mlp"][-1]), logits)


def test_a_position_past_max_context_is_an_error_not_a_wrap():
    config = preset("tiny")
    cache = R.init_cache(config, 2, max_context=16)
    with pytest.raises(ValueError, match=r"positions\[1\]=15 with T=2 rows .* "
                                         r"max_context=16"):
        R.decode_step(config, {}, cache, jnp.zeros((2, 2), int), jnp.array([3, 15]))
    with pytest.raises(ValueError, match=r"P=10 \+ steps=8 - 1 exceeds .*max_context=16"):
        R.generate(config, {}, jnp.zeros((1, 10), int), 8, max_context=16)


def test_token_ids_outside_the_vocab_are_an_error():
    config = preset("tiny")
    cache = R.init_cache(config, 1, max_context=16)
    with pytest.raises(ValueError, match=r"vocab=512.*max=512"):
        R.decode_step(config, {}, cache, jnp.array([[512]]), jnp.array([0]))
