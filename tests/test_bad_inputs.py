"""Bad inputs and faults (issues 15 and 39): each case is a clear error naming the field,
the value and the limit, or a correct result; none crashes deep in JAX, none hangs, none
is silently wrong.

Cheap by construction: every check runs before anything is traced, so most cases never
compile; the few that run a kernel use the single-device argmax kernel, one XLA decode,
or (an all-linear hybrid, which the megakernel runs) three interpret-mode megakernel
steps. The multi-device NaN argmax is in tests/test_collectives.py (its subprocess runs
anyway). Each subprocess case has a timeout, so a hang is a failure, not a stuck run.
Untrusted checkpoints and quantised weights: tests/test_bad_checkpoints.py.
"""

import dataclasses
import html
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from builders import hf_config_dict, save_hf_checkpoint, write_hf_folder

import mk  # noqa: F401  (sets the CPU platform before jax initialises)
from mk.kernels import backend
from mk.step import megakernel
from mk.model import reference
from mk.speculative import spec
from mk.measure import tpu
from mk.step import tensor_parallel as tpar
from mk.model.checkpoint import init_params, load_checkpoint
from mk.model.config import ModelConfig
from mk.model.presets import preset
from mk.kernels import collectives
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan
from mk.step.shards import check_tp

ROOT = Path(__file__).resolve().parent.parent
TINY = preset("tiny")


@pytest.fixture(scope="module")
def params():
    return init_params(TINY)


def _subprocess_env(devices: int = 1) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
                PYTHONPATH=str(ROOT),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


# -- Silently wrong ---------------------------------------------------------------------------
def test_nan_logits_give_the_first_nan_id_in_the_reference_and_the_kernel_argmax():
    logits = np.arange(2 * 256, dtype=np.float32).reshape(1, 2, 256) % 7
    logits[0, 0, [5, 9]] = np.nan  # NaN beats every number: the first NaN, 5
    logits[0, 1, :] = np.nan  # all NaN: id 0, never vocab (one past the last id)
    want = np.argmax(logits[0], axis=-1)
    assert list(want) == [5, 0]
    np.testing.assert_array_equal(reference.greedy(jnp.asarray(logits[0])), want)
    with backend.use("interpret"):
        got = collectives.greedy_argmax(jnp.asarray(logits), collectives.tp_mesh(1))
    np.testing.assert_array_equal(np.asarray(got)[0, :, 0], want)


BAD_IDS = {
    "int64 2**32 + 2": (np.array([[1, 2**32 + 2]], np.int64), r"tokens\[0, 1\]=4294967298 "
                        r"must be in \[0, vocab=512\)"),
    "float": (np.array([[1.0, 2.0]]), "dtype float64; it must be an integer type"),
    "bool": (np.array([[True, False]]), "dtype bool; it must be an integer type"),
}


def _plan16(rows: int = 1) -> DecodePlan:
    """A plan of TINY's step over a cache of 16 positions (KV tiles of 16)."""
    return DecodePlan.make(TINY, rows=rows, context=16, block=BlockSizes(kv_tile=16))


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_token_ids_are_checked_before_any_cast(params, case):
    tokens, message = BAD_IDS[case]
    cache = reference.init_cache(TINY, 1, 16)
    with pytest.raises(ValueError, match=message):
        reference.decode_step(TINY, params, cache, tokens, np.array([0]))
    with pytest.raises(ValueError, match=message):
        megakernel.decode_step(_plan16(rows=2), {}, cache, tokens, np.array([0]))
    prompt_message = message.replace("tokens", "prompt")
    for generate in (reference.generate, megakernel.generate):
        with pytest.raises(ValueError, match=prompt_message):
            generate(TINY, params, tokens, 2)
    with pytest.raises(ValueError, match=prompt_message):
        tpar.generate(TINY, params, tokens, 2, tp=1)
    with pytest.raises(ValueError, match=prompt_message):
        spec.generate(TINY, params, tokens, 2, drafter="ngram", gamma=2)


@pytest.mark.parametrize("positions, message", [
    (np.array([3.9]), "positions has dtype float64"),
    (np.array([2**32 + 2], np.int64), r"positions\[0\]=4294967298 must be in \[0, "
     r"max_context=16\)"),
    (np.array([-1]), r"positions\[0\]=-1 must be in \[0, max_context=16\)")])
def test_positions_are_checked_before_any_cast(params, positions, message):
    cache = reference.init_cache(TINY, 1, 16)
    for step in (lambda: reference.decode_step(TINY, params, cache, [[1]], positions),
                 lambda: megakernel.decode_step(_plan16(), {}, cache, [[1]], positions)):
        with pytest.raises(ValueError, match=message):
            step()


def test_another_models_params_are_refused_naming_the_first_mismatch(params):
    moe = init_params(preset("tiny-moe"))
    cache = reference.init_cache(TINY, 1, 16)
    with pytest.raises(ValueError, match=r"params\['attn_norm'\] is bfloat16\[3, 256\]; "
                                         r"tiny needs bfloat16\[2, 256\]"):
        reference.decode_step(TINY, moe, cache, [[1]], [0])
    f32 = {k: v.astype(jnp.float32) for k, v in params.items()}
    missing = {k: v for k, v in params.items() if k != "wq"}
    for bad, message in ((f32, r"params\['embed'\] is float32\[512, 256\]; tiny needs "
                                r"bfloat16"), (missing, "params has no 'wq'")):
        for generate in (megakernel.generate, reference.generate):
            with pytest.raises(ValueError, match=message):
                generate(TINY, bad, [[1, 2]], 2)
        with pytest.raises(ValueError, match=message):
            spec.generate(TINY, bad, [[1, 2]], 2, drafter="ngram", gamma=2)
        with pytest.raises(ValueError, match=message):
            tpar.generate(TINY, bad, [[1, 2]], 2, tp=1)


def test_a_cache_of_another_dtype_or_model_is_refused(params):
    cache = reference.init_cache(TINY, 1, 16)
    f32 = reference.KVCache(cache.k.astype(jnp.float32), cache.v.astype(jnp.float32))
    with pytest.raises(ValueError, match="cache dtype k=float32.*dtype=bfloat16"):
        reference.decode_step(TINY, params, f32, [[1]], [0])
    other = reference.init_cache(preset("tiny-moe"), 1, 16)
    with pytest.raises(ValueError, match=r"does not fit tiny \(L=2"):
        megakernel.decode_step(_plan16(), {}, other, [[1]], [0])


def _checkpoint(tmp_path, config, edit=None, **hf_changes):
    weights = init_params(config)
    if edit:
        weights = edit(dict(weights))
    folder = save_hf_checkpoint(config, weights, tmp_path / "ckpt")
    if hf_changes:
        hf = json.loads((folder / "config.json").read_text()) | hf_changes
        (folder / "config.json").write_text(json.dumps(hf))
    return folder


@pytest.mark.parametrize("value, what", [(np.nan, "NaN"), (np.inf, "inf"),
                                         (3.4e38, "past bf16's range")])
def test_non_finite_weights_are_refused_by_the_loader(tmp_path, value, what):
    config = ModelConfig(**{**TINY.__dict__, "dtype": "float32"})

    def plant(weights):
        wq = np.asarray(weights["wq"]).copy()
        wq[1, 3, 5] = value
        return weights | {"wq": wq}

    folder = _checkpoint(tmp_path, config, plant)
    with pytest.raises(ValueError, match=r"mk wq: 1 values are NaN or inf in "
                                         r"(float32|bfloat16)"):
        load_checkpoint(folder, dtype="bfloat16")


@pytest.mark.parametrize("field, value", [("rms_norm_eps", math.nan),
                                          ("rope_theta", math.inf)])
def test_non_finite_config_json_numbers_are_refused(field, value):
    hf = hf_config_dict(TINY)
    hf.pop("rope_parameters", None)
    hf |= {"rope_theta": TINY.rope_theta, field: value}
    name = {"rms_norm_eps": "rms_eps"}.get(field, field)
    with pytest.raises(ValueError, match=f"{name}=(nan|inf) must be a finite number > 0"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("kwargs, message", [
    (dict(context=300), "context=300 must be a multiple of 16 for the megakernel"),
    (dict(block=BlockSizes(slots=1)), "slots=1"),
    (dict(batch=65), "batch=65 x rows=1 = 65 activation rows exceed MAX_ROWS=64"),
    (dict(batch=0), "batch=0 must be a positive integer"),
    (dict(rows=0), "rows=0 must be a positive integer")])
def test_compile_megakernel_refuses_what_the_runtime_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tpu.compile_megakernel(DecodePlan.make(TINY, chip="v5e",
                                               **dict(batch=8, context=4096) | kwargs))


# -- tools/run_notebooks.py -------------------------------------------------------------------
def _run_notebooks(*args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "run_notebooks.py"), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=_subprocess_env())


@pytest.mark.parametrize("text, message", [
    (None, "does not exist"),
    ("00_decode_is_memory_bound:\n  - {}\n00_decode_is_memory_bound:\n  - {}\n",
     "key '00_decode_is_memory_bound' is repeated (line 3)"),
    ("00_decode_is_memory_bound: [\n", "not valid YAML")])
def test_runs_file_mistakes_exit_2_before_anything_runs(tmp_path, text, message):
    runs = tmp_path / "runs.yaml"
    if text is not None:
        runs.write_text(text)
    done = _run_notebooks("--runs", str(runs), "--out", str(tmp_path / "build"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr
    assert not (tmp_path / "build").exists()


def _sleeping_notebook(path: Path, seconds: float) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(f"import time\ntime.sleep({seconds})")]
    nbformat.write(nb, path)
    return path


def test_sigterm_marks_the_interrupted_run_newest_in_the_index(tmp_path):
    out = tmp_path / "build"
    old = out / "runs" / "20000101-000000"
    old.mkdir(parents=True)
    (old / "runs.json").write_text('{"rows": [')  # a truncated record of an old run
    notebook = _sleeping_notebook(tmp_path / "98_sleeps.ipynb", 60)
    (tmp_path / "runs.yaml").write_text("")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "run_notebooks.py"), str(notebook), "--out",
         str(out), "--runs", str(tmp_path / "runs.yaml")], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=_subprocess_env())
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("runs/2*-*/")) or len(list(out.glob("runs/*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        time.sleep(8)  # the kernel starts the sleeping cell
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    index = html.unescape((out / "index.html").read_text())  # run values are escaped
    newest = index.split("<h2>All runs</h2>")[0]
    assert "interrupted" in newest and "98_sleeps" in newest
    assert "20000101-000000: runs.json unreadable" in index


# -- Speculative decoding on a loaded checkpoint ------------------------------------------------
def test_speculation_on_a_loaded_checkpoint_with_the_default_context(tmp_path, params):
    config = ModelConfig(**{**TINY.__dict__, "max_position": 64, "max_context": 64})
    folder = save_hf_checkpoint(config, params, tmp_path / "ckpt")
    loaded, weights = load_checkpoint(folder)
    assert loaded.max_context == loaded.max_position == 64
    prompt = np.array([[2, 5, 7]])
    got, _ = spec.generate(loaded, weights, prompt, 4, drafter="self", gamma=2,
                           verifier="reference")
    np.testing.assert_array_equal(got, reference.generate(loaded, weights, prompt, 4))


# -- Hangs ------------------------------------------------------------------------------------
def test_tp2_on_exactly_two_cpu_devices_is_refused_not_a_hang():
    code = ("import jax.numpy as jnp, mk\nfrom mk.step import tensor_parallel as t\n"
            "c = mk.preset('tiny')\n"
            "t.generate(c, mk.init_params(c), jnp.array([[1, 2]]), 2, tp=2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=_subprocess_env(devices=2))
    assert done.returncode == 1
    assert "ValueError: tp=2 on CPU (TPU interpret mode) needs >= 4 CPU devices" in \
        done.stderr and "device_count=4" in done.stderr


def test_the_mesh_error_recommends_a_device_count_that_works():
    with pytest.raises(ValueError, match="device_count=16 before importing jax"):
        collectives.tp_mesh(8)


def test_thousands_of_layers_validate_in_linear_time_with_a_short_error(tmp_path):
    hf = hf_config_dict(TINY) | {"num_hidden_layers": 20_000}
    start = time.perf_counter()
    config = ModelConfig.from_hf(hf)
    assert config.mlp_index(19_999) == ("dense", 19_999)
    folder = write_hf_folder(hf, {}, tmp_path / "deep")
    with pytest.raises(ValueError) as err:
        load_checkpoint(folder)
    assert time.perf_counter() - start < 20
    message = str(err.value)
    assert "(220003 problems)" in message and "... and 219983 more" in message
    assert len(message.splitlines()) < 25
    moe = dict(name="m", vocab=8, hidden=8, layers=4, heads=1, kv_heads=1, head_dim=8, ffn=8,
               experts=2, experts_per_token=1, expert_ffn=8)
    with pytest.raises(ValueError, match=r"moe_layers=\(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, \.\.\. "
                                         r"99990 more, 100000 in all\)") as err:
        ModelConfig(**moe, moe_layers=tuple(range(100_000)))
    assert len(str(err.value)) < 300


# -- Crashes deep in JAX / unclear errors -------------------------------------------------------
def test_batch_or_rows_zero_is_a_value_error_not_a_zero_division(params):
    empty = np.zeros((0, 3), np.int32)
    for call in (lambda: reference.generate(TINY, params, empty, 2),
                 lambda: megakernel.generate(TINY, params, empty, 2),
                 lambda: spec.generate(TINY, params, empty, 2, drafter="ngram", gamma=2),
                 lambda: reference.init_cache(TINY, 0, 16)):
        with pytest.raises(ValueError, match=r"prompt shape \(0, 3\) must be \[B, P\] with "
                                             r"B >= 1|batch=0 must be a positive integer"):
            call()
    cache = reference.init_cache(TINY, 1, 16)
    with pytest.raises(ValueError, match=r"tokens shape \(1, 0\) must be \[B=1, T >= 1\]"):
        megakernel.decode_step(_plan16(), {}, cache, np.zeros((1, 0), np.int32), [0])


@pytest.mark.parametrize("max_context", ["256", 256.0, 0, True])
def test_a_max_context_that_is_no_positive_integer_is_named(params, max_context):
    """Issue 65: the string "256" ended in a TypeError comparing an int with a str."""
    for call in (lambda: megakernel.generate(TINY, params, [[1, 2]], 2, max_context=max_context),
                 lambda: spec.generate(TINY, params, [[1, 2]], 2, drafter="ngram", gamma=2,
                                       max_context=max_context)):
        with pytest.raises(ValueError, match=f"max_context={max_context!r} must be a positive"):
            call()
    assert megakernel.check_generate(TINY, [[1, 2]], 2, 1, np.int64(64))[1] == 64


def test_numpy_integer_steps_and_tp_are_accepted(params):
    got = reference.generate(TINY, params, [[1, 2]], np.int64(3))
    assert got.shape == (1, 3)
    _, _, steps, per_call = megakernel.check_generate(TINY, [[1, 2]], np.int64(3),
                                                      np.int32(2), None)
    assert (steps, per_call) == (3, 2) and type(steps) is int
    assert check_tp(TINY, np.int64(2)) == 2
    assert collectives.tp_mesh(np.int64(1)).shape["tp"] == 1


@pytest.mark.parametrize("call, message", [
    (lambda: preset(["tiny"]), r"preset=\['tiny'\] does not exist; choose one of"),
    (lambda: mk.chip(["v6e"]), r"chip=\['v6e'\] is not known; choose one of"),
    (lambda: load_checkpoint(None), "path=None must be a checkpoint folder's path"),
    (lambda: mk.step.shards.shard_params(TINY, None, 2),
     "params is a NoneType; expected a dict of weights")])
def test_a_top_level_argument_of_the_wrong_type_is_named_not_a_type_error(call, message):
    """Issue 65 re-check: each raised TypeError (unhashable type: 'list'; expected str,
    bytes or os.PathLike) or AttributeError ('NoneType' object has no attribute 'items')
    from inside mk."""
    with pytest.raises(ValueError, match=message):
        call()


def test_a_file_or_a_list_is_not_a_checkpoint(tmp_path):
    folder = _checkpoint(tmp_path, TINY)
    with pytest.raises(ValueError, match="model.safetensors'? is not a folder"):
        load_checkpoint(folder / "model.safetensors")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json holds a list; expected a JSON object"):
        load_checkpoint(folder)
    (folder / "config.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="config.json' is not UTF-8 text: byte offset 0"):
        load_checkpoint(folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json' is not JSON"):
        load_checkpoint(folder)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # would block a plain open() for ever
    with pytest.raises(ValueError, match="config.json' is a named pipe"):
        load_checkpoint(folder)


def test_a_topology_name_without_its_shape_is_refused():
    with pytest.raises(ValueError, match="topology='v5e' must be a libtpu name with its "
                                         "shape"):
        tpu.compile_megakernel(DecodePlan.make(TINY, chip="v5e", tp=2, batch=8,
                                               context=4096), topology="v5e")


def test_an_unsharded_cache_to_the_tp_step_says_to_shard_it():
    cache = reference.init_cache(TINY, 1, 16)
    with pytest.raises(ValueError, match=r"must each be \[tp=1, \.\.\.\] \(k: \[tp, L, B, "
                                         r"K_local, S, H\]\); shard .*mk.step.shards.shard_cache"):
        tpar.decode_step(_plan16(), {}, cache, [[1]], [0], mesh=collectives.tp_mesh(1))


# -- Data -------------------------------------------------------------------------------------
def test_compile_time_json_refuses_an_existing_file(tmp_path):
    existing = tmp_path / "recording.json"
    existing.write_text('{"records": []}')
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_time.py"),
                           "--json", str(existing)], capture_output=True, text=True,
                          timeout=120, env=_subprocess_env())
    assert done.returncode == 2 and "exists" in done.stderr
    assert existing.read_text() == '{"records": []}'


def test_make_clean_keeps_the_runs_and_clean_runs_removes_them(tmp_path):
    for target, kept in (("clean", True), ("clean-runs", False)):
        run = tmp_path / "build" / "runs" / "20000101-000000"
        run.mkdir(parents=True, exist_ok=True)
        (tmp_path / "build" / "index.html").write_text("site")
        subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path),
                        target], check=True, capture_output=True, timeout=60)
        assert run.exists() is kept and not (tmp_path / "build" / "index.html").exists()


def test_a_kernel_called_on_cpu_outside_backend_use_says_what_to_do(params):
    cache = reference.init_cache(TINY, 1, 16)
    block = BlockSizes(kv_tile=16)
    with pytest.raises(ValueError, match=r"inside `with mk.kernels.backend.use\('interpret'\):`"):
        plan = DecodePlan.make(TINY, batch=1, context=16, block=block)
        megakernel.decode_step(plan, megakernel.prepare(plan, params), cache, [[1]], [0])


# -- Entry points and valid configs (issue 39): refused by name before tracing, or run ---------
def test_entry_points_without_quantised_weights_say_so_by_name(params):
    q = mk.quantize(TINY, params, dense="int8")
    message = (r"params\['wq'\] is quantised \(int8\); {} takes plain bfloat16 weights: pass "
               r"mk.model.quant.dequantize\(params\), or decode with mk.step.megakernel.generate")
    for entry, call in (
            ("mk.model.reference", lambda: reference.generate(TINY, q, [[1, 2]], 2)),
            ("mk.speculative.spec.generate", lambda: spec.generate(TINY, q, [[1, 2]], 2,
                                                                   drafter="ngram",
                                                       gamma=2))):
        with pytest.raises(ValueError, match=message.format(entry)):
            call()
    # mk.step.tensor_parallel.generate and mk.step.shards.shard_params take them (issue 34:
    # tests/test_quant_shards.py)


def _all_linear(family: str) -> ModelConfig:
    if family == "kimi":
        return dataclasses.replace(preset("tiny-kimi"), layer_types=("linear",) * 4)
    hf = dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=256, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, head_dim=128,
              intermediate_size=512, rms_norm_eps=1e-6, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4},
              linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)
    return ModelConfig.from_hf(hf, name="all-linear")  # transformers' default interval 4


@pytest.mark.parametrize("family", ["qwen3.5", pytest.param("kimi", marks=pytest.mark.slow)])
def test_an_all_linear_hybrid_runs_in_the_megakernel(family):
    config = _all_linear(family)
    assert set(config.layer_types) == {"linear"} and not config.full_layers
    weights = init_params(config)
    want = reference.generate(config, weights, [[3, 1, 4]], 3, max_context=16)
    got = megakernel.generate(config, weights, [[3, 1, 4]], 3, max_context=16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_an_all_linear_hybrid_runs_tensor_parallel():
    code = ("import dataclasses, numpy as np, mk\nfrom mk.kernels import backend\n"
            "from mk.model import reference\n"
            "from mk.step import tensor_parallel as t\n"
            "c = dataclasses.replace(mk.preset('tiny-hybrid'), layers=3, linear_key_heads=2,"
            " layer_types=('linear',) * 3)\np = mk.init_params(c)\n"
            "want = reference.generate(c, p, [[1, 2, 3]], 3, max_context=16)\n"
            "with backend.use('interpret'):\n"
            "    got = t.generate(c, p, [[1, 2, 3]], 3, tp=2, max_context=16)\n"
            "assert (np.asarray(got) == np.asarray(want)).all(), (got, want)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=_subprocess_env(devices=4))
    assert done.returncode == 0, done.stderr[-3000:]


def test_conv_kernel_1_is_refused_by_name_before_tracing():
    config = dataclasses.replace(preset("tiny-hybrid"), conv_kernel=1)
    weights = init_params(config)
    assert reference.generate(config, weights, [[1, 2]], 2).shape == (1, 2)
    message = r"conv_kernel=1: the linear-attention kernels .* need conv_kernel >= 2"
    for call in (lambda: megakernel.generate(config, weights, [[1, 2]], 2),
                 lambda: tpar.generate(config, weights, [[1, 2]], 2, tp=1)):
        with pytest.raises(NotImplementedError, match=message):
            call()


def test_a_shard_no_tile_cuts_names_the_weight_the_fields_and_the_tp():
    assert check_tp(preset("tiny-kimi"), 2) == 2  # every width divides; one does not tile
    with pytest.raises(ValueError, match=r"tiny-kimi at tp=2 \(per device: heads=1 of 2, .*\):"
                                         r" no tile .* cuts every weight: wq \[256, 192\] \(a "
                                         "side not a multiple of 128\\)"):
        DecodePlan.make(preset("tiny-kimi"), tp=2, batch=1, context=256)


def test_a_max_context_no_kv_tile_divides_names_max_context(params):
    assert reference.generate(TINY, params, [[1, 2]], 2, max_context=200).shape == (1, 2)
    for call in (lambda: megakernel.generate(TINY, params, [[1, 2]], 2, max_context=200),
                 lambda: tpar.generate(TINY, params, [[1, 2]], 2, tp=1, max_context=200),
                 lambda: spec.generate(TINY, params, [[1, 2]], 2, drafter="ngram", gamma=2,
                                       max_context=200)):
        with pytest.raises(ValueError, match="max_context=200 must be a multiple of 16 for the "
                                             "megakernel.*: use 208"):
            call()
    plan = DecodePlan.make(TINY, batch=1, context=272)  # 17 x 16: the tile that divides
    assert plan.block.kv_tile == 16


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_a_seed_that_is_not_a_non_negative_integer_is_refused(params, seed):
    for call in (lambda: init_params(TINY, seed),
                 lambda: spec.generate(TINY, params, [[1, 2]], 2, drafter="ngram", gamma=2,
                                       seed=seed, verifier="reference")):
        with pytest.raises(ValueError, match=f"seed={seed!r} must be a non-negative integer"):
            call()


def test_tp_generate_outside_backend_use_says_what_to_do(params):
    with pytest.raises(ValueError, match=r"inside `with mk.kernels.backend.use\('interpret'\):`"):
        tpar.generate(TINY, params, [[1, 2]], 2, tp=1)
