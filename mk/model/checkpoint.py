"""Weights: deterministic random parameters and strict Hugging Face checkpoint loading.

Here: `init_params(config, seed)` (random weights in the layout of `mk.model.config`;
`pin_routes` gives a biased router's random routes a margin (`pinnable`), for judging a
chip's tokens) and `load_checkpoint(path)` for Qwen3 / Qwen3-MoE / Qwen3.5
(`qwen3_5_text`, and the language model of a full `qwen3_5` checkpoint), Kimi Linear
(`kimi_linear`), Kimi K3's language model (`kimi_k3`) and gpt-oss folders of
safetensors files, including quantised ones in their own formats (`mk.model.hf_quant`:
Hugging Face fine-grained FP8, gpt-oss's and Kimi K3's MXFP4 experts), whose weights load
as `mk.model.quant.QuantWeight`s. Its strict checks are two seams other loaders share:
`open_checkpoint` (files and tensor headers, before any weight is read) and `check_values`
(finite weights). A checkpoint is untrusted: its weight files must resolve inside its
folder, and its text (tensor names, config values) reaches error messages escaped and
bounded. Not here: where each tensor's values go in mk's params (`mk.model.hf_layout`), the
quantised formats' layouts (`mk.model.hf_quant`), loading only some devices' shards
(`mk.step.distributed`), downloading (a notebook may call `huggingface_hub` when the user
asks), quantising bf16 weights (`mk.model.quant`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from mk.model import quant, random_codes, untrusted
from mk.model.config import ModelConfig, check_seed, finite_number
from mk.model.errors import shown
from mk.model.hf_layout import every, fill_slots, hf_layout, hf_shape, placements
from mk.model.hf_config import not_run, tensor_prefixes
from mk.model.hf_quant import (INTERLEAVED, assemble_quantised, quant_format, quantised_layout,
                         quantised_problems, quantised_shape)
from mk.model.weights import FORMAT_GROUPS, hf_scheme, param_shapes, put_corner


def init_params(config: ModelConfig, seed: int = 0, formats=None) -> dict:
    """Random parameters in `config.dtype`; the same (config, seed, formats) always gives
    the same arrays. A config stored quantised (`config.formats`) gets them plain too:
    `mk.model.quant.quantize(config, params, **dict(config.formats))` packs them.

    Each tensor's generator is seeded by (seed, its name), so adding a tensor never
    changes another.
    Matrices are N(0, 1/fan_in) so activations keep unit scale; embeddings and lm_head are
    N(0, 1) so logits are well separated (greedy decoding is then robust to rounding);
    norm weights are 1 + N(0, 0.1^2) so a kernel that skips a norm weight is caught (stored
    minus `config.norm_offset`, except the gated DeltaNet's own norm, which has no offset).
    A lane-padded model (`ModelConfig.lane_padded`) gets its own widths' values (the
    unpadded model's) and zeros in the padding, as the loader gives.

    `formats` ({group: scheme}, as `mk.model.quant.quantize` takes them): those groups' weights
    are drawn as codes (`mk.model.random_codes.random_weight`, one leading row at a time, at the
    same root mean square), not quantised from the normal values: a model's real shapes and
    formats in seconds (quantising gpt-oss-20b's experts takes minutes, and their float32
    values do not fit a 40 GiB host). Each tensor is made on the host and put on the
    device once (`jax.device_put`: `jnp.asarray` of a host array held two copies there,
    which sent gpt-oss-20b's last 3.1 GiB expert stack out of a v5e's memory).
    """
    seed = check_seed(seed)
    chosen = {name: scheme for group, scheme in quant.check_quantisable(config, formats or {})
              .items() for name in FORMAT_GROUPS[group]}
    params, own = {}, param_shapes(config.unpadded())
    for name, (shape, dtype) in param_shapes(config).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name in chosen:  # a stack a leading row at a time: one row's codes alive
            rms = 1.0 if name in ("embed", "lm_head") else 1 / np.sqrt(own[name][0][-2])
            params[name] = _random_stack(shape, own[name][0], chosen[name], rng, rms, name)
            continue
        x = rng.standard_normal(own[name][0], np.float32)
        if name.endswith("norm"):
            x = 1.0 - (config.norm_offset if name != "lin_norm" else 0.0) + 0.1 * x
        elif name not in ("embed", "lm_head"):
            x = x / np.sqrt(x.shape[-2], dtype=np.float32)  # fan_in of an [.., in, out] weight
        if x.shape != shape:  # a lane-padded model's padding: zeros
            x, values = np.zeros(shape, np.float32), x
            put_corner(x, values)
        params[name] = jax.device_put(x.astype(jnp.dtype(dtype)))
    return params


def _random_stack(shape, own, scheme, rng, rms, name):
    """`mk.model.random_codes.random_weight` of a stacked weight [L, ..., I, O] a leading row at
    a time (a plain matrix whole), the rows stacked on the host and put on the device
    once: the device never holds the rows and their stack (gpt-oss-20b's 3.1 GiB MXFP4
    expert stacks twice are over a v5e's free HBM)."""
    if len(shape) == 2:
        return random_codes.random_weight(shape, scheme, rng, rms, own, name)
    data = scale = None
    for i in range(shape[0]):
        row = random_codes.random_weight(shape[1:], scheme, rng, rms, own[1:], name)
        if data is None:
            data = np.empty((shape[0], *row.data.shape), row.data.dtype)
            scale = np.empty((shape[0], *row.scale.shape), row.scale.dtype)
        data[i], scale[i] = np.asarray(row.data), np.asarray(row.scale)
        del row
    return quant.QuantWeight(jax.device_put(data), jax.device_put(scale), scheme)


# The logits by which `pin_routes`' experts beat the rest: the token's part of a random
# router logit is about N(0, 1) (`init_params`' router), so its 32 (or 128) experts'
# spread stays under 8 and every pinned expert wins by more than 8.
PINNED_MARGIN = 16.0


def pinnable(config: ModelConfig) -> bool:
    """Whether `pin_routes` can pin `config`'s routes: its router has a bias."""
    return "router_logit_bias" in param_shapes(config)


def pin_routes(config: ModelConfig, params: dict, seed: int = 0,
               margin: float = PINNED_MARGIN) -> dict:
    """`params` (`init_params`') with each MoE layer's router bias raised by `margin` on
    `config.experts_per_token` experts of that layer's own (drawn by `seed`), so every token
    routes to them with a margin no rounding closes. Random routers are the opposite: at
    gpt-oss-20b's 24 layers of top-4 of 32, a 1e-6 change of the normed rows (rms_eps x 1.1)
    flips a choice and the first token's logits move by up to 100 (the CPU reference
    against itself), so a chip's tokens cannot be judged against the CPU's. The softmax
    over the pinned experts still follows each token. ValueError for a model whose router
    has no bias (`router_logit_bias`: gpt-oss's) or a margin not a positive number."""
    if not pinnable(config) or "router_logit_bias" not in params:
        raise ValueError(f"{config.name}: no router_logit_bias; pin_routes raises a "
                         "biased router's bias (gpt-oss's)")
    margin = finite_number("margin", margin, 0.0, open_low=True)
    bias = np.asarray(params["router_logit_bias"], np.float32)
    rng = np.random.default_rng([check_seed(seed), zlib.crc32(b"pin_routes")])
    for layer in range(bias.shape[0]):
        bias[layer, rng.choice(bias.shape[1], config.experts_per_token, replace=False)] += (
            margin)
    return params | {"router_logit_bias": jax.device_put(
        bias.astype(params["router_logit_bias"].dtype))}


# -- Hugging Face checkpoints -------------------------------------------------------------
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_MAX_BYTES = 100_000_000  # safetensors' own limit on a file's header
INDEX_MAX_BYTES = 256 * 2**20  # the largest index read (a 10**5-tensor one is ~10 MiB)
# safetensors dtype tags a checkpoint may store; each is cast to `config.dtype` on load.
STORED_DTYPES = ("F32", "BF16", "F16")



def load_checkpoint(path: str | Path, *, dtype: str | None = None
                    ) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """Read a Hugging Face folder of a model type `mk.model.hf_config` reads into (config, params).

    The folder holds `config.json` and either `model.safetensors` or shards listed by
    `model.safetensors.index.json`. Loading is strict (`open_checkpoint`): every tensor of
    `hf_layout` must be present once with the right shape and a float32/bfloat16/float16
    dtype, and nothing else may be there (a tied checkpoint may repeat the embedding as
    `lm_head.weight`). All problems are collected into one `ValueError` before any weight
    is converted.
    A quantised checkpoint (`quant_format`) may store its projections as fp8 or its experts
    as MXFP4 instead; those parameters come back as `mk.model.quant.QuantWeight`s (run the
    reference on `mk.model.quant.dequantize(params)`), their NaN or inf scales and NaN codes
    refused by field (`mk.model.quant.check_values`); every weight must be finite in the
    config's dtype (`check_values`).
    Parameters are cast to `config.dtype`; `dtype` overrides the file's dtype. A Qwen3.5
    checkpoint's multi-token-prediction (`mtp.*`) and vision (`model.visual.*`) tensors,
    and a Kimi K3 one's tensors outside `language_model.`, are not run by mk and are
    skipped.
    """
    with open_checkpoint(path, dtype=dtype) as checkpoint:
        params = _assemble(checkpoint)
        params.update(assemble_quantised(checkpoint.folder, checkpoint.handles,
                                         checkpoint.where, checkpoint.layout,
                                         checkpoint.padded))
    check_values(checkpoint.folder, checkpoint.config, params)
    return checkpoint.config, params


@dataclasses.dataclass(frozen=True)
class OpenCheckpoint:
    """A checkpoint whose files and tensor headers passed the strict checks
    (`open_checkpoint`): its model as mk holds it (`config`, lane-padded), its tensors by
    name (`layout`: `mk.model.hf_layout.hf_layout` with `mk.model.hf_quant`'s quantised tensors;
    each file's open handle, `handles`, by the file holding it, `where`), where each plain
    tensor's values go (`placed`: `mk.model.hf_layout.placements`) and the slot shapes of the
    quantised ones (`padded`)."""

    folder: Path
    config: ModelConfig
    layout: dict
    handles: dict
    where: dict[str, str]
    placed: dict
    padded: dict

    @property
    def quantised(self) -> frozenset[str]:
        """The mk parameters stored quantised (read whole by `mk.model.hf_quant`)."""
        params = {param for param, _, how in self.layout.values() if isinstance(how, str)}
        return frozenset(params | {w for pair in params & set(INTERLEAVED)
                                   for w in INTERLEAVED[pair]})

    def view(self, name: str):
        """Tensor `name` unread: a safetensors slice (`mk.model.hf_layout.fill_slots` reads it)."""
        return self.handles[self.where[name]].get_slice(name)


@contextlib.contextmanager
def open_checkpoint(path: str | Path, *, dtype: str | None = None):
    """The checkpoint folder at `path` opened and checked as `load_checkpoint` checks it
    (its config, every file inside the folder, every tensor's name, shape and dtype, a
    tied lm_head equal to the embedding), before any weight is read -> `OpenCheckpoint`,
    its files open until the block ends. Weights' values are `check_values`'s."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path={shown(path)} must be a checkpoint folder's path (a str or "
                         "a pathlib.Path)")
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path={str(path)!r} is not a folder; a checkpoint is a folder "
                         f"holding config.json and {SINGLE_FILE} or {INDEX_FILE}")
    config = ModelConfig.from_hf(folder, dtype=dtype)
    own = config.unpadded()  # the file's widths; mk holds `config`'s (lane-padded)
    hf = untrusted.load_json(folder / "config.json", "Hugging Face config")
    model, head = tensor_prefixes(hf.get("model_type"))
    layout = hf_layout(own, model, head)
    layout = quantised_layout(own, quant_format(folder, hf, own), layout,
                              _header_dtypes(folder))
    quant.check_streamed(config, {param for param, _, how in layout.values()
                                  if how in ("fp8", "mxfp4_blocks", "mxfp4_packed")})
    placed = placements(own, layout)
    shapes, padded = _slot_shapes(own), _slot_shapes(config)
    with contextlib.ExitStack() as stack:
        handles, where, problems = _open_tensors(folder, layout, placed, shapes, stack,
                                                 hf_aliases(config, model))
        head_name = f"{head}lm_head.weight"
        for name in where:
            if not_run(hf.get("model_type"), name):
                continue
            if name not in layout and not (name == head_name and config.tie_embeddings):
                problems.append(f"{where[name]}: unexpected tensor {name} (not in "
                                f"{config.name}'s layout; biases and buffers are not loaded)")
        embed = next(name for name, (param, _, _) in layout.items() if param == "embed")
        if config.tie_embeddings and {head_name, embed} <= set(where):
            problems += _check_tied_head(handles, where, embed, head_name)
        problems += quantised_problems(layout, padded)
        if problems:
            raise ValueError(_problems(folder, config, problems))
        yield OpenCheckpoint(folder, config, layout, handles, where, placed, padded)


def check_values(folder: Path, config: ModelConfig, params) -> None:
    """Raise ValueError (naming each parameter) unless every weight of `params` (a
    checkpoint's, or shards of them) is finite in `config.dtype`: a quantised one's scales
    and codes (`mk.model.quant.check_values`), then every value as the reference reads it."""
    bad = []
    for name, p in params.items():  # a NaN or inf scale or NaN code, named by its field
        if isinstance(p, quant.QuantWeight):
            try:
                quant.check_values(f"mk {name}", p)
            except ValueError as err:
                bad.append(str(err))
    if bad:
        raise ValueError(_problems(folder, config, bad))
    values = quant.dequantize(params, config.dtype)  # plain arrays, int8 and int4 too
    bad = [f"mk {name}: {np.size(x) - int(np.isfinite(x).sum())} values are NaN or inf "
           f"in {x.dtype}" for name, x in ((n, np.asarray(v, np.float32))
                                          for n, v in values.items())
           if not np.isfinite(x).all()]
    if bad:  # a NaN weight, or a value past bf16's range (a plain one, or code x scale)
        raise ValueError(_problems(folder, config, bad) + f"\n(weights must be finite in "
                         f"{config.dtype}; its largest value is "
                         f"{float(jnp.finfo(config.dtype).max):.4g})")


def _header_dtypes(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype tag, from every readable file's header (a file
    that cannot be read is reported by `_open_tensors`)."""
    dtypes = {}
    for file in _shard_files(folder):
        try:
            with safe_open(folder / file, "numpy") as handle:
                dtypes.update({name: handle.get_slice(name).get_dtype()
                               for name in handle.keys()})
        except (SafetensorError, OSError):
            continue
    return dtypes


def _problems(folder, config, problems, first: int = 20) -> str:
    """One error for many problems: the first `first`, then how many more there are."""
    plural = "s" if len(problems) > 1 else ""
    more = (f"\n  ... and {len(problems) - first} more" if len(problems) > first else "")
    return (f"{folder}: cannot load the {config.name} checkpoint ({len(problems)} "
            f"problem{plural}):\n  " + "\n  ".join(map(_line, problems[:first])) + more)


def _line(problem: str, limit: int = 2000) -> str:
    """One problem as one bounded line: tensor names come from the files, so a newline or
    control character in one is escaped (as repr does) and a long line cut (a line may
    list a shard's tensors)."""
    text = problem if problem.isprintable() else repr(problem)[1:-1]
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _Renamed:
    """A safetensors handle whose tensors answer to `hf_aliases` names too (the layout's)."""

    def __init__(self, handle, aliases: dict[str, str]):
        self.handle, self.stored = handle, {}
        for name in handle.keys():
            self.stored.setdefault(aliases.get(name, name), []).append(name)

    def keys(self):
        return list(self.stored)

    def twice(self) -> list[str]:
        return [" and ".join(names) for names in self.stored.values() if len(names) > 1]

    def get_slice(self, name):
        return self.handle.get_slice(self.stored[name][0])

    def get_tensor(self, name):
        return self.handle.get_tensor(self.stored[name][0])


def hf_aliases(config: ModelConfig, model: str = "model.") -> dict[str, str]:
    """Other spellings of layout names (the decoder's under prefix `model`): Kimi's dense
    MLP is `mlp.` in Moonshot's checkpoints (Kimi K3's too: the release's kimi/load.py)
    and `block_sparse_moe.` in transformers' save_pretrained."""
    if hf_scheme(config) != "kimi":
        return {}
    return {f"{model}layers.{i}.mlp.{proj}_proj.weight":
            f"{model}layers.{i}.block_sparse_moe.{proj}_proj.weight"
            for i in config.dense_layers
            for proj in ("gate", "up", "down")}


def _open_tensors(folder, layout, placed, shapes, stack, aliases=None):
    """Open every file, check every tensor's header; (handles, tensor -> file, problems).

    A tensor the index places in a missing or unreadable file is reported with that file,
    not again as missing. `aliases` (stored name -> layout name) renames tensors first.
    """
    files = _shard_files(folder)
    handles, where, problems, reported = {}, {}, [], set()
    aliases = aliases or {}
    for file, listed in files.items():
        if listed is not None:
            listed = {aliases.get(name, name) for name in listed}
        if not (folder / file).is_file():
            problems.append(f"{INDEX_FILE} maps {len(listed)} tensors to {file}, which does "
                            f"not exist: {', '.join(sorted(listed))}")
            reported |= listed
            continue
        try:
            handle = stack.enter_context(safe_open(folder / file, "numpy"))
        except (SafetensorError, OSError) as err:
            problems.append(_describe_unreadable(folder / file, err, listed))
            reported |= set(layout) if listed is None else listed
            continue
        handle = _Renamed(handle, aliases)
        problems += [f"{file}: holds both {pair} (one tensor, two spellings)"
                     for pair in handle.twice()]
        handles[file] = handle
        held = set(handle.keys())
        if listed is not None:
            problems += [f"{file}: holds no {name}, which {INDEX_FILE} maps to it"
                         for name in sorted(listed - held)]
            problems += [f"{file}: holds {name}, which {INDEX_FILE} does not map to it"
                         for name in sorted(held - listed)]
            reported |= (listed - held) | (held - listed)
            held &= listed
        for name in sorted(held):  # the index maps each name to one file: no duplicates
            where[name] = file
            problems += _check_tensor(file, name, handle.get_slice(name), layout, placed,
                                      shapes, handle.stored[name][0])
    problems += [f"missing tensor {name} ({_slot(*layout[name][:2])})"
                 for name in layout if name not in where and name not in reported]
    return handles, where, problems


def _shard_files(folder: Path) -> dict[str, set[str] | None]:
    """File name -> the tensor names the index maps to it (None: one file holds all)."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    for path in (single, index):
        if path.exists():  # a named pipe would block the reader that opened it
            untrusted.check_regular(path, "checkpoint file")
    if single.is_file() and index.is_file():
        raise ValueError(f"{folder}: both {SINGLE_FILE} and {INDEX_FILE} exist; which "
                         "weights to load is ambiguous, remove one")
    if single.is_file():
        _check_inside(folder, SINGLE_FILE, None)
        return {SINGLE_FILE: None}
    if not index.is_file():
        raise ValueError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} exists")
    try:  # a regular file, bounded (an index of 10**5 tensors is a few MiB)
        weight_map = untrusted.load_json(index, "safetensors index", INDEX_MAX_BYTES)[
            "weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (KeyError, TypeError) as err:
        raise ValueError(f"{index}: not a safetensors index with a weight_map "
                         f"({type(err).__name__}: {err})") from None
    files: dict[str, set[str] | None] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ValueError(f"{index}: weight_map maps {shown(name)} to {shown(file)}, not "
                             "a file name")
        files.setdefault(file, set()).add(name)
    for file, names in files.items():
        _check_inside(folder, file, names)
        if (folder / file).exists():  # a missing one is reported with its tensors
            untrusted.check_regular(folder / file, "checkpoint file")
    return files


def _check_inside(folder: Path, file, names: set[str] | None) -> None:
    """Raise ValueError unless `file` (a name from the index, or SINGLE_FILE) is a relative
    path that resolves, symlinks followed, inside `folder`: a checkpoint must not make mk
    read files elsewhere. One exception: the Hugging Face cache, whose
    `snapshots/<revision>/` files are symlinks to the same repository's `blobs/`."""
    home, path = folder.resolve(), Path(file) if isinstance(file, str) else None
    if path is None or path.is_absolute() or ".." in path.parts:
        why = "an absolute path or one through '..'"
    else:
        target = (folder / path).resolve()
        cache = home.parent.parent / "blobs" if home.parent.name == "snapshots" else home
        if target.is_relative_to(home) or target.is_relative_to(cache):
            return
        why = f"a symlink to {shown(str(target), 300)}"
    what = (f"{INDEX_FILE} maps tensor {shown(min(names))}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''} to" if names
            else "its weights are")
    raise ValueError(f"{folder}: {what} {shown(file)}, {why}, outside the checkpoint "
                     "folder; mk reads only files inside it")


def _slot_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """`param_shapes` and the shapes of gpt-oss's fused gate|up pseudo-parameters
    (`INTERLEAVED`: what a quantised one's layout is checked against)."""
    shapes = param_shapes(config)
    for pair, (first, _) in INTERLEAVED.items():
        if first in shapes:
            shapes[pair] = shapes[first]
    return shapes


def _check_tensor(file, name, view, layout, placed, shapes, stored=None) -> list[str]:
    """A tensor's shape and dtype problems, named as the file spells it (`stored`: an
    `hf_aliases` spelling of layout name `name`)."""
    if name not in layout:
        return []  # reported as unexpected by the caller
    param, index, how = layout[name]
    want, dtypes = (quantised_shape(param, how, shapes[param][0][len(index):])
                    if isinstance(how, str) else (hf_shape(placed[name]), STORED_DTYPES))
    got, name = tuple(view.get_shape()), stored or name
    problems = []
    if got != want:
        problems.append(f"{file}: {name} has shape {got}, expected {want} "
                        f"({_slot(param, index)})")
    if view.get_dtype() not in dtypes:
        problems.append(f"{file}: {name} has dtype {view.get_dtype()}, expected one of "
                        f"{dtypes}")
    return problems


def _check_tied_head(handles, where, embed_name, head_name="lm_head.weight") -> list[str]:
    dtypes = {name: handles[where[name]].get_slice(name).get_dtype()
              for name in (head_name, embed_name)}
    if dtypes[head_name] not in STORED_DTYPES:  # e.g. a quantised head: not the embedding
        return [f"{where[head_name]}: {head_name} is stored as {shown(dtypes[head_name])}, "
                "but config.json says tie_word_embeddings=true: a tied lm_head is "
                f"{embed_name}; remove {head_name} or untie the model"]
    if dtypes[embed_name] not in STORED_DTYPES:
        return []  # reported by _check_tensor
    embed = handles[where[embed_name]].get_tensor(embed_name)
    head = handles[where[head_name]].get_tensor(head_name)
    if head.shape == embed.shape and np.array_equal(head.astype(np.float32),
                                                    embed.astype(np.float32)):
        return []
    return [f"{where[head_name]}: {head_name} differs from {embed_name} but config.json "
            "says tie_word_embeddings=true"]


def _assemble(checkpoint: OpenCheckpoint) -> dict[str, jax.Array]:
    """Stack the validated plain tensors per parameter in numpy, each value where its
    placement puts it (`mk.model.hf_layout.fill_slots`; a lane-padded slot's padding zeros);
    then each put on the device once (`jax.device_put`, as `init_params`)."""
    stacks = {param: np.zeros(shape, jnp.dtype(dtype)) for param, (shape, dtype)
              in param_shapes(checkpoint.config).items() if param not in checkpoint.quantised}
    for name, placed in checkpoint.placed.items():
        fill_slots(checkpoint.view(name),
                   [(p, every(stacks[p.param].shape[len(p.index):]), stacks[p.param][p.index])
                    for p in placed])
    return {param: jax.device_put(stacked) for param, stacked in stacks.items()}


def _slot(param: str, index: tuple[int, ...]) -> str:
    return f"mk {param}[{', '.join(map(str, index))}]" if index else f"mk {param}"


def _describe_unreadable(path: Path, err: Exception, listed: set[str] | None) -> str:
    """Why safetensors refused a file; names the cut-off tensors when the header is intact."""
    detail = f"{type(err).__name__}: {err}"
    cut = []
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if 8 + length <= size and length <= HEADER_MAX_BYTES:  # not a 10 GB "header"
                header = json.loads(f.read(length))
                data = size - 8 - length
                cut = sorted(name for name, info in header.items()
                             if name != "__metadata__" and info["data_offsets"][1] > data)
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        pass  # the header itself is unreadable; safetensors' message says why
    message = f"{path.name}: not a readable safetensors file ({detail})"
    if cut:
        message += f"; data ends before tensors {', '.join(cut)}"
    if listed:
        message += f"; {INDEX_FILE} expects it to hold {', '.join(sorted(listed))}"
    return message
