"""Many hosts (`mk.step.distributed`): each process prepares only its own devices' shards.

In one process: `load_shards` of any set of devices equals `mk.step.shards.shard_params` of the
whole checkpoint (`mk.load_checkpoint`) for those devices, bit for bit, on a Qwen3-MoE
checkpoint written without torch and on transformers-written Qwen3.5, Kimi Linear and
gpt-oss ones (widths that are not whole 128-lane tiles, so lane padding and split-width
padding; q|gate per head, conv weights, q/k/v parts, interleaved gate|up); the same
comparison catches a planted off-by-one device; bad device indices and quantised
checkpoints are refused.

Across processes: two Python processes on this machine run `jax.distributed` on the CPU
(2 devices each, gloo collectives), each loading its devices of a TP4 checkpoint with
`load_process_shards` (this file run as a script is one process). The parent compares
each process's own shards, and the global arrays gathered across both processes
(`process_allgather`, a cross-process collective), with the single-process shards, and
checks by counting safetensors' reads that each process read every whole tensor once and
half of every split one, the two halves together each split tensor exactly once.
`make test-slow` also compiles the TP step ahead of time over the 2-process mesh (TPU
interpret mode): it compiles; running it across the processes hangs, as interpret mode
keeps every device's simulated memory and semaphores in one process (`mk.step.distributed`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mk
from builders import (build_hf_model, hf_config_dict, hf_tensors, save_hf_checkpoint,
                      write_hf_folder)
from mk.model import quant
from mk.step.distributed import check_device_indices, load_process_shards, load_shards
from mk.model.hf_layout import hf_layout
from mk.step.shards import shard_params, split_of
from mk.model.weights import weight

TESTS = Path(__file__).resolve().parent
PROCESSES, LOCAL_DEVICES, TP = 2, 2, 4
TIMEOUT_S = 120  # both processes, start to finish (measured ~10 s)
# Tiny transformers models of each family (widths 64 and 96: lane-padded to 128).
HF_FIELDS = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_hidden_layers=3,
                 rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None)
LIN, FULL = "linear_attention", "full_attention"
FAMILIES = {
    "qwen3_5_text": dict(num_key_value_heads=2, head_dim=16, intermediate_size=96,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=8,
                         linear_conv_kernel_dim=4, layer_types=[LIN, FULL, LIN],
                         tie_word_embeddings=True),
    "kimi_linear": dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
                        kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8,
                        num_experts_per_tok=2, linear_head_dim=16, linear_num_heads=2,
                        linear_conv_kernel_dim=4, layer_types=[LIN, FULL, LIN],
                        mlp_layer_types=["dense", "sparse", "sparse"], n_group=2,
                        topk_group=1, n_shared_experts=1),
    "gpt_oss": dict(intermediate_size=32, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                    swiglu_limit=0.5),
}


def assert_shards_equal(got: dict, want: dict, devices) -> None:
    """Every weight of `got` ({name: [len(devices), ...]}) is bit for bit `want`'s
    ({name: [tp, ...]}) devices `devices`: same names, shapes, dtypes and bytes."""
    assert sorted(got) == sorted(want)
    for name in want:
        expected = np.asarray(want[name])[list(devices)]
        actual = np.asarray(got[name])
        assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype), name
        # a bool, not the bytes: pytest would diff megabytes of bytes when it fails (under
        # CI=true it does so untruncated, for a quarter of an hour)
        same = actual.tobytes() == expected.tobytes()
        assert same, f"{name}: devices {list(devices)}"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A tiny-moe checkpoint in two files -> (folder, every device's shards at TP)."""
    config = mk.preset("tiny-moe")
    folder = save_hf_checkpoint(config, mk.init_params(config, seed=1),
                                tmp_path_factory.mktemp("moe"), shards=2)
    _, params = mk.load_checkpoint(folder)
    return folder, shard_params(config, params, TP)


@pytest.mark.parametrize("devices", [(0,), (1, 2), (3, 0), (0, 1, 2, 3)])
def test_loaded_shards_of_any_devices_are_shard_params_bit_for_bit(moe_checkpoint, devices):
    folder, want = moe_checkpoint
    assert_shards_equal(load_shards(folder, TP, devices)[1], want, devices)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_shards_of_every_family_are_shard_params_bit_for_bit(family, tmp_path):
    build_hf_model(family, {**HF_FIELDS, **FAMILIES[family]}).save_pretrained(tmp_path)
    config, params = mk.load_checkpoint(tmp_path)
    assert config.padding, "the case should exercise lane padding"
    want = shard_params(config, params, 2)
    for devices in ((0,), (1,)):
        assert_shards_equal(load_shards(tmp_path, 2, devices)[1], want, devices)


def test_a_planted_off_by_one_device_is_caught(moe_checkpoint):
    folder, want = moe_checkpoint
    _, got = load_shards(folder, TP, (2,))
    with pytest.raises(AssertionError, match="devices \\[1\\]"):
        assert_shards_equal(got, want, (1,))


@pytest.mark.parametrize("devices, message", [
    ((), "at least one device"), ((4,), "device 4 is outside \\[0, tp=4\\)"),
    ((-1,), "device -1 is outside"), ((1, 1), "devices \\[1\\] are listed twice"),
    ((True,), "True is not an integer"), ((1.0,), "1.0 is not an integer"),
    (1, "devices=1 must be a sequence of device indices in \\[0, tp=4\\)"),
    ("01", "devices='01' must be a sequence")])
def test_bad_device_indices_are_refused_by_value(devices, message):
    with pytest.raises(ValueError, match=message):
        check_device_indices(devices, TP)


def test_load_shards_checks_the_devices_and_refuses_quantised_checkpoints(moe_checkpoint,
                                                                          tmp_path):
    folder, _ = moe_checkpoint
    with pytest.raises(ValueError, match="device 4 is outside"):
        load_shards(folder, TP, (0, 4))
    config = mk.preset("tiny")
    tensors = hf_tensors(config, mk.init_params(config))
    for layer in range(config.layers):  # wq in fine-grained fp8, unit scales
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        out, into = tensors[name].shape
        tensors[name] = np.asarray(tensors[name], np.float32).astype(jnp.float8_e4m3fn)
        tensors[name + "_scale_inv"] = np.ones((-(-out // 128), -(-into // 128)), np.float32)
    hf = hf_config_dict(config) | {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    write_hf_folder(hf, tensors, tmp_path)
    assert isinstance(mk.load_checkpoint(tmp_path)[1]["wq"], quant.QuantWeight)
    with pytest.raises(NotImplementedError, match=r"\['wq'\] are stored quantised"):
        load_shards(tmp_path, 2, (0,))


# -- Two processes -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(folder: Path, out: Path, *, compile_step: bool = False,
                  timeout: float = TIMEOUT_S) -> list[dict[str, np.ndarray]]:
    """This file as a script in PROCESSES processes of one `jax.distributed` program ->
    each one's arrays. A process that fails (or the timeout) kills the others and fails
    the test with every process's output."""
    port, logs, procs, failure = _free_port(), [], [], "failed"
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", XLA_FLAGS=flags)
    try:
        for i in range(PROCESSES):
            logs.append(open(out / f"process{i}.log", "w"))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, str(i), str(port), str(folder),
                 str(out / f"process{i}.npz"), "compile" if compile_step else "load"],
                cwd=TESTS, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout} s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    if any(p.returncode for p in procs):  # a process killed at the deadline too
        output = "\n".join(f"-- process {i} (exit {p.returncode}):\n"
                           f"{(out / f'process{i}.log').read_text()[-4000:]}"
                           for i, p in enumerate(procs))
        pytest.fail(f"the {PROCESSES} processes {failure}:\n{output}")
    results = []
    for i in range(PROCESSES):
        with np.load(out / f"process{i}.npz") as data:
            results.append(dict(data))
    return results


def _as_bits(a: np.ndarray) -> np.ndarray:
    """An array's bytes as unsigned ints of its width (npz has no bfloat16)."""
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def test_two_processes_each_load_only_their_devices_shards(moe_checkpoint, tmp_path):
    folder, want = moe_checkpoint
    results = run_processes(folder, tmp_path)
    config = mk.preset("tiny-moe")
    for process, arrays in enumerate(results):
        mine = range(process * LOCAL_DEVICES, (process + 1) * LOCAL_DEVICES)
        for name, shards in want.items():
            for device in mine:
                np.testing.assert_array_equal(arrays[f"local/{name}/{device}"],
                                              _as_bits(np.asarray(shards[device])),
                                              err_msg=f"process {process}: {name}[{device}]")
            np.testing.assert_array_equal(arrays[f"gathered/{name}"],
                                          _as_bits(np.asarray(shards)),
                                          err_msg=f"process {process}: {name} gathered")
    stored = _stored_bytes(folder)
    reads = [json.loads(str(arrays["bytes_read"])) for arrays in results]
    for tensor, (param, _, _) in hf_layout(config).items():
        got = [read.get(tensor, 0) for read in reads]
        if split_of(config, weight(config, param), TP) == "whole":
            assert got == [stored[tensor]] * PROCESSES, tensor
        else:  # each process its half; together the tensor once
            assert got == [stored[tensor] // PROCESSES] * PROCESSES, tensor


def _stored_bytes(folder: Path) -> dict[str, int]:
    """Tensor name -> its bytes in the checkpoint's files."""
    from safetensors import safe_open

    sizes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "numpy") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                itemsize = {"BF16": 2, "F16": 2, "F32": 4}[view.get_dtype()]
                sizes[name] = itemsize * int(np.prod(view.get_shape()))
    return sizes


@pytest.mark.slow
def test_two_processes_compile_the_tp_step_over_their_mesh(moe_checkpoint, tmp_path):
    """The TP4 megakernel step lowered and compiled ahead of time (interpret mode) over
    the mesh of both processes' devices, from the weights each loaded (~25 s)."""
    folder, _ = moe_checkpoint
    for arrays in run_processes(folder, tmp_path, compile_step=True, timeout=300):
        assert int(arrays["compiled"]) == 1


# -- One process of the program (this file run as a script) ------------------------------
class _CountedSlice:
    """A safetensors slice that adds the bytes each read returns to `counts`."""

    def __init__(self, view, name: str, counts: dict):
        self.view, self.name, self.counts = view, name, counts

    def __getattr__(self, attribute):
        return getattr(self.view, attribute)

    def __getitem__(self, index):
        values = self.view[index]
        self.counts[self.name] = self.counts.get(self.name, 0) + values.nbytes
        return values


class _CountedFile:
    """A safetensors file handle whose tensor reads are counted (`_CountedSlice`)."""

    def __init__(self, handle, counts: dict):
        self.handle, self.counts = handle, counts

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, attribute):
        return getattr(self.handle, attribute)

    def get_slice(self, name):
        return _CountedSlice(self.handle.get_slice(name), name, self.counts)

    def get_tensor(self, name):
        values = self.handle.get_tensor(name)
        self.counts[name] = self.counts.get(name, 0) + values.nbytes
        return values


def _process(process: int, port: int, folder: str, out: str, task: str) -> None:
    """One process: join the program, load this process's shards, write them (and what
    the whole program gathers, and the bytes read per tensor) to `out`."""
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=PROCESSES, process_id=process,
                               initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from mk.model import checkpoint
    from mk.step.distributed import load_process_shards
    from mk.kernels.collectives import AXIS

    counts: dict[str, int] = {}
    opener = checkpoint.safe_open
    checkpoint.safe_open = lambda *args, **kw: _CountedFile(opener(*args, **kw), counts)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    config, weights = load_process_shards(folder, mesh)
    arrays = {"bytes_read": np.array(json.dumps(counts))}
    for name, a in weights.items():
        for shard in a.addressable_shards:
            arrays[f"local/{name}/{shard.index[0].start}"] = _as_bits(np.asarray(shard.data)[0])
        arrays[f"gathered/{name}"] = _as_bits(multihost_utils.process_allgather(a, tiled=True))
    if task == "compile":
        arrays["compiled"] = np.array(_compile_step(config, mesh, weights))
    np.savez(out, **arrays)
    jax.distributed.shutdown()


def _compile_step(config, mesh, weights) -> int:
    """Lower and compile the TP step over `mesh` in interpret mode from `weights` (global
    arrays); 1 when it compiled."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mk.kernels import backend
    from mk.step import megakernel, tensor_parallel
    from mk.model import reference
    from mk.kernels.collectives import AXIS
    from mk.step.plan import DecodePlan
    from mk.step.shards import shard_cache

    tp, batch, context = mesh.shape[AXIS], 1, 64
    plan = DecodePlan.make(config, tp=tp, batch=batch, rows=1, context=context)
    cache = shard_cache(config, reference.init_cache(config, batch, context), tp)
    sharded, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    cache = jax.tree.map(lambda a: jax.make_array_from_callback(
        a.shape, sharded, lambda index: np.asarray(a)[index]), cache)
    tokens = jax.device_put(np.zeros((batch, 1), np.int32), replicated)
    positions = jax.device_put(np.zeros((batch,), np.int32), replicated)

    def step(w, c, t, p):
        return tensor_parallel.compile_target(plan, mesh, megakernel.prepare_shards(plan, w),
                                              c, t, p)

    with backend.use("interpret"):
        jax.jit(step).lower(weights, cache, tokens, positions).compile()
    return 1


if __name__ == "__main__":
    _process(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])


def test_a_mesh_listing_one_device_twice_is_refused_before_loading(tmp_path):
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device, device]), ("tp",))
    with pytest.raises(ValueError, match=rf"lists devices with ids \[{device.id}\] more than "
                                         r"once \(2 entries, 1 devices\)"):
        load_process_shards(tmp_path / "absent", mesh)
    with pytest.raises(ValueError, match="mesh is a list; it must be a jax.sharding.Mesh"):
        load_process_shards(tmp_path / "absent", [device])
