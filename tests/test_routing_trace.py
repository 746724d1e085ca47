"""mk.cost.routing_trace: measured routing recorded against transformers' own router choices,
turned into distinct experts (mk.cost.perf, mk.cost.sim), and read back from untrusted files."""

import json
import os
import time

import numpy as np
import pytest

import mk
from mk.cost import perf, routing_trace, sim
from mk.model import untrusted
from mk.cost.routing_trace import RoutingTrace
from builders import simulated_step

QWEN3_MOE = dict(  # MoE layers 0 and 2 (layer 1 dense), so a layer mix-up shows
    vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, intermediate_size=64, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
    max_position_embeddings=64, rope_theta=10_000.0, attn_implementation="eager",
    eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _hf_counts(model, tokens, experts: int, top_k: int) -> np.ndarray:
    """transformers' router choices over `tokens` [B, P]: the top_k of each MoE layer's
    router logits, counted per expert -> [MoE layers, experts]."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(tokens), output_router_logits=True).router_logits
    return np.stack([np.bincount(torch.topk(layer, top_k).indices.numpy().ravel(),
                                 minlength=experts) for layer in logits])


def test_a_recorded_trace_counts_transformers_router_choices(tmp_path):
    """record's counts over a prompt and its greedy tokens are transformers' router top-k
    over the same tokens, layer by layer (its MoE layers 0 and 2, layer 1 dense)."""
    from builders import build_hf_model, hf_greedy

    model = build_hf_model("qwen3_moe", QWEN3_MOE, seed=5)
    model.save_pretrained(tmp_path)
    config, params = mk.load_checkpoint(tmp_path)
    prompt = np.random.default_rng(5).integers(0, 128, (2, 7))
    steps = 4
    trace = routing_trace.record(config, params, prompt, steps)
    # fed: the prompt, then each greedy token but the last (returned, never fed back)
    fed = np.concatenate([prompt, hf_greedy(model, prompt, steps)], axis=1)
    want = _hf_counts(model, fed, config.experts, config.experts_per_token)
    assert trace.tokens == fed.size == 2 * (7 + steps)  # B x (P + steps)
    np.testing.assert_array_equal(np.asarray(trace.counts), want)
    assert trace.check_model(config) is trace
    routing_trace.save(trace, tmp_path / "trace.json")
    assert routing_trace.load(tmp_path / "trace.json", config) == trace


def test_a_trace_routes_each_layer_of_every_kind_of_router():
    """Kimi's grouped sigmoid router and gpt-oss's biased logits are recorded too: every
    MoE layer, each token's per_token distinct experts."""
    for name in ("tiny-kimi", "tiny-gpt-oss"):
        config = mk.preset(name)
        params = mk.init_params(config, 1)
        trace = routing_trace.record(config, params, np.ones((1, 3), np.int32), 2)
        assert trace.tokens == 5 and len(trace.counts) == len(config.moe_layers), name
        assert all(sum(row) == 5 * config.experts_per_token for row in trace.counts), name


def _trace(counts, tokens, per_token=2):
    return RoutingTrace("synthetic", tokens, per_token,
                        tuple(tuple(int(c) for c in row) for row in counts))


def test_even_routing_is_uniform_and_one_favourite_pair_is_shared():
    """A trace whose every expert is chosen equally often gives uniform routing's distinct
    experts; one where every token picks the same two gives "shared"'s; skew in between
    touches fewer experts than uniform routing, more than shared."""
    even = _trace([[2] * 8, [2] * 8], 8)
    favourite = _trace([[8, 8] + [0] * 6], 8)
    skewed = _trace([[6, 4, 2, 1, 1, 1, 1, 0]], 8)
    for m in (1, 3, 16):
        uniform = perf.experts_touched(8, 2, m)
        assert perf.experts_touched(8, 2, m, even) == pytest.approx(uniform, rel=1e-12)
        assert perf.experts_touched(8, 2, m, favourite) == pytest.approx(2.0, rel=1e-12)
        if m == 1:  # one token touches its two experts, whatever the routing
            assert perf.experts_touched(8, 2, m, skewed) == pytest.approx(2.0, rel=1e-12)
        else:
            assert 2.0 < perf.experts_touched(8, 2, m, skewed) < uniform
    # by hand: q = (3/4, 1/2, 1/4, 1/8 x 4, 0), two tokens
    want = 1 - 1 / 16 + 1 - 1 / 4 + 1 - 9 / 16 + 4 * (1 - 49 / 64)
    assert perf.experts_touched(8, 2, 2, skewed) == pytest.approx(want, rel=1e-12)
    assert skewed.skew() == pytest.approx(3.0) and even.skew() == 1.0


def test_a_skewed_trace_reads_fewer_expert_bytes_in_perf_and_the_simulator():
    config = mk.preset("qwen3-30b-a3b")
    E, X, L = config.experts, config.experts_per_token, len(config.moe_layers)
    tokens = 112  # each layer: the first 16 experts take 3/4 of the choices
    row = [tokens * X * 3 // 4 // 16] * 16 + [tokens * X // 4 // (E - 16)] * (E - 16)
    assert sum(row) == tokens * X
    skewed = _trace([row] * L, tokens, X)
    kw = dict(batch=4, rows=8, context=256)
    uniform, measured = (perf.predict(config, "v6e", routing=r, **kw)
                         for r in ("uniform", skewed))
    assert measured.experts_touched < uniform.experts_touched
    assert measured.expert_bytes < uniform.expert_bytes
    assert measured.experts_touched == pytest.approx(  # per MoE layer
        perf.experts_touched(E, X, 32, skewed), rel=1e-12)
    assert (sim.active_experts(config, 32, skewed)
            == round(perf.experts_touched(E, X, 32, skewed))
            < sim.active_experts(config, 32))


def test_a_trace_of_another_model_is_refused_by_field():
    config = mk.preset("qwen3-30b-a3b")
    wrong_experts = _trace([[1] * 16] * len(config.moe_layers), 8)
    with pytest.raises(ValueError, match="experts=16 but"):
        perf.predict(config, "v6e", routing=wrong_experts)
    with pytest.raises(ValueError, match="MoE layers=1 but"):
        sim.active_experts(config, 8, _trace([[1] * config.experts], 16,
                                             config.experts_per_token))
    with pytest.raises(ValueError, match="per_token=2, not the layer's 8"):
        perf.experts_touched(128, 8, 4, _trace([[2] * 128], 128))
    with pytest.raises(ValueError, match="no MoE layers"):
        routing_trace.record(mk.preset("tiny"), None, [[1]])


def test_a_presets_name_where_a_config_belongs_is_refused_by_name(tmp_path):
    """A name is no ModelConfig: refused naming it (loading a trace against one raised
    AttributeError: 'str' object has no attribute 'moe_layers')."""
    path = tmp_path / "trace.json"
    routing_trace.save(_trace([[1, 1]], 2, per_token=1), path)
    message = "config='tiny-moe' must be a ModelConfig"
    with pytest.raises(ValueError, match=message):
        routing_trace.load(path, "tiny-moe")
    with pytest.raises(ValueError, match=message):
        simulated_step("tiny-moe", "v6e")


@pytest.mark.parametrize("fields, match", [
    ({"model": "m", "tokens": 2, "per_token": 1}, "fields .* must be exactly"),
    ({"model": "m", "tokens": 2, "per_token": 1, "counts": [[1, 1]], "x": 1},
     "must be exactly"),
    ({"model": "m", "tokens": 2, "per_token": 1, "counts": [[3, -1]]},
     r"counts\[0\]\[0\]=3 must be an integer in \[0, tokens=2\]"),
    ({"model": "m", "tokens": 2, "per_token": 1, "counts": [[1, 0]]},
     r"counts\[0\] sums to 1, not tokens x per_token = 2"),
    ({"model": "m", "tokens": 2, "per_token": 1, "counts": [[1, 1], [2]]},
     r"counts\[1\] has 1 experts, counts\[0\] 2"),
    ({"model": "m", "tokens": 2, "per_token": 1, "counts": [[True, 1]]}, "integer"),
    ({"model": "m", "tokens": 2, "per_token": 1, "counts": [[1.0, 1]]}, "integer"),
    ({"model": "m", "tokens": 0, "per_token": 1, "counts": [[0]]}, "tokens"),
    ({"model": "m", "tokens": 1, "per_token": 3, "counts": [[1, 1]]},
     "per_token=3 exceeds its 2 experts"),
    ({"model": "m" * 201, "tokens": 1, "per_token": 1, "counts": [[1]]}, "at most 200"),
    ({"model": "m\ud800", "tokens": 1, "per_token": 1, "counts": [[1]]}, "lone surrogate"),
    ({"model": "m\x1b[2J", "tokens": 1, "per_token": 1, "counts": [[1]]}, "printable"),
    ({"model": "m", "tokens": 1, "per_token": 1, "counts": []}, "non-empty"),
    ([1, 2], "must be exactly"),
])
def test_a_bad_trace_file_is_refused_naming_the_field(tmp_path, fields, match):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=match) as err:
        routing_trace.load(path)
    assert str(err.value).startswith(f"routing trace {str(path)!r}: "), err.value


def test_save_refuses_what_is_no_trace(tmp_path):
    with pytest.raises(ValueError, match="trace is a dict; save writes a RoutingTrace"):
        routing_trace.save({"model": "x"}, tmp_path / "trace.json")
    assert not (tmp_path / "trace.json").exists()


def test_a_trace_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text("{'counts': __import__('os')}")
    with pytest.raises(ValueError, match="is not JSON"):
        routing_trace.load(path)


def test_a_named_pipe_is_refused_before_it_is_opened(tmp_path):
    """A FIFO would block `open` until a writer came; it is refused by its type."""
    path = tmp_path / "trace.json"
    os.mkfifo(path)
    with pytest.raises(ValueError, match=r"trace\.json' is a named pipe; only a regular"):
        routing_trace.load(path)
    with pytest.raises(ValueError, match="is a directory"):
        routing_trace.load(tmp_path)
    for path in (None, 3):  # not a path: named, not os.fspath's TypeError
        with pytest.raises(ValueError, match=f"routing trace path={path} must be a file's"):
            routing_trace.load(path)


def test_deep_json_is_refused_by_depth_not_a_recursion_error(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"nests 100000 levels deep; the limit is 32"):
        routing_trace.load(path)
    # brackets inside a string do not nest
    path.write_text(json.dumps({"model": "[[[" * 20 + '\\"{{', "tokens": 2,
                                "per_token": 1, "counts": [[1, 1]]}))
    assert routing_trace.load(path).tokens == 2


def test_depth_is_counted_in_linear_time_past_escaped_quotes(tmp_path):
    """An open string of escaped quotes: a pattern that must find the closing quote
    retried at each of them (quadratic: ~30 s for these 100 kB, hours for 16 MiB)."""
    start = time.perf_counter()
    untrusted.check_depth('"' + '\\"' * 50_000, "t.json", "routing trace")
    assert time.perf_counter() - start < 1
    path = tmp_path / "trace.json"
    path.write_text('["' + '\\"' * 50_000 + '[' * 40)
    with pytest.raises(ValueError, match="is not JSON"):  # the brackets are in the string
        routing_trace.load(path)
    path.write_text('["\\\\"' + '[' * 40)  # an escaped backslash ends the string
    with pytest.raises(ValueError, match="nests 41 levels deep; the limit is 32"):
        routing_trace.load(path)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 2**20])
def test_depth_is_the_same_whatever_the_chunks_it_is_counted_in(monkeypatch, chunk):
    """check_depth carries the open quotes and a run of backslashes across chunks: strings
    holding brackets, escaped quotes and escaped backslashes, cut at every byte."""
    monkeypatch.setattr(untrusted, "CHUNK_BYTES", chunk)
    value = {"a": [["[{", '\\"]]', "\\\\", "\\\\\\\"[["], {"b": ["x\\"]}], "c": "]]]]"}
    text = json.dumps(value)
    untrusted.check_depth(text, "t.json", "routing trace", max_depth=4)
    with pytest.raises(ValueError, match="nests 4 levels deep; the limit is 3"):
        untrusted.check_depth(text, "t.json", "routing trace", max_depth=3)


@pytest.mark.parametrize("text, match", [
    ('{"model": "m", "model": "n", "tokens": 1, "per_token": 1, "counts": [[1]]}',
     "the key 'model' appears more than once in one object"),
    ('{"model": "m", "tokens": 1' + "0" * 5000 + ', "per_token": 1, "counts": [[1]]}',
     "an integer of 5001 digits is over the limit of 64"),
])
def test_a_repeated_key_or_a_huge_integer_is_refused_naming_the_file(tmp_path, text, match):
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"trace\.json': " + match):
        routing_trace.load(path)


def test_bytes_that_are_not_utf8_are_refused_naming_the_file_and_offset(tmp_path):
    path = tmp_path / "trace.json"
    path.write_bytes(b'{"model": "\xff"}')
    with pytest.raises(ValueError, match=r"trace\.json' is not UTF-8 text: byte offset 11"):
        routing_trace.load(path)


def test_a_file_over_the_size_limit_is_refused_naming_the_limit(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(" " * 101)
    with pytest.raises(ValueError, match="larger than the limit of 100 bytes"):
        untrusted.read_text(path, "routing trace", max_bytes=100)
    assert untrusted.read_text(path, "routing trace", max_bytes=101) == " " * 101
