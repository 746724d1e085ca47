"""Quantised Hugging Face checkpoints: the formats `mk.model.checkpoint.load_checkpoint` reads in
their own layouts (`QUANT_FORMATS`: fine-grained FP8, gpt-oss's MXFP4 experts), their
tensors in the loader's layout (`quantised_layout`), their shapes and problems, and the
validated tensors as `mk.model.quant.QuantWeight`s (`assemble_quantised`); also `INTERLEAVED`,
gpt-oss's fused gate|up tensors (plain or packed). Not here: opening files, the strict
checks of plain tensors, the loader itself (`mk.model.checkpoint`); quantising bf16 weights
(`mk.model.quant`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from mk.model import quant, unpack
from mk.model.config import ModelConfig
from mk.model.errors import shown
from mk.model.weights import FORMAT_GROUPS, put_corner

# gpt-oss's fused expert tensors: [..., 2F] whose even columns are the first weight's and
# odd ones the second's (`mk.model.weights`: both name the same tensor).
INTERLEAVED = {"we_gate+we_up": ("we_gate", "we_up"), "be_gate+be_up": ("be_gate", "be_up")}

# -- Quantised checkpoints ----------------------------------------------------------------
# config.json's quantization_config.quant_method values read here, in their own layouts:
# - "fp8" (Hugging Face fine-grained FP8, weight_block_size [128, 128], e4m3; the layout
#   is mk.model.quant's "fp8", documented there): `X.weight` float8_e4m3fn plus
#   `X.weight_scale_inv` (float32, or bf16 widened exactly); any projection of the dense,
#   experts or lm_head families (mk.FORMAT_GROUPS) may be stored so, each mk parameter
#   wholly or not at all; the others as usual.
# - "mxfp4" (the gpt-oss expert layout): per MoE layer `mlp.experts.gate_up_proj_blocks`
#   uint8 [E, 2Fe, D/32, 16] and `..._scales` uint8 [E, 2Fe, D/32] (rows 2f and 2f + 1 are
#   expert row f of gate and of up), `mlp.experts.down_proj_blocks` [E, D, Fe/32, 16] and
#   `..._scales` [E, D, Fe/32]; each byte holds e2m1 values 2k (low nibble) and 2k + 1 (high)
#   of a 32-value block along the input, each scale an e8m0 exponent (bias 127). Loaded
#   into mk.model.quant's "fp4" layout (a permutation of bits and transposes: bit-exact).
# - "compressed-tensors" with format "mxfp4-pack-quantized" (Kimi K3's routed experts;
#   `PACKED_MXFP4`): per expert and projection (w1 gate, w3 up, w2 down) `X.weight_packed`
#   uint8 [O, I/2] (byte j: value 2j in the low nibble, 2j + 1 in the high; the release's
#   kimi/load.py views its rows as little-endian uint32 words of 8 values, low nibble
#   first: the same order) and `X.weight_scale` uint8 [O, I/32] (e8m0, the release
#   refuses 0 and 255: so does mk); every other tensor plain. Loaded into mk.model.quant's "fp4"
#   layout bit-exactly, gate and up included: the release re-stores those as fp8 with a
#   bf16 scale per 256 rows after loading (`ModelConfig.expert_fp8_block`), a kernel
#   layout mk's kernels do not have yet. The tensor names and dtypes are the release's
#   (Inferact/tpu-megakernels, kimi/load.py); the quantization_config spelling is not in
#   the release (it reads none) but in third-party K3 ports found by search (mlx-vlm's
#   test of its compressed-tensors format: format at the top or in config_groups).
QUANT_FORMATS = ("fp8", "mxfp4", "compressed-tensors")
PACKED_MXFP4 = "mxfp4-pack-quantized"


def quant_format(folder, hf: dict, config: ModelConfig) -> str | None:
    """The quantised format config.json declares (`QUANT_FORMATS`; its
    quantization_config, else its text_config's), or None."""
    qc = hf.get("quantization_config")
    text = hf.get("text_config")
    if qc is None and isinstance(text, dict):  # a wrapper's may sit in its text_config
        qc = text.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in QUANT_FORMATS:
        raise NotImplementedError(f"{folder}: quantization_config.quant_method="
                                  f"{shown(method)} is not read; mk reads {QUANT_FORMATS}")
    if method == "fp8":
        block, fmt = qc.get("weight_block_size"), qc.get("fmt", "e4m3")
        if block != [128, 128] or fmt != "e4m3":
            raise ValueError(f"{folder}: fp8 quantization_config weight_block_size="
                             f"{shown(block)}, fmt={shown(fmt)}; mk reads [128, 128] blocks "
                             "of e4m3")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        groups = groups.values() if isinstance(groups, dict) else ()
        found = {qc.get("format")} | {g.get("format") for g in groups if isinstance(g, dict)}
        if found - {None} != {PACKED_MXFP4}:
            raise NotImplementedError(f"{folder}: compressed-tensors format "
                                      f"{shown(sorted(map(str, found - {None})))} is not "
                                      f"read; mk reads {PACKED_MXFP4!r} (Kimi K3's experts)")
        method = "mxfp4_packed"
    if method in ("mxfp4", "mxfp4_packed") and not config.experts:
        raise ValueError(f"{folder}: quant_method={shown(qc.get('quant_method'))} stores "
                         f"experts, and {config.name} has none")
    return method


def quantised_layout(config: ModelConfig, fmt: str | None, layout: dict, dtypes: dict
                     ) -> dict:
    """`hf_layout` with the quantised tensors of format `fmt` in place of their plain ones;
    their third field names their role ("fp8", "fp8_scale", "mxfp4_blocks",
    "mxfp4_scales"; "mxfp4_packed", "mxfp4_scale": K3's) instead of a transpose flag."""
    if fmt is None:
        return layout
    quantisable = {name for names in FORMAT_GROUPS.values() for name in names}
    out = dict(layout)
    if fmt == "fp8":
        for name, (param, index, _) in layout.items():
            if dtypes.get(name) == "F8_E4M3" and param in quantisable:
                out[name] = (param, index, "fp8")
                out[name + "_scale_inv"] = (param, index, "fp8_scale")
        return out
    if fmt == "mxfp4_packed":  # each expert's X.weight -> X.weight_packed, X.weight_scale
        for name, (param, index, _) in layout.items():
            if param in FORMAT_GROUPS["experts"]:
                del out[name]
                out[name + "_packed"] = (param, index, "mxfp4_packed")
                out[name + "_scale"] = (param, index, "mxfp4_scale")
        return out
    for name, (param, index, _) in layout.items():
        if param in ("we_gate", "we_up", "we_down", "we_gate+we_up"):
            del out[name]
        elif param == "router":  # "<layer>.mlp.gate.weight" or "<layer>.mlp.router.weight"
            experts = name.rsplit(".", 2)[0] + ".experts."
            for fused, target in (("gate_up_proj", "we_gate+we_up"), ("down_proj", "we_down")):
                out[f"{experts}{fused}_blocks"] = (target, index, "mxfp4_blocks")
                out[f"{experts}{fused}_scales"] = (target, index, "mxfp4_scales")
    return out


def quantised_shape(param: str, how: str, mk_shape) -> tuple[tuple[int, ...], tuple]:
    """(HF shape, allowed dtype tags) of a quantised tensor filling an mk slot."""
    *lead, I, O = mk_shape
    if how == "fp8":
        return (O, I), ("F8_E4M3",)
    if how == "fp8_scale":
        return (-(-O // 128), -(-I // 128)), ("F32", "BF16")
    O = 2 * O if param in INTERLEAVED else O
    if how == "mxfp4_blocks":
        return (*lead, O, I // 32, 16), ("U8",)
    if how == "mxfp4_packed":
        return (*lead, O, I // 2), ("U8",)
    return (*lead, O, I // 32), ("U8",)


def quantised_problems(layout: dict, shapes: dict) -> list[str]:
    """A parameter stored partly quantised and partly not, or with a shape its quantised
    layout cannot hold."""
    roles: dict[str, set] = {}
    for param, _, how in layout.values():
        roles.setdefault(param, set()).add(how if isinstance(how, str) else "plain")
    problems = []
    for param, kinds in roles.items():
        if "fp8" in kinds and "plain" in kinds:
            problems.append(f"mk {param}: some of its tensors are float8_e4m3fn and some are "
                            "not; a parameter is quantised wholly or not at all")
        if kinds & {"fp8", "mxfp4_blocks", "mxfp4_packed"}:
            scheme = "fp8" if "fp8" in kinds else "fp4"
            try:
                quant.check_shape(f"mk {param}", scheme, shapes[param][0])
            except ValueError as err:
                problems.append(str(err))
    return problems


def _gpt_oss_codes(blocks: np.ndarray) -> np.ndarray:
    """gpt-oss blocks [..., O, I/32, 16] -> e2m1 codes [..., I, O] (2k low, 2k + 1 high)."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1)  # [..., O, I/32, 16, 2]
    codes = codes.reshape(*blocks.shape[:-2], -1)  # [..., O, I]
    return np.swapaxes(codes, -1, -2)


def _raw_bytes(path: Path, name: str) -> np.ndarray:
    """A tensor's bytes as uint8 [..., shape] (safetensors' numpy reader has no float8)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(length))[name]
        start, end = info["data_offsets"]
        f.seek(8 + length + start)
        return np.frombuffer(f.read(end - start), np.uint8).reshape(info["shape"])


def _check_e8m0(folder, name: str, scales: np.ndarray) -> None:
    """Refuse e8m0 scales 0 (2^-127, not a normal float32) and 255 (NaN), as the release's
    loader does ("expected normal, finite E8M0 scales"), naming the tensor."""
    bad = (scales == 0) | (scales == 255)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{folder}: {shown(name)}: {int(bad.sum())} of {scales.size} e8m0 "
                         f"scales are 0 or 255, the first {int(scales[first])} at {first}; "
                         "expected normal, finite scales 1..254")


def assemble_quantised(folder, handles, where, layout, shapes
                        ) -> dict[str, quant.QuantWeight]:
    """The validated quantised tensors as `QuantWeight`s in mk.model.quant's layouts, of the
    slots' `shapes` (mk's: a lane-padded model's codes and scales fill each slot's
    leading corner, its padding zero codes under unit scales, `mk.model.quant.ZERO_CODE` and
    `UNIT_SCALE`)."""
    data, scales = {}, {}

    def slot(param, scheme):
        if param not in data:
            shape = shapes[param][0]
            lead, (I, O) = shape[:-2], shape[-2:]
            if scheme == "fp8":
                data[param] = np.full(shape, quant.ZERO_CODE["fp8"], np.uint8)
                scales[param] = np.full((*lead, I // 128, O // 128), quant.UNIT_SCALE["fp8"],
                                        np.float32)
            else:  # fp4 codes packed two a byte (`unpack.pack_codes`)
                data[param] = np.zeros((*lead, I // 2, O), np.uint8)
                scales[param] = np.full((*lead, I // 32, O), quant.UNIT_SCALE["fp4"], np.uint8)
        return data[param], scales[param]

    for name, (param, index, how) in layout.items():
        if not isinstance(how, str):
            continue
        tensor = (_raw_bytes(folder / where[name], name) if how == "fp8"
                  else handles[where[name]].get_tensor(name))
        if how == "mxfp4_packed":  # [O, I/2] -> gpt-oss's [O, I/32, 16] blocks, same order
            how, tensor = "mxfp4_blocks", tensor.reshape(*tensor.shape[:-1], -1, 16)
        if how == "mxfp4_scale":  # [O, I/32], as gpt-oss's
            how = "mxfp4_scales"
            _check_e8m0(folder, name, tensor)
        if how in ("fp8", "fp8_scale"):
            d, s = slot(param, "fp8")
            if how == "fp8":
                put_corner(d[index], tensor.T)
            else:
                put_corner(s[index], tensor.astype(np.float32).T)
            continue
        pairs = (dict(zip(INTERLEAVED[param], (slice(0, None, 2), slice(1, None, 2))))
                 if param in INTERLEAVED else {param: slice(None)})
        for target, rows in pairs.items():  # gpt-oss interleaves gate and up rows
            d, s = slot(target, "fp4")
            part = tensor[..., rows, :, :] if how == "mxfp4_blocks" else tensor[..., rows, :]
            if how == "mxfp4_blocks":  # codes padded with zero codes, then packed
                codes = np.full(d[index].shape[:-2] + (2 * d.shape[-2], d.shape[-1]),
                                quant.ZERO_CODE["fp4"], np.uint8)
                put_corner(codes, _gpt_oss_codes(part))
                d[index] = np.asarray(unpack.pack_codes("fp4", codes))
            else:
                put_corner(s[index], np.swapaxes(part, -1, -2))
    return {param: quant.QuantWeight(  # each put on the device once (`mk.init_params`)
        jax.device_put(data[param]), jax.device_put(scales[param]),
        "fp8" if scales[param].dtype == np.float32 else "fp4") for param in data}
