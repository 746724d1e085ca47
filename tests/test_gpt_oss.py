"""gpt-oss (attention with sinks, sliding-window layers, YaRN RoPE, biased clamped-SwiGLU
experts) against transformers.

Tiny random float32 `gpt_oss` models are written by transformers' `save_pretrained`, read
back with `mk.load_checkpoint` and run by `mk.model.reference`: prefill logits within 1e-4 of
their scale, 32 greedy tokens (batch 4, T = 1) and T = 4 decode steps fed transformers'
own tokens must agree, with the context past the sliding window. Two layer patterns
(sliding first and alternating, with biases; full first, two sliding layers in a row,
without attention biases), a clamp low enough to bind. Planted bugs (the window, the
sinks, the clamp, YaRN left out) each miss the tolerance the real run meets. MXFP4 experts
in gpt-oss's own layout (`*_blocks`, `*_scales`) load bit-exactly and decode like
transformers' model on the weights transformers' own converter dequantises. Also: the
config against transformers' parameter count, the presets, bad checkpoints refused by
field. Not here: the megakernel (it has no kernel for these kinds yet: a clear error is
checked).
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from builders import (assert_greedy_matches_hf, assert_prefill_matches_hf,
                      assert_t4_steps_predict_hf_tokens, assert_verify_steps, build_hf_model,
                      hf_greedy, hf_logits)
from safetensors.numpy import load_file, save_file

import mk
from mk.step import megakernel
from mk.model import quant, unpack
from mk.speculative import spec
from mk.measure import tpu
from mk.model import reference as R
from mk.model.config import padded_width
from mk.step.plan import DecodePlan
from mk.kinds import layers
from mk.kinds.layers import layer_kinds
from mk.model.presets import GPT_OSS_PRESET_NAMES
from mk.model.weights import param_count, param_shapes

LOGIT_RTOL_OF_SCALE = 1e-4  # both sides float32
PROMPT, STEPS, CONTEXT = 8, 32, 64
WINDOW = 4  # below the prompt: every sliding layer's window cuts
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              sliding_window=WINDOW, max_position_embeddings=4096, rms_norm_eps=1e-5,
              swiglu_limit=0.5, attn_implementation="eager", eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
SLIDE, FULL = "sliding_attention", "full_attention"
CASES = {
    "alternating": dict(num_hidden_layers=3),  # transformers' default: sliding first
    "full-first-no-bias": dict(num_hidden_layers=4, layer_types=[FULL, SLIDE, SLIDE, FULL],
                               attention_bias=False),
}


def written_by_transformers(fields: dict, folder, seed: int):
    """(transformers model, mk config (max_context CONTEXT), mk params, a prompt [4,
    PROMPT]) of a random gpt_oss model saved by transformers and loaded."""
    model = build_hf_model("gpt_oss", fields)
    model.save_pretrained(folder)
    config, params = mk.load_checkpoint(folder)
    config = dataclasses.replace(config, max_context=CONTEXT)
    prompt = np.random.default_rng(seed).integers(0, fields["vocab_size"], (4, PROMPT))
    return model, config, params, prompt


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return written_by_transformers({**COMMON, **CASES[request.param]},
                                   tmp_path_factory.mktemp(request.param), seed=2)


def test_loaded_config_and_sizes_match_the_transformers_model(case):
    model, config, params, _ = case
    hf = model.config
    assert config.attention_sinks and config.swiglu_limit == hf.swiglu_limit
    assert config.sliding_layers == tuple(i for i, t in enumerate(hf.layer_types)
                                          if t == SLIDE)
    assert config.sliding_window == WINDOW and config.moe_layers == tuple(range(config.layers))
    assert config.attention_bias == hf.attention_bias and config.yarn.factor == 32
    assert param_count(config.unpadded()) == sum(p.numel() for p in model.parameters())
    assert (config.hidden, config.norm_width, config.expert_ffn) == (128, 64, 128)
    assert {k: v.shape for k, v in params.items()} == {
        k: shape for k, (shape, _) in param_shapes(config).items()}


def test_prefill_logits_match_transformers_forward(case):
    model, config, params, prompt = case
    assert_prefill_matches_hf(model, config, params, prompt, LOGIT_RTOL_OF_SCALE)


def test_32_greedy_tokens_match_transformers_generate(case):
    model, config, params, prompt = case
    assert_greedy_matches_hf(model, config, params, prompt, STEPS)


@pytest.mark.parametrize("case", [pytest.param("alternating", marks=pytest.mark.slow),
                                  "full-first-no-bias"], indirect=True)
def test_t4_decode_steps_predict_transformers_tokens(case):
    model, config, params, prompt = case
    assert_t4_steps_predict_hf_tokens(model, config, params, prompt)


def _without_sinks(config, params):
    return config, params | {"sinks": params["sinks"] * 0 - 1e30}


PLANTED = {  # each feature left out: the run must miss the tolerance the real one meets
    "no window": lambda c, p: (dataclasses.replace(c, sliding_window=0, sliding_layers=()),
                               p),
    "no sinks": _without_sinks,
    "no clamp": lambda c, p: (dataclasses.replace(c, swiglu_limit=1e30), p),
    "no yarn": lambda c, p: (dataclasses.replace(c, yarn=None), p),
    # the loader holds hidden 64 lane-padded to 128: norms averaging over the padding too
    "norms over the padding": lambda c, p: (dataclasses.replace(c, padding=()), p),
}


@pytest.mark.parametrize("planted", list(PLANTED))
@pytest.mark.parametrize("case", ["alternating"], indirect=True)
def test_each_planted_omission_misses_the_tolerance(case, planted):
    model, config, params, prompt = case
    want = hf_logits(model, prompt)
    got = np.asarray(R.prefill(*PLANTED[planted](config, params), prompt)[0])
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"\n{planted}: max error {err:.2e} of the logits' scale")
    assert err > 10 * LOGIT_RTOL_OF_SCALE


def gpt_oss_blocks(q: quant.QuantWeight):
    """mk fp4 [..., I/2, O] -> gpt-oss blocks [..., O, I/32, 16] and scales [..., O, I/32]:
    values 2k (low nibble) and 2k + 1 (high) of each 32-value block along I."""
    codes = np.swapaxes(np.asarray(unpack.unpack_codes("fp4", q.data)), -1, -2)  # [.., O, I]
    pairs = codes.reshape(*codes.shape[:-1], -1, 16, 2).astype(np.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)  # safetensors writes memory order:
    return (np.ascontiguousarray(blocks),  # a transposed view would be written scrambled
            np.ascontiguousarray(np.swapaxes(np.asarray(q.scale), -1, -2)))


def written_with_mxfp4_experts(fields: dict, folder):
    """A random gpt_oss model saved by transformers, its experts then quantised to MXFP4
    and rewritten as gpt-oss stores them (`*_blocks`, `*_scales`; interleaved gate | up
    rows, quantization_config mxfp4), and the model's experts set to the values
    transformers' own converter (`convert_moe_packed_tensors`) decodes from those bytes ->
    (model, the tensors written, layer 0's mk.model.quant fp4 weights by fused name). An input
    width that is not whole 128-row packing units (a multiple of the 32-value block) is
    quantised with zero rows to the next unit, the written blocks cut back to its own."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_hf_model("gpt_oss", fields)
    model.save_pretrained(folder)
    tensors, first = load_file(folder / "model.safetensors"), {}
    for i, layer in enumerate(model.model.layers):
        for fused in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{fused}"
            w = tensors.pop(name)  # [E, in, out]
            rows = w.shape[1]
            w = np.pad(w, ((0, 0), (0, padded_width(rows) - rows), (0, 0)))
            q = quant.quantize_weight(w, "fp4", name)
            blocks, scales = gpt_oss_blocks(q)
            blocks, scales = (np.ascontiguousarray(blocks[..., :rows // 32, :]),
                              np.ascontiguousarray(scales[..., :rows // 32]))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            first.setdefault(fused, q)
            with torch.no_grad():
                getattr(layer.mlp.experts, fused).copy_(convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(scales)).float())
    save_file(tensors, folder / "model.safetensors")
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(hf))
    return model, tensors, first


def test_mxfp4_experts_in_gpt_oss_layout_load_bit_exactly_and_decode_like_transformers(
        tmp_path):
    """The experts in gpt-oss's MXFP4 layout (`written_with_mxfp4_experts`), at widths of
    96 (as gpt-oss's 2880, not whole 128-lane tiles): mk loads them lane-padded to 128,
    each packed code and scale of the file bit-exactly in its slot's corner, zero codes
    under unit scales in the padding; its reference, on their dequantised values, gives
    transformers' logits and 32 greedy tokens (the norms over the model's own 96)."""
    fields = {**COMMON, **CASES["alternating"], "hidden_size": 96, "intermediate_size": 96}
    model, tensors, first = written_with_mxfp4_experts(fields, tmp_path)
    config, params = mk.load_checkpoint(tmp_path)
    assert (config.hidden, config.expert_ffn, config.norm_width) == (128, 128, 96)
    config = dataclasses.replace(config, max_context=CONTEXT)
    codes = {name: np.asarray(unpack.unpack_codes("fp4", params[name].data[0]))
             for name in ("we_gate", "we_up", "we_down")}
    gate_up, down = first["gate_up_proj"], first["down_proj"]  # layer 0's, rows padded
    file_codes = np.asarray(unpack.unpack_codes("fp4", gate_up.data))  # 2f gate, 2f + 1 up
    for name, start in (("we_gate", 0), ("we_up", 1)):
        np.testing.assert_array_equal(codes[name][:, :96, :96],
                                      file_codes[:, :96, start::2], name)
        np.testing.assert_array_equal(np.asarray(params[name].scale[0])[:, :3, :96],
                                      np.asarray(gate_up.scale)[:, :3, start::2], name)
    np.testing.assert_array_equal(codes["we_down"][:, :96, :96],
                                  np.asarray(unpack.unpack_codes("fp4", down.data))[:, :96])
    for name, c in codes.items():  # the padding: zero codes under unit scales
        scale = np.asarray(params[name].scale[0])
        assert not c[:, 96:].any() and not c[:, :, 96:].any(), name
        assert (scale[:, 3:] == quant.UNIT_SCALE["fp4"]).all(), name
        assert (scale[:, :, 96:] == quant.UNIT_SCALE["fp4"]).all(), name
    values = quant.dequantize(params)
    prompt = np.random.default_rng(3).integers(0, fields["vocab_size"], (4, PROMPT))
    assert_prefill_matches_hf(model, config, values, prompt, LOGIT_RTOL_OF_SCALE)
    assert_greedy_matches_hf(model, config, values, prompt, STEPS)
    name = "model.layers.1.mlp.experts.gate_up_proj_blocks"  # a block of 16 values, not 32
    tensors[name] = np.ascontiguousarray(tensors[name][..., :8])
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks has shape \(8, 192, 3, 8\), "
                                         r"expected \(8, 192, 3, 16\)"):
        mk.load_checkpoint(tmp_path)


# -- The megakernel ----------------------------------------------------------------------
# A transformers-written model with gpt-oss's head dim 64 and, like gpt-oss's 2880, widths
# the megakernel holds lane-padded (224 -> 256, 96 -> 128: its norms over 224), MXFP4
# experts in gpt-oss's layout, a window of 16 below the 20-token prompt.
KERNEL_WINDOW, KERNEL_PROMPT = 16, 20
KERNEL = {**COMMON, "vocab_size": 512, "hidden_size": 224, "intermediate_size": 96,
          "head_dim": 64, "num_hidden_layers": 2, "sliding_window": KERNEL_WINDOW,
          "swiglu_limit": 1.0}  # layer 0 sliding, layer 1 full


@pytest.fixture(scope="module")
def kernel_case(tmp_path_factory):
    """(transformers model, mk config (float32, S = 128), mk params (fp4 experts), their
    dequantised values, a prompt [4, KERNEL_PROMPT], transformers' 32 greedy tokens)."""
    model, _, _ = written_with_mxfp4_experts(KERNEL, tmp_path_factory.mktemp("kernel"))
    folder = tmp_path_factory.getbasetemp() / "kernel0"
    config, params = mk.load_checkpoint(folder)
    config = dataclasses.replace(config, max_context=128)
    prompt = np.random.default_rng(4).integers(0, KERNEL["vocab_size"], (4, KERNEL_PROMPT))
    return model, config, params, quant.dequantize(params), prompt, hf_greedy(model, prompt,
                                                                            STEPS)


# ~45 s (B = 4) of interpret mode: `make test-slow`; CI runs the T = 4 steps below
@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_the_megakernel_decodes_transformers_32_greedy_tokens(kernel_case, batch):
    """T = 1, the context past every window, fp4 experts streamed packed."""
    _, config, params, _, prompt, want = kernel_case
    got = megakernel.generate(config, params, prompt[:batch], STEPS, backend="interpret",
                              max_context=128, steps_per_call=STEPS)
    np.testing.assert_array_equal(np.asarray(got), want[:batch])


def test_megakernel_verification_steps_predict_transformers_tokens_race_free(kernel_case):
    """T = 4: each step fed 4 of transformers' tokens predicts the next 4, its logits
    within 1e-4 of transformers' forward's scale; the race detector on."""
    model, config, params, values, prompt, want = kernel_case
    logits = hf_logits(model, np.concatenate([prompt, want], axis=1))
    assert_verify_steps(config, params, values, prompt, want, 4, 16, want_logits=logits,
                        rtol_of_scale=LOGIT_RTOL_OF_SCALE)


@pytest.mark.parametrize("verifier, drafters", [
    ("reference", ("self",)),  # the model's first layers: a sliding one
    pytest.param("reference", tuple(d for d in spec.DRAFTERS if d != "self"),
                 marks=pytest.mark.slow),
    pytest.param("megakernel", ("ngram",), marks=pytest.mark.slow)])  # ~30 s
def test_speculative_decoding_is_lossless(kernel_case, verifier, drafters):
    """Drafts of 3 (the "self" drafter: the model's first layer, its sliding one),
    verified 4 rows a step: the target's greedy tokens."""
    _, config, params, values, prompt, want = kernel_case
    for drafter in drafters:
        extra = {"acceptance_length": 2} if drafter == "forced" else {}
        extra |= {"draft": spec.noisy_copy(config, values)} if drafter == "model" else {}
        got, stats = spec.generate(config, values, prompt[:2], 8, drafter=drafter, gamma=3,
                                   verifier=verifier, backend="interpret", **extra)
        np.testing.assert_array_equal(np.asarray(got), want[:2, :8], err_msg=drafter)
        assert stats.verifier == verifier


@pytest.mark.parametrize("chip, formats", [
    ("tpu7x", {"experts": "fp4"}),
    pytest.param("v6e", None, marks=pytest.mark.slow),
    pytest.param("v5e", {"experts": "fp4"}, marks=pytest.mark.slow)])
def test_tiny_gpt_oss_compiles_for_tpu(chip, formats):
    """Mosaic lowers every new piece (the sinks, the windows' first tiles and masks, the
    biases, YaRN, the clamped experts, head dim 64) for a TPU generation (~10 s each)."""
    report = tpu.compile_megakernel(DecodePlan.make(mk.preset("tiny-gpt-oss"), chip=chip,
                                                    batch=4, context=1024, formats=formats))
    assert report.ok, report.error


# The published 20b whole on one core of each Colab TPU (v5e: 28-32 s in make test; v6e,
# ~100 s, under make test-slow), lane-padded (2880 -> 2944), its experts streamed fp4.
@pytest.mark.parametrize("chip", ["v5e", pytest.param("v6e", marks=pytest.mark.slow)])
def test_gpt_oss_20b_compiles_whole_for_one_colab_chip(chip):
    config = mk.preset("gpt-oss-20b")
    report = tpu.compile_megakernel(DecodePlan.make(config, chip=chip, batch=1, context=4096))
    assert report.ok, report.error
    assert {"ring_fp4", "ring_fp4_scales"} <= {b.name for b in report.vmem.buffers}
    # the compiler's arguments are the plan's HBM bytes (packed experts, KV cache once)
    assert report.argument_bytes == pytest.approx(report.hbm_bytes, rel=0.01)


@pytest.mark.parametrize("name", GPT_OSS_PRESET_NAMES)
def test_presets_are_gpt_oss_shaped(name):
    """The presets' sizes against the published parameter counts (gpt-oss-20b: 20.9B,
    120b: 116.8B, the model card's); their kinds are gpt-oss's."""
    config = mk.preset(name)
    assert config.attention_sinks and config.swiglu_limit and config.yarn is not None
    assert config.sliding_window and config.sliding_layers == tuple(range(0, config.layers, 2))
    published = {"gpt-oss-20b": 20.9e9, "gpt-oss-120b": 116.8e9}
    if name in published:  # held lane-padded: 2880 -> 2944, zeros
        assert param_count(config.unpadded()) == pytest.approx(published[name], rel=0.01)
        assert (config.hidden, config.expert_ffn, config.norm_width) == (2944, 2944, 2880)
    assert [k.name for k in layer_kinds(config)] == ["sink_gqa", "clamped_moe"]


def test_a_layer_kind_without_a_kernel_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(layers, "KINDS", tuple(k for k in layers.KINDS
                                               if k.name != "sink_gqa"))
    with pytest.raises(NotImplementedError, match=r"layer kinds \['sink_gqa'\] have no "
                                                  "kernel yet"):
        layers.layer_kinds(mk.preset("tiny-gpt-oss"))


def _folder(tmp_path, fields=None, edit=None):
    model = build_hf_model("gpt_oss", {**COMMON, **CASES["alternating"], **(fields or {})})
    model.save_pretrained(tmp_path)
    if edit:
        tensors = load_file(tmp_path / "model.safetensors")
        edit(tensors)
        save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_bad_gpt_oss_checkpoints_are_refused_by_field(tmp_path):
    """A missing sink, an expert bias of the wrong width; in config.json a window of 0, a
    bool, none for the sliding layers or one past the longest context, an unknown layer
    type, a bad or missing YaRN factor or rope type, a negative clamp."""
    folder = _folder(tmp_path, edit=lambda t: t.pop("model.layers.1.self_attn.sinks"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.sinks "
                                         r"\(mk sinks\[1\]\)"):
        mk.load_checkpoint(folder)

    def narrow(t):
        name = "model.layers.2.mlp.experts.gate_up_proj_bias"
        t[name] = t[name][:, :-2]
    folder = _folder(tmp_path, edit=narrow)
    with pytest.raises(ValueError, match=r"gate_up_proj_bias has shape \(8, 62\), expected "
                                         r"\(8, 64\)"):
        mk.load_checkpoint(folder)
    hf = json.loads((folder / "config.json").read_text())
    for window, why in ((0, "sliding_window=0 must be a positive integer"),
                        (True, "sliding_window=True must be a positive integer"),
                        (None, "sliding_window=None must be a positive integer"),
                        (5000, "sliding_window=5000 exceeds max_position=4096")):
        bad = {**hf, "sliding_window": window}
        with pytest.raises(ValueError, match=why):
            mk.ModelConfig.from_hf(bad)
    with pytest.raises(ValueError, match=r"layer_types \['sliding_attention', 'chunked'.*"
                                         r"must hold num_hidden_layers=3"):
        mk.ModelConfig.from_hf({**hf, "layer_types": [SLIDE, "chunked", FULL]})
    with pytest.raises(ValueError, match=r"yarn\.factor=-2\.0 must be a finite number > 0"):
        mk.ModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"],
                                                          "factor": -2.0}})
    with pytest.raises(ValueError, match="rope_parameters: truncate='false' must be true or"):
        mk.ModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"],
                                                          "truncate": "false"}})
    with pytest.raises(ValueError, match="attention_bias='false' must be true or false"):
        mk.ModelConfig.from_hf({**hf, "attention_bias": "false"})  # bool() of it is True
    no_factor = {k: v for k, v in hf["rope_parameters"].items() if k != "factor"}
    with pytest.raises(ValueError, match="YaRN rope_parameters without factor"):
        mk.ModelConfig.from_hf({**hf, "rope_parameters": no_factor})
    with pytest.raises(NotImplementedError, match="rope_type 'default' and 'yarn'"):
        mk.ModelConfig.from_hf({**hf, "rope_parameters": {**hf["rope_parameters"],
                                                          "rope_type": "longrope"}})
    with pytest.raises(ValueError, match=r"swiglu_limit=-1\.0 must be a finite number"):
        mk.ModelConfig.from_hf({**hf, "swiglu_limit": -1.0})
