"""Untrusted checkpoints and quantised weights (issue 39): a checkpoint's files stay inside
its folder, its text (the model's name, config values, tensor names) is validated or
reaches errors escaped and bounded, and quantised weights are checked like loaded ones
(finite before quantising, their layout on construction). Each case is a clear error
naming the field, the value and the limit, raised before anything is traced.

Cheap by construction: nothing here runs a kernel. The entry points that refuse
quantised weights, and the valid configs that run or are refused by name, are in
tests/test_bad_inputs.py.
"""

import dataclasses
import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from builders import hf_config_dict, hf_tensors, save_hf_checkpoint, write_hf_folder

import mk
from mk.step import megakernel
from mk.model import quant
from mk.model.checkpoint import init_params, load_checkpoint
from mk.model.config import ModelConfig
from mk.step.plan import DecodePlan
from mk.model.presets import preset

TINY = preset("tiny")


@pytest.fixture(scope="module")
def params():
    return init_params(TINY)


# -- Untrusted checkpoints -------------------------------------------------------------------
def _outside(folder, how):
    """Move the first shard of a 2-shard checkpoint out of `folder`, reached by `how`."""
    first, index = "model-00001-of-00002.safetensors", folder / "model.safetensors.index.json"
    out = folder.parent / "elsewhere.safetensors"
    (folder / first).rename(out)
    if how == "symlink":
        (folder / first).symlink_to(out)
        return
    target = "../elsewhere.safetensors" if how == "dotdot" else str(out)
    hf = json.loads(index.read_text())
    hf["weight_map"] = {k: target if v == first else v for k, v in hf["weight_map"].items()}
    index.write_text(json.dumps(hf))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_checkpoint_shards_outside_the_folder_are_refused(tmp_path, params, how):
    folder = save_hf_checkpoint(TINY, params, tmp_path / "ckpt", shards=2)
    _outside(folder, how)
    with pytest.raises(ValueError, match=re.escape(f"{folder}: model.safetensors.index.json "
                                                   "maps tensor 'lm_head.weight' and ")
                       + r"\d+ more to .*outside the checkpoint folder"):
        load_checkpoint(folder)


def test_a_single_file_symlinked_out_of_the_folder_is_refused(tmp_path, params):
    folder = save_hf_checkpoint(TINY, params, tmp_path / "ckpt")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="its weights are 'model.safetensors', a symlink to "
                                         ".*elsewhere.safetensors', outside"):
        load_checkpoint(folder)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_weights_file_that_is_a_named_pipe_is_refused_not_opened(tmp_path, params, shards):
    """safetensors' open of a FIFO blocks until a writer comes: load_checkpoint hung."""
    save_hf_checkpoint(TINY, params, tmp_path, shards=shards)
    pipe = sorted(tmp_path.glob("*.safetensors"))[-1]
    pipe.unlink()
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match=re.escape(f"{pipe.name}' is a named pipe; only a "
                                                   "regular file is read")):
        load_checkpoint(tmp_path)


def test_a_hugging_face_cache_snapshot_symlinked_to_its_blobs_loads(tmp_path, params):
    repo = tmp_path / "models--org--tiny"
    folder = save_hf_checkpoint(TINY, params, repo / "snapshots" / "0123abc")
    (repo / "blobs").mkdir()
    (folder / "model.safetensors").rename(repo / "blobs" / "f00d")
    (folder / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    _, loaded = load_checkpoint(folder)
    np.testing.assert_array_equal(loaded["wq"], params["wq"])


NAME_PAYLOADS = {"img onerror": "x/<img src=x onerror=alert(document.domain)>",
                 "fence and include": "x/a\n```{include} /etc/os-release\n```",
                 "backticks": "org/`x`", "a local path": "/home/me/ckpt", "5000 characters":
                 "x" * 5000}


@pytest.mark.parametrize("payload", list(NAME_PAYLOADS))
def test_a_checkpoint_names_its_model_only_with_a_hub_style_name(payload):
    hf = hf_config_dict(TINY) | {"_name_or_path": NAME_PAYLOADS[payload]}
    with pytest.raises(ValueError, match=r"config.json: _name_or_path=.* must be a model name "
                                         "or a hub-style 'org/name'") as err:
        ModelConfig.from_hf(hf)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
    for name in ("tiny", "Qwen/Qwen3-0.6B"):
        assert ModelConfig.from_hf(hf | {"_name_or_path": name}).name == name.split("/")[-1]


@pytest.mark.parametrize("field", ["model_type", "dtype", "hidden_act"])
def test_config_errors_echo_checkpoint_text_escaped_and_bounded(field):
    payload = "<script>\n```{include} /etc/os-release\n```" + "y" * 5000
    with pytest.raises((ValueError, NotImplementedError), match=field) as err:
        ModelConfig.from_hf(hf_config_dict(TINY) | {field: payload})
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_loader_errors_escape_tensor_names_from_the_file(tmp_path, params):
    tensors = hf_tensors(TINY, params) | {"x\n```{include} /etc/os-release\n```" + "y" * 9000:
                                          np.zeros(1, np.float32)}
    folder = write_hf_folder(hf_config_dict(TINY), tensors, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"unexpected tensor x\\n```") as err:
        load_checkpoint(folder)
    assert len(str(err.value).splitlines()) == 2 and len(str(err.value)) < 2200


def test_a_tied_checkpoint_storing_a_quantised_lm_head_names_it(tmp_path):
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    weights = init_params(tied)
    head = np.asarray(weights["embed"], np.float32).astype(jnp.float8_e4m3fn)
    hf = hf_config_dict(tied) | {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    folder = write_hf_folder(hf, hf_tensors(tied, weights) | {"lm_head.weight": head},
                             tmp_path / "ckpt")
    with pytest.raises(ValueError, match="lm_head.weight is stored as 'F8_E4M3', but "
                                         "config.json says tie_word_embeddings=true"):
        load_checkpoint(folder)


KIMI_HF = dict(model_type="kimi_linear", vocab_size=512, hidden_size=256,
               intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=2, kv_lora_rank=128, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, num_experts=8, num_experts_per_token=2,
               rms_norm_eps=1e-6, model_max_length=4096,
               layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
               linear_attn_config=dict(num_heads=2, head_dim=128, short_conv_kernel_size=4))


def test_kimi_mlp_layer_type_typos_are_refused_not_read_as_dense():
    good = ModelConfig.from_hf(KIMI_HF | {"mlp_layer_types": ["dense"] + ["sparse"] * 3})
    assert good.moe_layers == (1, 2, 3)
    with pytest.raises(ValueError, match=r"mlp_layer_types \['dense', 'sparse', 'spares', "
                                         r"'Sparse'\] must hold num_hidden_layers=4 of 'dense' "
                                         r"/ 'sparse' \(got \['Sparse', 'spares'\]\)"):
        ModelConfig.from_hf(KIMI_HF | {"mlp_layer_types": ["dense", "sparse", "spares",
                                                           "Sparse"]})


# -- Quantised weights checked like loaded ones -----------------------------------------------
@pytest.mark.parametrize("scheme", quant.SCHEMES)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_quantize_refuses_non_finite_weights_naming_the_weight_and_count(params, scheme,
                                                                          value):
    w_up = np.asarray(params["w_up"], np.float32).copy()
    w_up[1, 3, [5, 7]] = value
    with pytest.raises(ValueError, match="w_up: 2 of 262144 values are NaN or inf; quantize "
                                         "needs finite weights"):
        mk.quantize(TINY, params | {"w_up": jnp.asarray(w_up, jnp.bfloat16)}, dense=scheme)


def _relaid(scheme, change):
    q = quant.quantize_weight(init_params(TINY)["wq"], scheme, "wq")
    return lambda: quant.QuantWeight(*change(q.data, q.scale), scheme)


@pytest.mark.parametrize("case, message", [
    (("fp8", lambda d, s: (d.view(jnp.int8), s)),  # flips half the weights' signs
     r"QuantWeight\(fp8\): data dtype int8 must be uint8"),
    (("int8", lambda d, s: (d.view(jnp.uint8), s)),
     r"QuantWeight\(int8\): data dtype uint8 must be int8"),
    (("fp8", lambda d, s: (d, s.astype(jnp.bfloat16))),
     r"QuantWeight\(fp8\): scale dtype bfloat16 must be float32"),
    (("int4", lambda d, s: (d, jnp.repeat(s, 2, axis=-2))),  # groups of 64
     r"QuantWeight\(int4\): scale shape \(2, 4, 512\) must be \(2, 2, 512\) for data "
     r"\(2, 128, 512\) \(one per 128 rows of a column\)"),
    (("int8", lambda d, s: (d, jnp.broadcast_to(s, d.shape))),  # per element
     r"QuantWeight\(int8\): scale shape \(2, 256, 512\) must be \(2, 1, 512\)"),
    (("fp4", lambda d, s: (d[:, :32], s[:, :4])),
     r"QuantWeight\(fp4\): data shape \(2, 32, 512\) must be \[\.\.\., R, O\] with R a "
     "multiple of 64")], ids=["fp8 data int8", "int8 data uint8", "fp8 scale bf16",
                               "int4 scales of 64", "int8 per-element scales", "fp4 rows"])
def test_quant_weights_check_their_layout_on_construction(case, message):
    with pytest.raises(ValueError, match=message):
        _relaid(*case)()


def test_quant_weights_in_every_valid_layout_still_construct():
    for scheme in quant.SCHEMES:
        q = quant.quantize_weight(init_params(TINY)["wq"], scheme, "wq")
        quant.tile_major(quant.pad_columns(q, 128), 128, 128)
        quant.abstract_weight((2, 256, 512), scheme)
    with pytest.raises(ValueError, match="QuantWeight scheme='int3' must be one of"):
        quant.QuantWeight(q.data, q.scale, "int3")


def _planted(params, scheme, field, index, value):
    """TINY's params with the dense group in `scheme`, and wq's `field` holding `value` at
    `index` (written through float32 for bf16 scales)."""
    q = mk.quantize(TINY, params, dense=scheme)
    wq = q["wq"]
    a = np.asarray(getattr(wq, field))
    planted = a.astype(np.float32) if a.dtype == jnp.bfloat16 else a.copy()
    planted[index] = value
    parts = {"data": wq.data, "scale": wq.scale} | {
        field: jnp.asarray(planted, getattr(wq, field).dtype)}
    return q | {"wq": quant.QuantWeight(parts["data"], parts["scale"], scheme)}


@pytest.mark.parametrize("scheme, field, value, what", [
    ("int8", "scale", np.nan, "NaN or inf"), ("fp8", "scale", np.inf, "NaN or inf"),
    ("int4", "scale", -np.inf, "NaN or inf"), ("fp4", "scale", 255, r"codes 0xff \(NaN\)"),
    ("fp8", "data", 0x7F, r"codes 0x7f / 0xff \(NaN\)")])
def test_nan_scales_and_codes_are_refused_where_quantised_weights_enter(params, scheme,
                                                                         field, value, what):
    """A NaN or inf scale (or a code that decodes to NaN) spoils a whole group of weights:
    `mk.model.quant.check_values` names the weight, the field, the count and the first index,
    before anything is traced, wherever concrete quantised weights enter: quantize (a
    weight it keeps quantised), mk.step.megakernel.prepare, and the loader
    (tests/test_quant.py: fp8 and MXFP4 checkpoints)."""
    bad = _planted(params, scheme, field, (1, 0, 2), value)
    size = getattr(bad["wq"], field).size
    message = (rf"wq \({scheme}\): 1 of {size} {field} values are {what}, the first at "
               rf"\(1, 0, 2\); a quantised weight's {field} must decode to finite numbers")
    with pytest.raises(ValueError, match=message):
        mk.quantize(TINY, bad, lm_head="int8")
    plan = DecodePlan.make(TINY, batch=1, context=256, formats=dict(dense=scheme))
    with pytest.raises(ValueError, match=message):
        megakernel.prepare(plan, bad)
    megakernel.prepare(plan, mk.quantize(TINY, params, dense=scheme))  # the good ones


def test_prepare_refuses_params_that_are_not_the_plans_by_name(params):
    """The plan's model's tensors, a quantised weight by its logical shape; quantize
    refuses to quantise a weight twice."""
    q = mk.quantize(TINY, params, dense="int8")
    plan = DecodePlan.make(TINY, batch=1, context=256, formats=dict(dense="int8"))
    with pytest.raises(ValueError, match=r"params has no 'wq', which tiny needs"):
        megakernel.prepare(plan, {k: v for k, v in q.items() if k != "wq"})
    wrong = quant.quantize_weight(jnp.swapaxes(params["wo"], -1, -2), "int8", "wo")
    with pytest.raises(ValueError, match=r"params\['wo'\] is int8\[2, 256, 512\]; "
                                         r"tiny needs \[2, 512, 256\]"):
        megakernel.prepare(plan, q | {"wo": wrong})
    with pytest.raises(ValueError, match=r"params\['wq'\] is quantised already \(int8\); "
                                         "quantize takes plain weights"):
        mk.quantize(TINY, q, dense="int8")
