"""The parameters every notebook shares, validated in one place before anything is traced.

Here: `RunParams` and `validate_run`. Not here: what a notebook does with them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mk.backend import BACKENDS
from mk.chips import CHIP_NAMES
from mk.config import ModelConfig, check_rows, positive_int, preset as named_preset



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
