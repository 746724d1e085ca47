"""Many hosts: each process of a JAX multi-controller program (`jax.distributed`) prepares
only its own devices' shards from one checkpoint; no host reads the whole model.

Here: `load_shards(path, tp, devices)` (the shards of some of the tp devices, bit for bit
what `mk.step.shards.shard_params` gives them from the whole checkpoint: each weight cut by its
split rule, `mk.step.shards.split_index`, and read through its placements,
`mk.model.hf_layout.fill_slots`, only the ranges those devices hold; the checks are
`load_checkpoint`'s) and `load_process_shards(path, mesh)` (this process's devices of a
one-axis tp mesh, placed as its part of global arrays [tp, ...] sharded over the axis).

Not here: quantised checkpoints (`load_shards` refuses them), the megakernel's
per-device layout of the shards (`mk.step.megakernel.prepare_shards`), the cache
(`mk.step.shards.shard_cache`). What JAX allows across two CPU processes (and why the
tensor-parallel step in interpret mode does not run across them):
docs/design/mk.step.distributed.md.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mk.model.checkpoint import check_values, open_checkpoint
from mk.model.config import ModelConfig
from mk.model.hf_layout import every, fill_slots
from mk.kernels.collectives import AXIS
from mk.step.shards import check_tp, split_axis, split_index, split_of, tied_lm_head
from mk.model.weights import weights_of


def check_device_indices(devices, tp: int) -> tuple[int, ...]:
    """`devices` as a tuple of ints after checking each is a device index along the tp
    axis (an int in [0, tp)), none twice, at least one; ValueError naming the value."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise ValueError(f"devices={devices!r} must be a sequence of device indices in "
                         f"[0, tp={tp}), such as (0,) or range({tp})")
    devices = tuple(devices)
    if not devices:
        raise ValueError(f"devices={devices}: give at least one device index in [0, {tp})")
    for d in devices:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            raise ValueError(f"devices={devices}: {d!r} is not an integer device index")
        if not 0 <= d < tp:
            raise ValueError(f"devices={devices}: device {d} is outside [0, tp={tp})")
    if len(set(devices)) < len(devices):
        twice = sorted({d for d in devices if devices.count(d) > 1})
        raise ValueError(f"devices={devices}: devices {twice} are listed twice")
    return tuple(map(int, devices))


def load_shards(path: str | Path, tp: int, devices, *, dtype: str | None = None
                ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The checkpoint at `path` -> (config, {weight: [len(devices), ...]}): the shards of
    tensor-parallel devices `devices` (indices in [0, tp)) of every weight, in
    `shard_params`' layout (module docstring), as numpy arrays in `config.dtype` (a whole
    weight's copies are one array broadcast). `dtype` overrides the file's, as in
    `load_checkpoint`."""
    with open_checkpoint(path, dtype=dtype) as checkpoint:
        config = checkpoint.config
        tp = check_tp(config, tp)
        devices = check_device_indices(devices, tp)
        if checkpoint.quantised:
            raise NotImplementedError(
                f"{checkpoint.folder}: {sorted(checkpoint.quantised)} are stored quantised; "
                "load_shards reads plain (float32/bfloat16/float16) weights only (load a "
                "quantised checkpoint whole: mk.load_checkpoint, mk.step.shards.shard_params)")
        shards, held = {}, {}  # held: a split weight's cut axis and its devices' indices
        for w in weights_of(config):
            shape, dtype_of = w.stacked(config), np.dtype(config.dtype)
            split = split_of(config, w, tp)
            if split == "whole":
                shards[w.name] = np.zeros(shape, dtype_of)
                continue
            axis = split_axis(split)
            index = split_index(config, split, shape[axis], tp)[list(devices)]
            local = list(shape)
            local[axis] = index.shape[1]
            shards[w.name] = np.zeros((len(devices), *local), dtype_of)
            held[w.name] = (axis, index)
        for name, placed in checkpoint.placed.items():
            fill_slots(checkpoint.view(name),
                       [fill for p in placed for fill in _fills(p, shards, held)])
    if config.tie_embeddings:
        shards["lm_head"] = np.asarray(tied_lm_head(config, shards["embed"], tp))[
            list(devices)]
    shards = {name: a if name in held or name == "lm_head"
              else np.broadcast_to(a, (len(devices), *a.shape)) for name, a in shards.items()}
    check_values(checkpoint.folder, config, shards)
    return config, shards


def _fills(p, shards: dict, held: dict) -> list:
    """`mk.model.hf_layout.fill_slots`' (placement, held coordinates, target) for placement `p`:
    its slot whole in a whole weight, or each device's shard of it."""
    if p.param not in held:
        slot = shards[p.param][p.index]
        return [(p, every(slot.shape), slot)]
    axis, index = held[p.param]
    fills = []
    for k, shard in enumerate(shards[p.param]):
        slot = shard[p.index]
        coords = every(slot.shape)  # the slot's uncut axes are whole on every device
        coords[axis] = index[k]
        fills.append((p, coords, slot))
    return fills


def load_process_shards(path: str | Path, mesh: jax.sharding.Mesh, *,
                        dtype: str | None = None) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """The checkpoint at `path` -> (config, {weight: global jax.Array [tp, ...] sharded
    P("tp") over `mesh`}), this process loading and placing only its own devices' shards
    (`load_shards`; every process of the mesh calls it, as multi-controller JAX asks)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh is a {type(mesh).__name__}; it must be a jax.sharding.Mesh "
                         f"with the one axis {AXIS!r}")
    if tuple(mesh.axis_names) != (AXIS,):
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} must be ({AXIS!r},): one tp "
                         "axis")
    devices = list(mesh.devices.flat)
    ids = [d.id for d in devices]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"the mesh lists devices with ids {twice} more than once "
                         f"({len(devices)} entries, {len(set(ids))} devices); each device "
                         "holds one shard")
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if not mine:
        raise ValueError(f"process {jax.process_index()} holds none of the mesh's devices "
                         f"{devices}; call load_process_shards from the processes that do")
    config, shards = load_shards(path, len(devices), mine, dtype=dtype)
    sharding = NamedSharding(mesh, P(AXIS))

    def placed(a: np.ndarray) -> jax.Array:
        pieces = [jax.device_put(a[k:k + 1], devices[i]) for k, i in enumerate(mine)]
        return jax.make_array_from_single_device_arrays((len(devices), *a.shape[1:]),
                                                        sharding, pieces)

    return config, {name: placed(a) for name, a in shards.items()}
