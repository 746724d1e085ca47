"""Where each Hugging Face tensor's values sit in mk's params, and reading them by ranges.

`hf_layout(config)` names the mk parameter slot each HF tensor fills; `placements` says,
per HF tensor, where each of its values lands inside that slot, as data (a `Placement`
maps each axis of the slot to one axis of the tensor); `hf_shape` is the shape each tensor
must have; `fill_slots` fills slots, or any selection of their coordinates (a device's
shard), from a safetensors view, reading only the ranges those coordinates need.
`mk.model.checkpoint.load_checkpoint` and `mk.step.distributed.load_shards` both fill through here,
so the layout is stated once.

Not here: opening and checking files (`mk.model.checkpoint`), the quantised formats' own
layouts (`mk.model.hf_quant`), which device holds what (`mk.step.shards`). Every way a checkpoint
stores a weight as one such map: docs/design/mk.model.hf_layout.md.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from mk.model.config import ModelConfig
from mk.model.hf_quant import INTERLEAVED
from mk.model.weights import hf_names, layer_rows, param_shapes, weights_of


def parts_of(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """Pseudo-parameter "param:part" -> (param, the slice of its last axis it fills): the
    weights whose Hugging Face tensors are parts (`mk.model.weights`: KDA's q, k and v
    projections and convs; "kda" is A_log stored as [1, 1, Nv, 1], the whole vector)."""
    kw = config.linear_key_width
    cols = {"q": slice(0, kw), "k": slice(kw, 2 * kw), "v": slice(2 * kw, None),
            "kda": slice(None)}
    return {f"{w.name}:{part}": (w.name, cols[part]) for w in weights_of(config)
            if isinstance(hf_names(w, config), dict) for part in hf_names(w, config)}


def hf_layout(config: ModelConfig, model: str = "model.", head: str = ""
              ) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """HF tensor name -> (mk parameter, index into its stacked axes, transposed?), from the
    Hugging Face names of `mk.model.weights` (in the config's naming scheme).

    HF stores a projection (an nn.Linear's `.weight`) as [out, in]; mk stores [in, out], so
    every such matrix but the embedding table is transposed (and a conv weight [C, 1, W]
    becomes [W, C]); a matrix stored as a bare parameter (gpt-oss's experts [E, in, out])
    is not. A tied model has no `lm_head.weight` entry. `model` prefixes the decoder's
    names ("model.language_model." in a full qwen3_5 checkpoint) and `head` lm_head's
    (Kimi K3's "language_model.": `mk.model.hf_config.tensor_prefixes`). Two weights stored in
    one HF tensor fill the pseudo-parameter "a+b" (Qwen3.5's q_proj: "wq+wq_gate";
    gpt-oss's interleaved gate_up tensors: `INTERLEAVED`); a weight stored in parts fills
    "param:part" (`parts_of`).
    """
    layout: dict[str, tuple[str, tuple[int, ...], bool]] = {}
    for w in weights_of(config):
        names = hf_names(w, config)
        if names is None:
            continue
        experts = "{e}" in str(names)
        matrix = w.name != "embed" and len(w.shape(config)) - experts >= 2
        parts = names if isinstance(names, dict) else {"": names}
        rows = layer_rows(config, w.kind) or ((None, ()),)
        for part, rel in parts.items():
            param = f"{w.name}:{part}" if part else w.name
            for layer, row in rows:
                prefix = "" if layer is None else f"{model}layers.{layer}."
                for e in range(config.experts) if experts else (None,):
                    name = prefix + rel.format(model=model, head=head, e=e)
                    index = (() if layer is None else (row,)) + (() if e is None else (e,))
                    if name in layout:  # one HF tensor holding two weights
                        param_before, index_before, transposed = layout[name]
                        layout[name] = (f"{param_before}+{param}", index_before, transposed)
                    else:
                        layout[name] = (param, index, matrix and name.endswith(".weight"))
    return layout


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where one HF tensor's values land in one mk parameter: in its slot `index` (along
    the stacked layer and expert axes), whose axis j holds at coordinate c < len(coords[j])
    the tensor's coordinate coords[j][c] along the tensor's axis axes[j]; -1, or c past
    the end (a lane-padded width), holds none of this tensor's values. The tensor has
    `rank` axes; those `axes` omits have length 1."""

    param: str
    index: tuple[int, ...]
    rank: int
    axes: tuple[int, ...]
    coords: tuple[np.ndarray, ...]


def _placed(own: ModelConfig, param: str, lead: int, transposed: bool
            ) -> tuple[Placement, ...]:
    """The placements of a tensor filling `param` (a pseudo-parameter of `hf_layout` too)
    of the model in its own widths, at index () (`placements` sets each tensor's)."""
    shapes = param_shapes(own)

    def slot(name):
        return shapes[name][0][lead:]

    if param in INTERLEAVED:  # [..., 2F]: the first weight's columns even, the second's odd
        *rest, width = slot(INTERLEAVED[param][0])
        axes = tuple(range(len(rest) + 1))
        return tuple(Placement(target, (), len(axes), axes,
                               (*map(np.arange, rest), 2 * np.arange(width) + start))
                     for target, start in zip(INTERLEAVED[param], (0, 1)))
    if param == "wq+wq_gate":  # [N*2H, D]: per head, H query rows then H gate rows
        (D, width), H = slot("wq"), own.head_dim
        column = np.arange(width)
        return tuple(Placement(target, (), 2, (1, 0),
                               (np.arange(D), column // H * 2 * H + column % H + offset))
                     for target, offset in (("wq", 0), ("wq_gate", H)))
    target, cut = parts_of(own).get(param, (param, slice(None)))
    shape = slot(target)
    coords = [np.arange(n) for n in shape]
    coords[-1] = np.full(shape[-1], -1)
    coords[-1][cut] = np.arange(len(range(shape[-1])[cut]))
    if target == "lin_conv":  # [C, 1, W] -> [W, C]
        rank, axes = 3, (2, 0)
    elif param == "lin_a_log:kda":  # [1, 1, Nv, 1]
        rank, axes = 4, (2,)
    else:
        rank = len(shape)
        axes = tuple(reversed(range(rank))) if transposed else tuple(range(rank))
    return (Placement(target, (), rank, axes, tuple(coords)),)


def placements(config: ModelConfig, layout: dict) -> dict[str, tuple[Placement, ...]]:
    """HF tensor name -> its placements, for the plain tensors of `layout` (`hf_layout`
    entries whose third field is a transpose flag; `mk.model.hf_quant`'s quantised ones are
    not placed here). `config` is the model in its own widths (`ModelConfig.unpadded`)."""
    made: dict[tuple, tuple[Placement, ...]] = {}
    out = {}
    for name, (param, index, transposed) in layout.items():
        if not isinstance(transposed, bool):
            continue
        key = (param, len(index), transposed)
        if key not in made:  # one map serves every layer and expert
            made[key] = _placed(config, param, len(index), transposed)
        out[name] = tuple(dataclasses.replace(p, index=index) for p in made[key])
    return out


def hf_shape(placed: tuple[Placement, ...]) -> tuple[int, ...]:
    """The shape of the tensor that `placed` read: each axis as long as its placements'
    largest coordinate along it, plus one."""
    shape = [1] * placed[0].rank
    mapped: dict[int, int] = {}
    for p in placed:
        for axis, coords in zip(p.axes, p.coords):
            mapped[axis] = max(mapped.get(axis, 0), int(coords.max()) + 1 if len(coords) else 0)
    for axis, n in mapped.items():
        shape[axis] = n
    return tuple(shape)


def every(shape: tuple[int, ...]) -> list[np.ndarray]:
    """The selection of every coordinate of a slot of `shape` (`fill_slots`)."""
    return [np.arange(n) for n in shape]


def _sources(placement: Placement, held) -> list[np.ndarray]:
    """Per slot axis, the tensor coordinate each held slot coordinate takes (-1: none)."""
    out = []
    for coords, h in zip(placement.coords, held):
        inside = (h >= 0) & (h < len(coords))
        out.append(np.where(inside, coords[np.where(inside, h, 0)] if len(coords) else -1, -1))
    return out


def _runs(coords: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted distinct coordinates -> their maximal runs of consecutive ones, each as
    (first coordinate, length, where the run starts within `coords`)."""
    starts = [0, *(np.flatnonzero(np.diff(coords) != 1) + 1).tolist(), len(coords)]
    return [(int(coords[a]), b - a, a) for a, b in zip(starts, starts[1:])]


def _selector(positions: np.ndarray):
    """Positions as a slice when they are one ascending run of consecutive ones."""
    if len(positions) and np.array_equal(positions, np.arange(positions[0],
                                                              positions[0] + len(positions))):
        return slice(int(positions[0]), int(positions[0]) + len(positions))
    return positions


def _at(selectors):
    """An index of several axes: slices as they are; arrays (with slices) as an outer
    product (np.ix_)."""
    if all(isinstance(s, slice) for s in selectors):
        return tuple(selectors)
    return np.ix_(*(np.arange(s.start, s.stop) if isinstance(s, slice) else s
                    for s in selectors))


def fill_slots(view, fills) -> None:
    """Fill from one HF tensor (`view`: a safetensors slice, indexable by ranges) each
    (placement, held, target) of `fills`: `target` an array whose axis j holds the slot
    coordinates held[j] (-1: none, left as it is: padding), of the placement's slot.

    Reads, per axis of the tensor, the distinct coordinates any fill needs, as their
    maximal contiguous runs (the product of the axes' runs: one read per combination), and
    nothing else; a fill needing every coordinate reads the tensor once, whole."""
    sources = [_sources(p, held) for p, held, _ in fills]
    rank = fills[0][0].rank
    needed: list[list[np.ndarray]] = [[] for _ in range(rank)]
    for (p, _, _), src in zip(fills, sources):
        for axis, s in zip(p.axes, src):
            needed[axis].append(s[s >= 0])
    read = [np.unique(np.concatenate(n)) if n else np.zeros(1, int) for n in needed]
    if any(len(r) == 0 for r in read):
        return  # every held coordinate is padding
    boxes = list(itertools.product(*map(_runs, read)))
    block = None  # the coordinates `read`, in the tensor's dtype
    for box in boxes:
        values = view[tuple(slice(start, start + n) for start, n, _ in box)]
        if len(boxes) == 1:
            block = values
        else:
            if block is None:
                block = np.empty([len(r) for r in read], values.dtype)
            block[tuple(slice(offset, offset + n) for _, n, offset in box)] = values
    for (p, _, target), src in zip(fills, sources):
        omitted = tuple(a for a in range(rank) if a not in p.axes)
        oriented = block.transpose(p.axes + omitted)
        oriented = oriented.reshape(oriented.shape[:len(p.axes)])
        kept = [np.flatnonzero(s >= 0) for s in src]
        taken = [np.searchsorted(read[axis], s[k]) for axis, s, k in zip(p.axes, src, kept)]
        target[_at([_selector(k) for k in kept])] = oriented[_at([_selector(t)
                                                                  for t in taken])]

