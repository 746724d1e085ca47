"""Run whole models that fill one TPU, each judged against the CPU reference (issue 60).

For each row of `ROWS` (a preset, its weight formats, B and the cache's capacity): random
weights in the model's real shapes and formats, made on the host (`mk.init_params` with
formats: drawn as codes; gpt-oss's routes pinned, `_params`: random routers are
chaotic); the reference's greedy run on the host's CPU (`mk.measure.exactness.expect`,
the quantised params dequantised a layer at a time), in a CPU-only child process whose
host memory goes back before the chip runs; the megakernel's `steps` greedy tokens on the
chip (`mk.step.megakernel.generate`, device loops of 8) judged against it
(`mk.measure.exactness.judge`); the chip's peak memory
(`memory_stats()["peak_bytes_in_use"]`) beside what the plan counts for the whole
generate (`DecodePlan.fits(prompt=)`); and the generate's wall time, compiles included
(not a step's time: benchmarks/tpu_steps.py times steps). Each row runs in a process of
its own, so a peak is that row's alone and an out-of-memory ends only its row (kept with
its error); the record data/measured/<chip>-models.json (or $MK_MEASURED) is rewritten
after every row, keeping the rows of earlier commits this run did not measure again
(same chip and versions).

    MK_TPU=1 MK_COMMIT=<sha> python benchmarks/tpu_models.py [--rows 0 2] [--steps 8]

A row whose CPU reference and chip run do not fit one call (gpt-oss-20b's reference takes
minutes) splits in two: `--expect-only --expected DIR` saves each row's reference run
(`Expected`, its seconds) as DIR/<row>.npz and measures nothing; a later `--expected DIR`
judges against those files instead of running the reference again.

On a CPU it refuses (nothing here would be a TPU's); --interpret runs `INTERPRET_ROWS`
(tiny models, interpret mode) into the record --json names, never under data/measured.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `mk` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import mk  # noqa: E402
from mk.measure import exactness, measure  # noqa: E402
from mk.step import megakernel  # noqa: E402
from mk.model import checkpoint, quant, untrusted  # noqa: E402
from mk.model.chips import chip_of  # noqa: E402
from mk.step.plan import DecodePlan  # noqa: E402

# (preset, {format group: scheme}, B, context): the models that fill a v5e
ROWS = (
    ("qwen3-4b", {}, 1, 1024),
    ("qwen3-8b", dict(dense="int8", lm_head="int8"), 1, 1024),
    ("gpt-oss-20b", dict(experts="fp4"), 1, 1024),
    ("qwen3-30b-a3b", dict(dense="int4", experts="int4", lm_head="int4"), 1, 1024),
)
INTERPRET_ROWS = (("tiny", dict(dense="int8"), 2, 64),
                  ("tiny-gpt-oss", dict(experts="fp4"), 1, 64))
PROMPT = 8  # prompt tokens per sequence
PROVENANCE = ("commit", "when")  # a row's own: rows of earlier commits are kept
GIB = 2**30


def _reference(preset: str, formats: dict, batch: int, context: int, steps: int):
    """The reference's greedy run of a row (`mk.measure.exactness.expect`) and its seconds, in the
    process that runs it: a CPU-only child of `run_row` (`exactness.cpu_only`)."""
    config = mk.preset(preset)
    params = _params(config, formats)
    start = time.perf_counter()
    expected = exactness.expect(config, params, _prompt(config, batch), steps,
                                max_context=context)
    return expected, round(time.perf_counter() - start, 1)


def _params(config, formats: dict) -> dict:
    """A row's random weights (`mk.init_params`, seed 0), a biased router's routes pinned
    (`mk.model.checkpoint.pin_routes`): random routers are chaotic, so without that the
    chip's tokens could not be judged against the CPU's."""
    params = mk.init_params(config, 0, formats)
    return checkpoint.pin_routes(config, params) if checkpoint.pinnable(config) else params


def _row(preset: str, formats: dict, batch: int, context: int, steps: int) -> dict:
    """A row's fields before it runs: routes "pinned" where `_params` pins them."""
    return dict(model=preset, formats=formats, batch=batch, context=context, steps=steps,
                routes="pinned" if checkpoint.pinnable(mk.preset(preset)) else "drawn")


def _prompt(config, batch: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, config.vocab, (batch, PROMPT))


def _in_cpu_child(fn, *args):
    """fn(*args) in a fresh CPU-only process: what it allocates on the host goes back when
    it ends (the reference's prefill holds several times a model's bytes there)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=exactness.cpu_only) as pool:
        return pool.submit(fn, *args).result()


def run_row(preset: str, formats: dict, batch: int, context: int, steps: int,
            backend: str, expected_dir: Path | None = None,
            expect_only: bool = False) -> dict:
    """One row, in this process: the judged tokens, the chip's peak memory in GiB beside
    the plan's count in GiB, the wall time of the generate. The reference runs first, in a
    CPU-only child process, so this one holds only its params and the generate; tokens
    that are not the reference's own are judged in another child, after this process
    has let its params go. With `expected_dir`, the reference's run is read from its file
    there if one was saved (`expected_file`), else run and saved; `expect_only` stops
    after that."""
    row = _row(preset, formats, batch, context, steps)
    config = mk.preset(preset)
    path = expected_dir and expected_file(expected_dir, row)
    if path and path.exists():
        expected, row["reference_s"] = load_expected(path, batch, steps, config.vocab)
    else:
        expected, row["reference_s"] = _in_cpu_child(_reference, preset, formats, batch,
                                                     context, steps)
        if path:
            save_expected(path, expected, row["reference_s"])
    if expect_only:
        return row | dict(expected=path.name)
    params = _params(config, formats)
    prompt = _prompt(config, batch)
    device = jax.devices()[0]
    if device.platform == "tpu":
        plan = DecodePlan.make(config, batch=batch, context=context,
                               formats=quant.formats_of(params))
        fit = plan.fits(chip_of(device.device_kind), prompt=PROMPT, donate=True)
        row |= dict(planned_gib=round(fit.hbm_bytes / GIB, 2),
                    limit_gib=round(fit.hbm_limit_bytes / GIB, 2))
    start = time.perf_counter()
    tokens = np.asarray(megakernel.generate(config, params, prompt, steps, backend=backend,
                                            max_context=context, steps_per_call=8,
                                            donate=True))  # the chip holds one copy
    row["generate_s"] = round(time.perf_counter() - start, 1)
    if device.platform == "tpu":
        row["peak_gib"] = round(device.memory_stats()["peak_bytes_in_use"] / GIB, 2)
    if np.array_equal(tokens, expected.tokens):  # its logits are the reference's own
        verdict = exactness.judge_logits(expected.logits, tokens)
    else:
        del params
        verdict = _in_cpu_child(_judge, preset, formats, batch, tokens)
    return row | verdict.to_dict()


def expected_file(folder: Path, row: dict) -> Path:
    """Where a row's saved reference run lives in `folder`: a name from its preset,
    formats, batch, context, steps and pinned routes."""
    formats = "-".join(f"{g}={s}" for g, s in sorted(row["formats"].items())) or "plain"
    pinned = "-pinned" if row["routes"] == "pinned" else ""
    return Path(folder) / (f"{row['model']}-{formats}-b{row['batch']}-c{row['context']}"
                           f"-s{row['steps']}{pinned}.npz")


def save_expected(path: Path, expected: exactness.Expected, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=expected.tokens, logits=expected.logits, seconds=seconds)


def load_expected(path: Path, batch: int, steps: int, vocab: int):
    """(`Expected`, its reference seconds) from a file `save_expected` wrote; ValueError
    naming the file where it is not that (arrays of the row's shapes, no pickles)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens, logits = data["tokens"], data["logits"]
            seconds = float(data["seconds"])
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"{path}: not a saved reference run ({err})") from None
    want = dict(tokens=(batch, steps), logits=(batch, steps, vocab))
    got = dict(tokens=tokens.shape, logits=logits.shape)
    if got != want or tokens.dtype.kind not in "iu" or logits.dtype.kind != "f":
        raise ValueError(f"{path}: holds tokens {tokens.dtype}{list(tokens.shape)} and "
                         f"logits {logits.dtype}{list(logits.shape)}; this row needs "
                         f"integer tokens {list(want['tokens'])} and float logits "
                         f"{list(want['logits'])}")
    return exactness.Expected(tokens, logits), seconds


def _judge(preset: str, formats: dict, batch: int, tokens) -> exactness.Verdict:
    """`mk.measure.exactness.judge` of a row's tokens (the reference teacher-forced on them)."""
    config = mk.preset(preset)
    params = _params(config, formats)
    return exactness.judge(config, params, _prompt(config, batch), tokens)


def _child(index: int, table, steps: int, timeout: float, passed: tuple = ()) -> dict:
    """Row `index` of `table` run by this script in a fresh process (its own peak), with
    the arguments `passed` (the saved reference runs' options)."""
    row = _row(*table[index], steps)
    argv = [sys.executable, __file__, "--one", str(index), "--steps", str(steps), *passed]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return row | dict(error=f"no result within {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return row | dict(error=f"exit {done.returncode}: {failure(done.stderr)}")
    return json.loads(lines[-1])


def failure(stderr: str, frames: int = 3) -> str:
    """A failed row's traceback, short enough for its record: this checkout's last
    `frames` frames (where in mk or benchmarks it was; an out-of-memory's own tail names
    only jax's dispatch) and the error's last 400 characters."""
    here = str(Path(__file__).resolve().parent.parent)
    lines = stderr.strip().splitlines()
    ours = [line.strip() for line in lines
            if line.strip().startswith('File "') and here in line and "/.venv/" not in line]
    return " <- ".join(reversed(ours[-frames:])) + (" | " if ours else "") + \
        "\n".join(lines)[-400:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, help="indices into ROWS (default: all)")
    p.add_argument("--steps", type=int, default=8, help="greedy tokens per sequence")
    p.add_argument("--timeout", type=float, default=540, help="seconds a row may take")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: the tiny rows in interpret mode (not a TPU's)")
    p.add_argument("--json", type=Path, help="where the record goes")
    p.add_argument("--expected", type=Path,
                   help="a folder of saved reference runs: read where there, else saved")
    p.add_argument("--expect-only", action="store_true",
                   help="save the rows' reference runs in --expected; measure nothing")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a row's own process
    args = p.parse_args(argv)
    table = INTERPRET_ROWS if args.interpret else ROWS
    backend = "interpret" if args.interpret else "hardware"
    if args.expect_only and args.expected is None:
        p.error("--expect-only needs --expected, the folder the reference runs go to")
    passed = ((("--expected", str(args.expected)) if args.expected else ())
              + (("--expect-only",) if args.expect_only else ())
              + (("--interpret",) if args.interpret else ()))
    if args.one is not None:
        print(json.dumps(run_row(*table[args.one], args.steps, backend, args.expected,
                                 args.expect_only)), flush=True)
        return
    if args.expect_only:  # the CPU's work only: no chip, no record
        for i in args.rows if args.rows else range(len(table)):
            print(json.dumps(_child(i, table, args.steps, args.timeout, passed)),
                  flush=True)
        return
    try:  # this process never opens the chip
        made = measure.labelled(measure.provenance_apart(), interpret=args.interpret,
                                json_path=args.json)
    except ValueError as err:
        p.error(str(err))
    path = args.json or measure.MEASURED / f"{made['chip']}-models.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = {_key(r): r for r in _earlier_rows(path, made)}
    for i in args.rows if args.rows else range(len(table)):
        row = _child(i, table, args.steps, args.timeout, passed)
        row |= {f: made[f] for f in PROVENANCE}
        rows[_key(row)] = row
        print(json.dumps(row), flush=True)
        path.write_text(json.dumps(made | dict(rows=list(rows.values())), indent=1) + "\n",
                        encoding="utf-8")
    print(f"wrote {path}")


def _key(row: dict) -> tuple:
    return (row["model"], json.dumps(row["formats"], sort_keys=True), row["batch"],
            row["context"])


def _earlier_rows(path: Path, made: dict) -> list[dict]:
    """The rows of a record at `path` from the same chip and versions (any commit)."""
    if not path.exists():
        return []
    earlier = untrusted.load_json(path, "a models record")
    if not isinstance(earlier, dict) or not isinstance(earlier.get("rows"), list) or not all(
            isinstance(r, dict) and {"model", "formats", "batch", "context"} <= r.keys()
            for r in earlier["rows"]):
        raise ValueError(f"{path}: must be an object with a list 'rows' of objects with "
                         "model, formats, batch and context")
    if not all(earlier.get(f) == made[f] for f in ("chip", "jax", "libtpu")):
        return []
    return earlier["rows"]


if __name__ == "__main__":
    main()
