"""The parameters every notebook shares, validated in one place before anything is traced.

Here: `RunParams` and `validate_run` (the common parameters' values), `check_parameter`
(one value against its annotation in the parameters cell: str, int, float, bool or a list
of them) and `check_parameters` (called first thing after every notebook's parameters
cell: a name papermill injected that the cell does not annotate is an error listing the
valid names, and every annotated parameter is type-checked before any work).
tools/run_notebooks.py checks notebooks/runs.yaml's values with `check_parameter` too.
Not here: what a notebook does with them.
"""

from __future__ import annotations

import ast
import dataclasses
import math

import numpy as np

from mk.kernels.backend import BACKENDS
from mk.model.chips import CHIP_NAMES
from mk.model.config import ModelConfig, check_rows, positive_int
from mk.model.errors import shown
from mk.model.presets import preset as named_preset

SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
INJECTED = "# Parameters\n"  # the first line of the cell papermill injects


def annotation_text(annotation) -> str:
    """`int` -> "int", `list[int]` -> "list[int]"; text is returned as it is."""
    if isinstance(annotation, str):
        return annotation.replace(" ", "")
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def _fits(value, kind: str) -> bool:
    if kind.startswith("list[") and kind.endswith("]"):
        return isinstance(value, (list, tuple)) and all(_fits(v, kind[5:-1]) for v in value)
    if kind not in SCALARS:
        raise ValueError(f"parameter annotation {kind!r} is not supported; use one of "
                         f"{sorted(SCALARS)} or list[...] of one")
    return isinstance(value, SCALARS[kind]) and (kind == "bool" or not isinstance(value, bool)) \
        and (kind != "float" or math.isfinite(value))  # .nan, .inf: no setting of anything


def check_parameter(name: str, value, annotation) -> None:
    """Raise `ValueError` naming `name` unless `value` is of the annotated type ("int" takes
    no bool and no float, "float" takes an int but no nan or inf, "bool" only True or
    False: the string "False" is refused, as a date or bytes are everywhere)."""
    kind = annotation_text(annotation)
    if not _fits(value, kind):
        finite = " (finite)" if "float" in kind else ""
        raise ValueError(f"parameter {name}={shown(value)} ({type(value).__name__}) must be "
                         f"{kind}{finite}")


def check_parameters(namespace: dict) -> None:
    """Check the parameters cell's values in `namespace` (a notebook's `globals()`), right
    after that cell and papermill's injected one: every name papermill injected must be an
    annotated parameter (else `ValueError` listing the valid names), and each annotated
    parameter's value must have its annotated type."""
    annotations = namespace.get("__annotations__", {})
    injected = [cell for cell in namespace.get("In", []) if cell.startswith(INJECTED)]
    if injected:
        names = [t.id for node in ast.parse(injected[-1]).body
                 if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)]
        unknown = [n for n in names if n not in annotations]
        if unknown:
            raise ValueError(f"parameters {unknown} are not parameters of this notebook; "
                             f"its parameters are {list(annotations)}")
    for name, annotation in annotations.items():
        check_parameter(name, namespace[name], annotation)


@dataclasses.dataclass(frozen=True)
class RunParams:
    """A notebook's common parameters; `config` is the resolved model with
    `max_context == context`."""

    config: ModelConfig
    batch: int
    rows: int
    context: int
    chip: str
    backend: str
    seed: int
    checkpoint: str


def validate_run(*, preset: str = "tiny", batch: int = 1, rows: int = 1, context: int = 256,
                 chip: str = "v6e", backend: str = "auto", seed: int = 0,
                 checkpoint: str = "") -> RunParams:
    """Check the common notebook parameters; raise `ValueError` naming the bad one.

    `checkpoint` (a local Hugging Face folder) replaces the preset's config; `context`
    becomes the model's KV-cache capacity `max_context`.
    """
    check_rows(batch, rows)  # each >= 1, and batch * rows <= MAX_ROWS
    positive_int("context", context)
    if chip not in CHIP_NAMES:
        raise ValueError(f"chip={chip!r} is not known; choose one of {CHIP_NAMES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    config = ModelConfig.from_hf(checkpoint) if checkpoint else named_preset(preset)
    if context > config.max_position:
        raise ValueError(f"context={context} exceeds {config.name}'s max_position="
                         f"{config.max_position}")
    config = dataclasses.replace(config, max_context=context)
    return RunParams(config, int(batch), int(rows), int(context), chip, backend, int(seed),
                     checkpoint)
