"""The configuration a design review looks at, built once from a notebook's parameters.

Notebook 11 (the review) and 11b (its appendix) take the same parameters: a run
(`mk.course.run.validate_run`), a tensor-parallel degree, the weights' storage formats and
block sizes. `configure` turns them into one `Reviewed`: the formats the byte model
charges and the ones the kernel streams packed, the block, the plan of the kernel, and
`step_plan(...)`, the step the simulator replays (every sequence at a full cache, the worst
case). Both notebooks read it, so the appendix reviews exactly the step the review does.
`simulator_error(chip)` says how far the simulator is from a chip's measured device loops,
with its assumed inputs and calibrated: the review's verdict states it.

Not here: the review's checks and sweeps (`mk.course.review`), the simulator (`mk.cost.sim`).
"""

from __future__ import annotations

import dataclasses

from mk.cost import calibration, sim
from mk.course.run import RunParams
from mk.measure.measure import TPU_NAMES, path_for
from mk.model.chips import ChipSpec, spec_of
from mk.model.config import ModelConfig, check_formats
from mk.kernels.common import BlockSizes
from mk.step.plan import DecodePlan, packed_formats


@dataclasses.dataclass(frozen=True)
class Reviewed:
    """One reviewed configuration: the model, the chip, the step's shape and the plan."""

    config: ModelConfig
    spec: ChipSpec
    tp: int
    batch: int
    rows: int
    context: int  # S, the KV cache's capacity
    formats: dict  # the byte model's storage per weight group
    packed: dict  # what the kernel streams packed
    block: BlockSizes
    plan: DecodePlan  # the kernel's plan

    @property
    def position(self) -> int:
        """Every sequence reads a full cache: the worst case."""
        return self.context - self.rows

    @property
    def step_args(self) -> dict:
        """The step's keywords for `mk.cost.perf` (`context` is the position)."""
        return dict(batch=self.batch, rows=self.rows, context=self.position, tp=self.tp,
                    formats=self.formats)

    def step_plan(self, **change) -> DecodePlan:
        """The step the simulator replays: every sequence at `position`, this review's
        tiles and formats on the chip (`change`: another block, or rows)."""
        return DecodePlan.make(self.config, chip=self.spec, **dict(
            tp=self.tp, batch=self.batch, rows=self.rows, position=self.position,
            block=self.block, formats=self.formats, kernel=False) | change)


def configure(run: RunParams, *, tp: int = 1, dense_format: str = "",
              expert_format: str = "", slots: int = 0, tile: int = 0, kv_tile: int = 0,
              kv_slots: int = 0) -> Reviewed:
    """The reviewed configuration of `run`: a format "" keeps the preset's and "none"
    streams the weights unquantised; a block size 0 keeps the plan's for the chip; a
    square `tile` serves every weight. A chip that is not a TPU is refused by name."""
    spec = spec_of(run.chip)
    if spec.kind != "tpu":
        raise ValueError(f"chip={run.chip!r} is a {spec.kind}: the review compiles and "
                         "simulates a TPU core")
    config = run.config
    formats = check_formats(config, dict(config.formats) | {
        g: None if f == "none" else f for g, f in (("dense", dense_format),
                                                   ("experts", expert_format)) if f})
    packed = packed_formats(config, formats)
    default = DecodePlan.make(config, tp=tp, batch=run.batch, rows=run.rows,
                              context=run.context, chip=spec, formats=packed).block
    block = dataclasses.replace(
        default, slots=slots or default.slots, kv_tile=kv_tile or default.kv_tile,
        kv_slots=kv_slots or default.kv_slots,
        **(dict(tile_rows=tile, tile_cols=tile, tiles=()) if tile else {}))
    plan = DecodePlan.make(config, tp=tp, batch=run.batch, rows=run.rows,
                           context=run.context, block=block, formats=packed)
    return Reviewed(config, spec, tp, run.batch, run.rows, run.context, formats, packed,
                    block, plan)


def measured_chips() -> list[str]:
    """The TPUs with a DMA probe and a steps record here (data/measured of a checkout)."""
    return [c for c in TPU_NAMES if path_for(c).exists() and calibration.steps_path(c).exists()]


def simulator_error(chip: str) -> dict | None:
    """How far `mk.cost.sim` is from `chip`'s measured device loops: {"loops": how many,
    "assumed": (least, most) error with the simulator's default inputs, "calibrated": the
    same with `mk.cost.calibration.assumptions(chip)`}, each error simulated / measured - 1;
    None where `chip` has no DMA probe or steps record here."""
    if chip not in measured_chips():
        return None
    out = {}
    for name, a in (("assumed", sim.Assumptions()), ("calibrated", None)):
        errors = [g.error for g in calibration.agreement(chip, a=a)
                  if g.series == calibration.LOOP]
        out[name] = (min(errors), max(errors))
    return out | {"loops": len(errors)}
