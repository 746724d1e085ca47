"""What the compiled kernel costs per weight tile, read from libtpu's own bundle dump.

libtpu writes each compiled kernel's final VLIW program when asked (an internal flag);
a per-tile loop's bundles per trip / the chip's bundle rate (`mk.model.chips.ChipSpec.
bundle_rate`, measured on a chip: benchmarks/tpu_bundle_time.py) is the time one weight
tile keeps the TensorCore busy.

Here, the one reader of libtpu's dumps and the one way to make them: `read_bundles`,
`scopes`, `compile_with_dumps` (any compile, in a child process with the dump flags),
`dump_file`, `dump_megakernel`; on them `Loop`, `loops`, `tile_loops` (the ring's
per-tile loops), `per_tile`, `storage_name`, `measure(plan, ...)` -> `TileCost` (a
whole megakernel's per-tile loops, which the simulator may take instead of the tile cost
table; `priced`, a tile's issue columns of a row at today's rates; `packed_bundles` reads
a recorded row's packed ones back); and the whole kernel's
static schedule, `dump_schedule` -> `read_schedule` -> `Schedule` (notebook 08).

Not here: the small probes (`mk.cost.probes`), the compile itself (`mk.measure.tpu`), profiles of
running steps (`mk.measure.profiling`), a tile's DMA time (`mk.model.chips`, `mk.cost.sim`),
cycle-accurate timing. The dump's format and what a bundle count bounds:
docs/design/mk.cost.bundles.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from mk.model import quant
from mk.model.chips import ChipSpec, spec_of
from mk.model.config import ModelConfig
from mk.model.presets import preset
from mk.step.plan import DecodePlan
from mk.cost.machine import Assumptions
from mk.measure.tpu import CompileReport

GRANULE_BYTES = 32  # a DMA's size_in_granules unit (a 512 x 512 bf16 tile is 16384)
PHASE_FLAG = "--xla_enable_custom_call_region_trace=true"  # named scopes -> trace markers
# A bundle's line: its address, a marker of the dump's key (LB: a loop body starts, ...),
# one `>` per loop level, then `{` and the instructions, split by `;;`. A comment opened on
# the line may run on over the next lines (a DMA's bounds check quotes the DMA there).
_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:?\s*(>*)\s*\{(.*?)\}?\s*$")
_OP = re.compile(r"=\s*([a-z][a-z0-9_.]*)")  # an instruction's own op: its first `= name`
_GRANULES = re.compile(r"size_in_granules=\*/\s*(\d+)")
_WAITED = re.compile(r",\s*(\d+)\s*(?:/\*.*)?$")  # a dma.done.wait's last operand: granules
_MARK = re.compile(r"TraceMe(Start|End)\(([^)]*)\)")


@dataclasses.dataclass(frozen=True)
class Bundle:
    """One VLIW bundle of a `final_bundles.txt` dump (one issue cycle)."""

    mark: str  # the dump's marker ("LB" where a loop body starts, "PF", ...), else ""
    depth: int | None  # loop levels it is inside (`>` each); None for a bundle of no
    #                    instruction (`{}`, `{} /* End region 2 */`: the dump omits its `>`)
    ops: tuple[str, ...]  # each instruction's op, in the bundle's order
    granules: tuple[int, ...]  # the size of each DMA it issues
    text: str  # its line from `{` on (trace markers are comments there)
    waited: tuple[int, ...] = ()  # the size of each DMA it waits for (dma.done.wait)

    @property
    def dmas(self) -> int:
        """DMAs it issues (dma.hbm_to_vmem, dma.general, ...; not their waits)."""
        return sum(map(_issues_dma, self.ops))

    @property
    def waits(self) -> int:
        """DMA waits in it (dma.done.wait, vwait.*)."""
        return sum(o == "dma.done.wait" or o.startswith("vwait.") for o in self.ops)


def scopes(found: list[Bundle]) -> list[str | None]:
    """The innermost named scope holding each of `found` (a kernel's bundles in program
    order, compiled with `PHASE_FLAG`: a scope's trace markers open and close it), None
    for a bundle outside every scope. A bundle opening a scope is in it; one closing it
    is not."""
    out, open_ = [], []
    for bundle in found:
        for kind, scope in _MARK.findall(bundle.text):
            if kind == "Start":
                open_.append(scope)
            elif open_ and open_[-1] == scope:
                open_.pop()
        out.append(open_[-1] if open_ else None)
    return out


def drives_mxu(op: str) -> bool:
    """Whether an instruction pushes weights to, multiplies on or pops results from an MXU."""
    return op.startswith("vmat") or "mxu" in op or op.endswith(".mrb")


def _issues_dma(op: str) -> bool:
    return op.startswith("dma.") and not op.startswith("dma.done")


def read_bundles(text: str) -> list[Bundle]:
    """Every bundle of one kernel's `final_bundles.txt` text, in program order (the
    `schedule-analysis` file's "total scheduled bundles" counts the same ones)."""
    found = []
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if not m:
            continue
        mark, depth, body = m.groups()
        ops, granules, waited = [], [], []
        for instruction in body.split(";;"):
            op = _OP.search(instruction)  # a bounds check's comment quotes its DMA: not it
            if op:
                ops.append(op[1])
                size = _GRANULES.search(instruction)
                if size and _issues_dma(op[1]):
                    granules.append(int(size[1]))
                size = _WAITED.search(instruction.strip())
                if size and op[1] == "dma.done.wait":
                    waited.append(int(size[1]))
        found.append(Bundle(mark or "", len(depth) if ops else None, tuple(ops),
                            tuple(granules), body, tuple(waited)))
    return found


@dataclasses.dataclass(frozen=True)
class Loop:
    """One loop body of a bundle dump (its own level; nested loops are counted apart)."""

    first: int  # index of its first bundle in the dump
    depth: int  # 1 = outermost loop
    bundles: int  # bundles at this level: one trip's issue cycles, nested loops excluded
    mxu: int  # bundles that drive the MXU (push weights, multiply, pop results)
    scalar_only: int  # bundles with only scalar-unit work (address arithmetic, branches)
    dma_granules: tuple[int, ...]  # the size of each DMA the body issues
    waits: int  # DMA waits in the body
    wait_granules: tuple[int, ...]  # the size of each DMA it waits for
    eup: int  # bundles using the EUP (exp, rsqrt: softmax and norms, never a weight tile),
    #           not counting those printed out (the next phase's, under the loop's exit)
    nested: int  # loops inside it


def _printed_out(rows: list[Bundle], j: int, d: int, *, run: bool = True) -> bool:
    """Whether bundle j, printed a level out of a depth-d loop, is still the loop's: bundles
    of the loop follow it (`run`: past any others printed out; else next), not the next
    loop's start. TPU7x prints two such kinds of bundle: the branch back with its delay
    slots filled (the trip's last vst and DMA issue follow it at depth d), and code
    predicated on the loop's exit scheduled into the trip (a run of bundles, sometimes).
    Code after a loop runs at depth d again only in the next loop, which starts with its
    "LB" bundle."""
    after = next((r for r in rows[j + 1:]
                  if r.depth is not None and (r.depth >= d or not run)), None)
    return after is not None and after.depth >= d and not (after.mark == "LB"
                                                          and after.depth == d)


def loops(text: str) -> list[Loop]:
    """Every loop of one kernel's `final_bundles.txt` text, in program order."""
    rows = read_bundles(text)
    found = []
    for i, b in enumerate(rows):
        d = b.depth
        if b.mark != "LB" or not d:
            continue
        end, out = i + 1, set()  # one past the last bundle of the body; those printed out
        for j in range(i + 1, len(rows)):
            d_j = rows[j].depth
            if d_j is not None and d_j < d and _printed_out(rows, j, d):
                out.add(j)
            elif d_j is not None and (d_j < d or (rows[j].mark == "LB" and d_j == d)):
                break
            elif d_j is not None:
                end = j + 1
        body = rows[i:end]
        own = [r for k, r in enumerate(body, i) if k in out or r.depth is None
               or (r.depth == d and not _printed_out(rows, k, d + 1, run=False))]  # nested
        found.append(Loop(
            first=i, depth=d, bundles=len(own),
            mxu=sum(any(map(drives_mxu, r.ops)) for r in own),
            scalar_only=sum(bool(r.ops) and not any(o.startswith(("v", "dma")) for o in r.ops)
                            for r in own),
            dma_granules=tuple(g for r in own for g in r.granules),
            waits=sum(r.waits for r in own),
            wait_granules=tuple(g for r in own for g in r.waited),
            eup=sum(any("eup" in o for o in r.ops) for r in own if r.depth == d),
            nested=sum(r.mark == "LB" and r.depth == d + 1 for r in body)))
    return found


def tile_loops(found: list[Loop], *tiles: tuple[int, ...]) -> list[Loop]:
    """The ring's per-tile loops among `found`: they wait for the DMAs of one of `tiles` (each
    the bytes of the DMAs that bring one tile in, `tile_parts`: a plain tile one, a
    packed tile its data and its scale block), issue DMAs (the tile slots ahead, which
    may be of another storage; none where those are all of a kind the layer skips),
    drive the MXU, and never the EUP (attention's softmax). The DMAs of one slot share a
    semaphore, so a packed tile's two are waited for at once: a loop waiting for as many
    granules as a plain tile's one part brings it; one waiting for more than a packed
    tile's data part, but less than twice it, brings that (a scale block's DMA moves its
    HBM layout's padded tiles, not its bytes, and is always smaller than its data). A
    size that distinctive lets a loop bringing packed tiles run the EUP: a trip of an
    expert slot whose matrices are one tile each (Kimi K3's FP4 experts on a TP32 shard)
    brings gate, up and down and runs the activation between them (`per_tile` divides
    its trip among them)."""
    def brings(lp: Loop, parts) -> bool:
        data, waited = max(parts) // GRANULE_BYTES, max(lp.wait_granules)
        return waited == data if len(parts) == 1 else data < waited < 2 * data

    return [lp for lp in found if lp.wait_granules and lp.mxu
            and not lp.nested and any(brings(lp, p) and (len(p) > 1 or not lp.eup)
                                      for p in tiles)]


def per_tile(lp: Loop) -> int:
    """Bundles one tile of a per-tile loop costs: its trip's bundles over the tiles a trip
    waits for (the waits of its largest size: one, but for a trip through an expert slot
    of one-tile matrices, `tile_loops`), rounded up."""
    return -(-lp.bundles // lp.wait_granules.count(max(lp.wait_granules)))


def tile_parts(scheme: str | None, tile_rows: int, tile_cols: int, itemsize: int = 2
               ) -> tuple[int, ...]:
    """The bytes of each DMA `Ring` issues for one tile: a plain tile of `itemsize` bytes
    an element, or a packed one's data and scale block (`mk.model.quant.tile_shapes`)."""
    if scheme is None:
        return (tile_rows * tile_cols * itemsize,)
    return tuple(math.prod(shape) * np.dtype(dtype).itemsize
                 for shape, dtype in quant.tile_shapes(scheme, tile_rows, tile_cols).values())


def storage_name(stream, scheme: str | None, tile: tuple[int, int]) -> str:
    """A storage's name in a `TileCost` row: "plain" or the scheme, and the tile's shape
    when it is not the stream's block's ("plain 2048x768")."""
    own = (stream.block.tile_rows, stream.block.tile_cols)
    return (scheme or "plain") + ("" if tile == own else f" {tile[0]}x{tile[1]}")


@dataclasses.dataclass(frozen=True)
class TileCost:
    """The per-tile loops of one compiled megakernel and what they cost on its chip.

    `Ring.matmul` runs a steady loop per matrix, which issues the matrix's own next tile,
    and edge loops over its last `slots` tiles (one per run of tiles the same segments can
    follow), which look up which of those holds the next tile. A stream moves tiles of
    one or more storages (plain tiles in the config's dtype, each packed scheme's data
    and scales, and either in a tile shape of their own: `tiles`, named by
    `storage_name`); a loop belongs to the storage whose DMAs it waits for (`tile_loops`'
    rule), and the costliest loop of a storage bounds its every tile. `worst`,
    `issue_s`, `dma_s` and `assumptions` are the plain tiles' (a stream of packed tiles
    only: its first storage's); `by_storage` has each.
    """

    report: CompileReport  # the compile's (the dump costs it a little time)
    tiles: tuple[tuple[str, tuple[int, ...]], ...]  # (storage, `tile_parts`) per storage
    loops: tuple[Loop, ...]  # the per-tile loops, in program order; () if not compiled
    spec: ChipSpec  # the chip: its bundle rate turns bundles into seconds
    m: int  # the rows the kernel's matmuls take (the plan's M: which bundle rate)
    # (storage, scheme or None, (tile_rows, tile_cols)) per storage, as `tiles`
    shapes: tuple[tuple[str, str | None, tuple[int, int]], ...] = ()

    def storages_of(self, lp: Loop) -> list[str]:
        """The storages ("plain" or an mk.model.quant scheme, and a shape of their own) whose
        tiles loop `lp` brings in: one, or packed tiles of several shapes moving the same
        bytes (Kimi K3's experts: gate and up [7168, 128], down [128, 7168])."""
        found = [storage for storage, parts in self.tiles if tile_loops([lp], parts)]
        if not found:
            raise ValueError(f"a loop waiting for DMAs of {lp.wait_granules} granules "
                             f"brings no tile of {dict(self.tiles)}")
        return found

    def by_storage(self) -> dict[str, tuple[Loop, int]]:
        """{storage: (its costliest per-tile loop by `per_tile`, the bytes one of its
        tiles moves)}, for the storages whose loops the dump shows."""
        if not self.loops:
            raise ValueError(f"{self.report.name} on {self.report.chip} did not compile: "
                             f"{self.report.error.splitlines()[0] if self.report.error else ''}")
        out = {}
        for lp in self.loops:
            for storage in self.storages_of(lp):
                if storage not in out or per_tile(lp) > per_tile(out[storage][0]):
                    out[storage] = (lp, sum(dict(self.tiles)[storage]))
        return out

    @property
    def _first(self) -> str:
        found = self.by_storage()
        return "plain" if "plain" in found else next(iter(found))

    @property
    def worst(self) -> Loop:
        """The costliest per-tile loop of the plain tiles (module docstring)."""
        return self.by_storage()[self._first][0]

    @property
    def tile_bytes(self) -> int:
        """The bytes one plain tile moves."""
        return self.by_storage()[self._first][1]

    def issue_s(self, end: str = "slow") -> float:
        """Seconds one tile keeps the TensorCore issuing (the costliest loop): bundles /
        the bundle rate at `end` of the chip's range ("slow": the longer time)."""
        return per_tile(self.worst) / self.spec.bundle_rate(end, self.m)

    @property
    def dma_bw(self) -> float:
        """One core's HBM bandwidth, bytes/s."""
        return self.spec.device_hbm_bw

    @property
    def dma_s(self) -> float:
        """Seconds one tile's DMA takes at the core's HBM bandwidth (latency not counted)."""
        return self.tile_bytes / self.dma_bw

    def assumptions(self, **kw) -> Assumptions:
        """`mk.cost.sim.Assumptions` with the plain tiles' per-tile cost in bundles and each
        packed storage's whose loop the dump shows (`packed_bundles`; the others keep the
        tile cost table's: `mk.cost.sim.tile_seconds`), and any other field in kw, e.g. the
        bundle rate's end (`rate_end`)."""
        return Assumptions(tile_bundles=per_tile(self.worst),
                           packed_bundles=packed_bundles(self.row()), **kw)

    def row(self) -> dict:
        """One row of a table: bundles per trip (the range over the plain tiles' loops;
        the costliest one's MXU and scalar-only bundles and DMA sites), the bundle rate's
        ends it was priced at (bundle_rate_slow, bundle_rate_fast), issue against DMA time
        per tile at the slow end (tile_ns, tile_over_dma) and at the fast end (tile_fast_ns,
        tile_over_dma_fast); with packed tiles, "packed": the same per scheme (bundles,
        tile_KiB, dma_ns, tile_over_dma, tile_over_dma_fast)."""
        worst = self.worst
        own = [lp for lp in self.loops if self._first in self.storages_of(lp)]
        out = dict(kernel=self.report.name, chip=self.report.chip,
                   tile_KiB=self.tile_bytes / 1024,
                   tile_loops=len(self.loops),
                   bundles_per_tile=f"{min(map(per_tile, own))}-{per_tile(worst)}",
                   mxu_bundles=worst.mxu, scalar_only_bundles=worst.scalar_only,
                   dma_sites=len(worst.dma_granules), dma_ns=self.dma_s * 1e9,
                   **priced(per_tile(worst), self.dma_s, self.spec, self.m),
                   compile_s=self.report.compile_seconds)
        shapes = {storage: (scheme, tile) for storage, scheme, tile in self.shapes}
        packed = {storage: dict(
            bundles=per_tile(lp), tile_KiB=nbytes / 1024, dma_ns=nbytes / self.dma_bw * 1e9,
            **{k: v for k, v in priced(per_tile(lp), nbytes / self.dma_bw, self.spec,
                                       self.m).items() if k.startswith("tile_over_dma")},
            **(dict(scheme=shapes[storage][0], tile=list(shapes[storage][1]))
               if storage in shapes else {}))
            for storage, (lp, nbytes) in self.by_storage().items() if storage != self._first}
        return out | (dict(packed=packed) if packed else {})


def priced(bundles: int, dma_s: float, spec: ChipSpec, m: int) -> dict:
    """A tile's columns of a `TileCost.row` at today's bundle rates for M = m
    (`ChipSpec.bundle_rate`): the rates (bundle_rate_slow, bundle_rate_fast), its issue
    time at each end (tile_ns, tile_fast_ns) and that over its DMA's `dma_s`
    (tile_over_dma, tile_over_dma_fast)."""
    slow, fast = (bundles / spec.bundle_rate(end, m) for end in ("slow", "fast"))
    return dict(bundle_rate_slow=spec.bundle_rate("slow", m),
                bundle_rate_fast=spec.bundle_rate("fast", m), tile_ns=slow * 1e9,
                tile_fast_ns=fast * 1e9, tile_over_dma=slow / dma_s,
                tile_over_dma_fast=fast / dma_s)


def packed_bundles(row: dict) -> tuple[tuple[str, int, int, int], ...]:
    """`mk.cost.sim.Assumptions.packed_bundles` of a recorded row (`TileCost.row`, a row of
    benchmarks/tile_costs.py): each packed storage's per-tile bundles with its scheme and
    tile, for the rows that name them (older rows: none)."""
    return tuple((p["scheme"], *p["tile"], p["bundles"])
                 for p in row.get("packed", {}).values() if p.get("scheme"))


# -- The dump: a compile in a child process, its files -----------------------------------
def compile_with_dumps(code: str, args, out: str | os.PathLike, *, phases: bool = True,
                       flags: tuple[str, ...] = (), timeout: float = 600.0) -> Path:
    """Run Python `code` (a TPU compile, e.g. through `mk.measure.tpu`; it sees `args` as
    sys.argv[1:]) in a child process whose libtpu dumps its schedules into `out`/jf (and
    Mosaic's passes into `out`/mosaic), its flags appended to any LIBTPU_INIT_ARGS already
    set; with `phases`, also `PHASE_FLAG`, so named scopes inside kernels become trace
    markers (it changes the code: `measure` leaves it off); `flags`: more libtpu flags
    (`probe_tile`'s `KEEP_IN_HBM`). Returns `out`/jf. Raises
    RuntimeError with the tail of the child's stderr if it fails or outlives `timeout`
    seconds.

    A child process because libtpu reads LIBTPU_INIT_ARGS once, at its first use. It
    compiles only (JAX_PLATFORMS=cpu: on a TPU VM the parent holds the chip)."""
    out = Path(out)
    for sub in ("jf", "mosaic"):  # a fresh dump, not mixed with an earlier one
        shutil.rmtree(out / sub, ignore_errors=True)
    flags = [os.environ.get("LIBTPU_INIT_ARGS", ""), f"--xla_jf_dump_to={out / 'jf'}",
             f"--xla_mosaic_dump_to={out / 'mosaic'}", PHASE_FLAG if phases else "",
             *flags]
    env = dict(os.environ, LIBTPU_INIT_ARGS=" ".join(f for f in flags if f),
               JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1")
    try:
        done = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as late:
        raise RuntimeError(f"the dumping compile outlived timeout={timeout} s:\n"
                           f"{_tail(late.stderr)}") from None
    if done.returncode:
        raise RuntimeError(f"the dumping compile failed (exit {done.returncode}):\n"
                           f"{_tail(done.stderr)}")
    return out / "jf"


def _tail(stderr: str | bytes | None, chars: int = 2000) -> str:
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    return text[-chars:]


def dump_file(jf_dump: str | os.PathLike, kernel: str, suffix: str) -> Path:
    """The dump `suffix` ("final_bundles.txt", "schedule-analysis_final_bundles.txt",
    "final_hlo-static-per-bundle-utilization.txt") of the program whose name starts with
    `kernel`, the largest if several (the kernel itself, not a small program named after
    it)."""
    found = list(Path(jf_dump).glob(f"*-{kernel}*-{suffix}"))
    if not found:
        raise ValueError(f"no '{kernel}*-{suffix}' in {jf_dump}: was it dumped with "
                         "--xla_jf_dump_to (internal to libtpu, it may have changed)?")
    return max(sorted(found), key=lambda p: p.stat().st_size)


_COMPILE_MEGAKERNEL = """import pickle, sys
from mk.measure import tpu
with open(sys.argv[1], "rb") as f:
    plan, topology, out = pickle.load(f)
report = tpu.compile_megakernel(plan, topology=topology)
with open(out, "wb") as f:
    pickle.dump(report, f)
"""


def dump_megakernel(plan: DecodePlan, out: str | os.PathLike, *, phases: bool,
                    timeout: float = 600.0, topology: str | None = None
                    ) -> tuple[CompileReport, Path]:
    """`mk.measure.tpu.compile_megakernel(plan, topology=)` with the dumps on
    (`compile_with_dumps` into `out`) -> (its report, the dump folder)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    job, result = out / "job.pkl", out / "report.pkl"
    with open(job, "wb") as f:
        pickle.dump((plan, topology, str(result)), f)
    jf = compile_with_dumps(_COMPILE_MEGAKERNEL, [job], out, phases=phases, timeout=timeout)
    with open(result, "rb") as f:
        return pickle.load(f), jf


def measure(plan: DecodePlan, *, topology: str | None = None,
            timeout: float = 600.0) -> TileCost:
    """Compile `plan`'s megakernel for the chip it was made for
    (`mk.measure.tpu.compile_megakernel`) in a child process with libtpu's bundle dump on
    (`dump_megakernel`); return its report and per-tile loops (none if it did not compile:
    `TileCost.report` says why). Raises RuntimeError if the child fails or a compiled
    kernel shows no per-tile loop."""
    spec = spec_of(plan.chip) if plan.chip is not None else None
    if spec is None or spec.kind != "tpu":
        raise ValueError(f"plan.chip={plan.chip!r}: no TPU compile to measure (make the "
                         "plan for a TPU: `DecodePlan.make(chip=)`)")
    itemsize = jnp.dtype(plan.config.dtype).itemsize
    tiles = tuple((storage_name(plan.stream, q, tile), tile_parts(q, *tile, itemsize))
                  for q, tile in plan.stream.storages)
    shapes = tuple((storage_name(plan.stream, q, tile), q, tuple(tile))
                   for q, tile in plan.stream.storages)
    found = ()
    with tempfile.TemporaryDirectory(prefix="mk-bundles-") as folder:
        report, jf = dump_megakernel(plan, folder, phases=False, timeout=timeout,
                                     topology=topology)
        if report.ok:
            text = dump_file(jf, "mk_megakernel", "final_bundles.txt").read_text()
            found = tuple(tile_loops(loops(text), *dict(tiles).values()))
            if not found:
                raise RuntimeError(f"{report.name}: no per-tile loop of tiles {tiles} B "
                                   "found in the bundle dump")
    return TileCost(report, tiles, found, spec, plan.M, shapes)


# -- The whole kernel's static schedule -------------------------------------------------
def dump_schedule(config: str | ModelConfig, chip: str, out: str | os.PathLike, *,
                  batch: int = 1, rows: int = 1, context: int = 256,
                  phases: bool = True) -> Path:
    """The megakernel of `config` (a preset's name or a config) compiled for `chip` with
    the schedule dumps on (`dump_megakernel`); read them with `read_schedule`. Raises
    RuntimeError if it does not compile."""
    config = preset(config) if isinstance(config, str) else config
    plan = DecodePlan.make(config, chip=chip, batch=batch, rows=rows, context=context)
    report, jf = dump_megakernel(plan, out, phases=phases)
    if not report.ok:
        raise RuntimeError(f"the dumping compile failed: {report.summary()}")
    return jf


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The compiler's static schedule of one kernel (bundle counts: not cycles; loops
    count once, DMA latency is unknown)."""

    kernel: str
    bundles: int  # total scheduled VLIW bundles
    empty: int  # bundles with nothing issued
    utilisation: dict  # unit -> mean share of its issue slots used over all bundles
    dmas: int  # DMA issues (dma.hbm_to_vmem, dma.vmem_to_hbm, ...)
    waits: int  # DMA waits (dma.done.wait, vwait.*)
    in_loops: int  # bundles inside a loop (listed once, run once per trip)
    phases: dict  # named scope -> bundles between its trace markers (PHASE_FLAG)


def read_schedule(jf_dump: str | os.PathLike, kernel: str = "mk_megakernel") -> Schedule:
    """Summarise the dumps of the program named `kernel` (`dump_file`): total bundles,
    per-unit utilisation, DMA and wait counts, and bundles per named scope (the innermost
    scope a bundle is in, when the trace markers are present)."""
    analysis = dump_file(jf_dump, kernel, "schedule-analysis_final_bundles.txt").read_text()
    count = {k: int(re.search(rf"{k} scheduled bundles:\s+(\d+)", analysis)[1])
             for k in ("total", "empty")}
    util_text = dump_file(jf_dump, kernel, "final_hlo-static-per-bundle-utilization.txt"
                          ).read_text().splitlines()
    units = [u.strip() for u in util_text[1].split(",")]
    capacity = [int(c) for c in util_text[2].split()]
    rows = [[int(v) for v in line.split()] for line in util_text[4:] if line.strip()]
    utilisation = {u: round(sum(r[i] for r in rows) / (capacity[i] * len(rows)), 4)
                   for i, u in enumerate(units)} if rows else {}
    phases: dict = defaultdict(int)
    found = read_bundles(dump_file(jf_dump, kernel, "final_bundles.txt").read_text())
    for scope in scopes(found):
        if scope is not None:
            phases[scope] += 1
    return Schedule(kernel, count["total"], count["empty"], utilisation,
                    sum(b.dmas for b in found), sum(b.waits for b in found),
                    sum(bool(b.depth) for b in found), dict(phases))
