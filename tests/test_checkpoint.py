"""`mk.model.checkpoint.load_checkpoint`: round trips through Hugging Face folders written without
torch, and one test per way a checkpoint can be wrong (each asserts the error names the
offending tensor or file). The external oracle (real transformers models) is
tests/test_oracle_transformers.py.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from builders import hf_config_dict, hf_tensors, save_hf_checkpoint, write_hf_folder

import mk.model.checkpoint
from mk.model.checkpoint import init_params, load_checkpoint
from mk.model.hf_layout import hf_layout
from mk.model.presets import preset
from mk.model.weights import param_shapes

# from_hf sets max_context = min(4096, max_position); tiny presets use max_position 4096.
TINY = dataclasses.replace(preset("tiny"), max_context=4096)
TINY_TIED = dataclasses.replace(TINY, name="tiny-tied", tie_embeddings=True)
TINY_MOE = dataclasses.replace(preset("tiny-moe"), experts=4, max_context=4096)
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


def assert_same_params(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]),
                                      err_msg=name)


def load_error(folder) -> str:
    with pytest.raises(ValueError) as err:
        load_checkpoint(folder)
    return str(err.value)


@pytest.mark.parametrize("config, shards", [(TINY, 1), (TINY_TIED, 1), (TINY, 3),
                                            (TINY_MOE, 1), (TINY_MOE, 4)],
                         ids=["untied", "tied", "sharded", "moe", "moe-sharded"])
def test_round_trip_gives_identical_params_and_config(tmp_path, config, shards):
    params = init_params(config, seed=1)
    save_hf_checkpoint(config, params, tmp_path, shards=shards)
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == config
    assert_same_params(loaded, params)


def test_hf_layout_fills_every_parameter_slot_exactly_once():
    for config in (TINY, TINY_TIED, TINY_MOE):
        shapes = param_shapes(config)
        slots = [(param, index) for param, index, _ in hf_layout(config).values()]
        assert len(slots) == len(set(slots))
        for param, (shape, _) in shapes.items():
            rows = sorted(index for name, index in slots if name == param)
            assert rows == sorted(np.ndindex(*shape[:len(rows[0])])), param


def test_dtype_override_casts_params_and_goes_into_config(tmp_path):
    params = init_params(TINY, seed=2)  # bfloat16
    save_hf_checkpoint(TINY, params, tmp_path)
    config, loaded = load_checkpoint(tmp_path, dtype="float32")
    assert config == dataclasses.replace(TINY, dtype="float32")
    assert_same_params(loaded, {k: v.astype(jnp.float32) for k, v in params.items()})


def test_float16_tensors_are_cast_to_the_config_dtype(tmp_path):
    params = init_params(TINY, seed=3)
    tensors = {k: v.astype(np.float16) for k, v in hf_tensors(TINY, params).items()}
    write_hf_folder(hf_config_dict(TINY), tensors, tmp_path)
    _, loaded = load_checkpoint(tmp_path)
    assert loaded["wq"].dtype == jnp.bfloat16
    want = np.asarray(params["wq"][1]).astype(np.float16).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(loaded["wq"][1]), want)


def test_tied_checkpoint_accepts_lm_head_equal_to_embed(tmp_path):
    params = init_params(TINY_TIED, seed=4)
    tensors = hf_tensors(TINY_TIED, params)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    write_hf_folder(hf_config_dict(TINY_TIED), tensors, tmp_path)
    _, loaded = load_checkpoint(tmp_path)
    assert_same_params(loaded, params)


def test_tied_checkpoint_rejects_lm_head_differing_from_embed(tmp_path):
    tensors = hf_tensors(TINY_TIED, init_params(TINY_TIED, seed=4))
    tensors["lm_head.weight"] = -tensors["model.embed_tokens.weight"]
    write_hf_folder(hf_config_dict(TINY_TIED), tensors, tmp_path)
    message = load_error(tmp_path)
    assert "lm_head.weight differs from model.embed_tokens.weight" in message


def test_missing_tensor_is_named(tmp_path):
    tensors = hf_tensors(TINY_MOE, init_params(TINY_MOE))
    del tensors["model.layers.2.mlp.experts.3.down_proj.weight"]
    write_hf_folder(hf_config_dict(TINY_MOE), tensors, tmp_path)
    message = load_error(tmp_path)
    assert "missing tensor model.layers.2.mlp.experts.3.down_proj.weight" in message
    assert "we_down[1, 3]" in message


def test_untied_checkpoint_without_lm_head_is_missing_it(tmp_path):
    tensors = hf_tensors(TINY, init_params(TINY))
    del tensors["lm_head.weight"]
    write_hf_folder(hf_config_dict(TINY), tensors, tmp_path)
    assert "missing tensor lm_head.weight" in load_error(tmp_path)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.bias",
                                  "model.layers.0.self_attn.rotary_emb.inv_freq",
                                  "model.layers.2.mlp.experts.4.up_proj.weight"])
def test_unexpected_tensor_is_named(tmp_path, name):
    tensors = hf_tensors(TINY_MOE, init_params(TINY_MOE))
    tensors[name] = np.zeros((8,), np.float32)
    write_hf_folder(hf_config_dict(TINY_MOE), tensors, tmp_path)
    assert f"model.safetensors: unexpected tensor {name}" in load_error(tmp_path)


def test_wrong_shape_names_tensor_expected_and_got(tmp_path):
    tensors = hf_tensors(TINY, init_params(TINY))
    tensors[Q_PROJ] = tensors[Q_PROJ].T  # mk's [in, out] order instead of HF's [out, in]
    write_hf_folder(hf_config_dict(TINY), tensors, tmp_path)
    message = load_error(tmp_path)
    want, got = (TINY.q_width, TINY.hidden), (TINY.hidden, TINY.q_width)
    assert f"{Q_PROJ} has shape {got}, expected {want}" in message


def test_unsupported_dtype_is_named(tmp_path):
    tensors = hf_tensors(TINY, init_params(TINY))
    tensors[Q_PROJ] = np.zeros(tensors[Q_PROJ].shape, np.int8)
    write_hf_folder(hf_config_dict(TINY), tensors, tmp_path)
    assert f"{Q_PROJ} has dtype I8" in load_error(tmp_path)


def test_every_problem_is_reported_in_one_error(tmp_path):
    tensors = hf_tensors(TINY, init_params(TINY))
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    tensors["model.layers.1.mlp.down_proj.bias"] = np.zeros((3,), np.float32)
    write_hf_folder(hf_config_dict(TINY), tensors, tmp_path)
    message = load_error(tmp_path)
    assert "(3 problems)" in message
    for name in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.1.mlp.down_proj.bias"):
        assert name in message


def test_truncated_file_names_file_and_cut_off_tensors(tmp_path):
    tensors = hf_tensors(TINY, init_params(TINY))
    write_hf_folder(hf_config_dict(TINY), tensors, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    message = load_error(tmp_path)
    # save_file lays tensors out in sorted-name order, so the last one is cut.
    assert "model.safetensors: not a readable safetensors file" in message
    assert f"data ends before tensors {max(tensors)}" in message
    assert "missing tensor" not in message  # the file is the problem, not every tensor


def test_a_header_over_safetensors_limit_is_not_read_to_name_cut_tensors(tmp_path,
                                                                        monkeypatch):
    """The cut tensors are named from the header; one claiming more than safetensors'
    100 MB limit is not read (a corrupt length could ask for the whole shard)."""
    write_hf_folder(hf_config_dict(TINY), hf_tensors(TINY, init_params(TINY)), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    monkeypatch.setattr(mk.model.checkpoint, "HEADER_MAX_BYTES", 16)
    message = load_error(tmp_path)
    assert "model.safetensors: not a readable safetensors file" in message
    assert "data ends before tensors" not in message


def test_unreadable_header_names_the_file(tmp_path):
    save_hf_checkpoint(TINY, init_params(TINY), tmp_path, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = "model-00002-of-00002.safetensors"
    (tmp_path / shard).write_bytes(b"\xff" * 64)
    message = load_error(tmp_path)
    assert f"{shard}: not a readable safetensors file" in message
    held = sorted(name for name, file in index["weight_map"].items() if file == shard)
    assert f"expects it to hold {', '.join(held)}" in message
    assert "missing tensor" not in message


def test_index_pointing_at_missing_shard_names_file_and_tensors(tmp_path):
    save_hf_checkpoint(TINY, init_params(TINY), tmp_path, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    message = load_error(tmp_path)
    lost = sorted(name for name, file in index["weight_map"].items()
                  if file == "model-00001-of-00002.safetensors")
    assert f"to model-00001-of-00002.safetensors, which does not exist: {', '.join(lost)}" \
        in message


def test_index_and_shard_disagreeing_names_the_tensor(tmp_path):
    save_hf_checkpoint(TINY, init_params(TINY), tmp_path, shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = max(index["weight_map"], key=index["weight_map"].get)  # one in the second shard
    index["weight_map"][name] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    message = load_error(tmp_path)
    assert (f"model-00001-of-00002.safetensors: holds no {name}, which "
            "model.safetensors.index.json maps to it") in message
    assert (f"model-00002-of-00002.safetensors: holds {name}, which "
            "model.safetensors.index.json does not map to it") in message
    assert "missing tensor" not in message


def test_single_file_next_to_an_index_is_ambiguous(tmp_path):
    save_hf_checkpoint(TINY, init_params(TINY), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match="both model.safetensors and"):
        load_checkpoint(tmp_path)


def test_index_without_weight_map_is_rejected(tmp_path):
    save_hf_checkpoint(TINY, init_params(TINY), tmp_path, shards=2)
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="not a safetensors index with a weight_map"):
        load_checkpoint(tmp_path)


def test_folder_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(TINY)))
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        load_checkpoint(tmp_path)
