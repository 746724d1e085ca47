"""Greedy tokens of a decode path judged against the reference, near-ties told apart.

Here: `judge` (the reference replayed teacher-forced on the path's own tokens; each token
exact, a near-tie within `TIE_RTOL` of the reference's best logit, or wrong), `ROUTER_TIE`
(the same bound for an MoE router's expert choice), `expect` and `cpu_only`; the hardware
record: `FAMILY_PRESETS`, `AWAITING_CHIP`, `record_path`, `load_record` and `verified`
(per family: the chip, commit and date of its newest hardware case, and whether kernel code
changed since), written by the hardware tier tests/test_tpu.py (`make test-tpu`); and
`default_precision_f32_dots` (the float32 matmuls a chip would round that interpret mode
does not). Not here: the finer tool inside a tie (`mk.step.megakernel.first_divergence`), the
reference itself (`mk.model.reference`). Why counting equal tokens misjudges a kernel, and how
large a rounding is: docs/design/mk.measure.exactness.md.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mk.model import reference, untrusted
from mk.measure.bounds import kernel_jaxprs
from mk.model.config import ModelConfig, finite_number
from mk.kernels.jax_private import core, source_info_util
from mk.measure.measure import MEASURED, TPU_NAMES

TIE_RTOL = 1e-2  # a near-tie: within 1 % of the largest |logit| (first_divergence's rtol)
# A kernel's MoE router sees its own h = RMSNorm(x after attention), which rounds differently
# from the reference's in some elements, so the logit gap between two experts moves by up
# to 0.014 in bf16 (measured on tiny-moe across batch, rows and positions; in float32 only
# the summation order differs). A token whose k-th and (k+1)-th router logits are closer
# than this may take either expert, and its x then differs by O(1): greedy tokens of MoE
# models are compared in float32 (tests/test_megakernel.py, tests/test_tpu.py).
ROUTER_TIE = {"float32": 1e-4, "bfloat16": 5e-2}
FAMILY_PRESETS = {"qwen3": "tiny", "qwen3_moe": "tiny-moe", "qwen3_5_text": "tiny-hybrid",
                  "kimi_linear": "tiny-kimi", "gpt_oss": "tiny-gpt-oss", "kimi_k3": "tiny-k3"}
# The families the megakernel runs that no chip has judged yet, each with why: its kernel
# landed after the chip's last session. `verified` shows them "never run on a chip";
# tests/test_exactness.py fails once one has a record (the entry is then stale) or if one
# listed here does not run in the kernel.
AWAITING_CHIP: dict[str, str] = {}  # none: tiny-k3 was judged on the v5e, 2026-12-07
# The code a record's verdicts speak for: a commit that changes any of it leaves older
# records stale.
KERNEL_PATHS = ("mk/kernels", "mk/kinds", "mk/step/plan.py", "mk/step/one_layer.py",
                "mk/step/megakernel.py", "mk/model/quant.py", "mk/model/unpack.py",
                # the config readers where they stood in mk/kinds/ (mk/model/kind_checks.py and
                # mk/model/hf_config.py now, outside these paths)
                ":(exclude)mk/kinds/checks.py", ":(exclude)mk/kinds/hf.py")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Each token's class; `first` holds every sequence's first step that is not exact
    (None: all exact) and `gaps` each non-exact token's (sequence, step, the reference's
    best logit minus the token's, that gap over the largest |logit|)."""

    exact: int
    ties: int
    wrong: int
    first: tuple
    gaps: tuple

    @property
    def total(self) -> int:
        return self.exact + self.ties + self.wrong

    @property
    def ok(self) -> bool:
        return self.wrong == 0

    def __str__(self) -> str:
        gaps = ", ".join(f"seq {b} step {i}: gap {g:.3g} ({r:.2%})" for b, i, g, r in self.gaps)
        return (f"{self.exact}/{self.total} exact, {self.ties} near-ties, {self.wrong} wrong"
                + (f" [{gaps}]" if gaps else ""))

    def to_dict(self) -> dict:
        return dict(exact=self.exact, ties=self.ties, wrong=self.wrong, total=self.total,
                    first=list(self.first), gaps=[list(g) for g in self.gaps])


def judge_logits(logits, tokens, *, tie_rtol: float = TIE_RTOL) -> Verdict:
    """tokens [B, n] against the reference's logits [B, n, V] for each of them; a near-tie
    is within `tie_rtol` (a finite number >= 0: an infinite one would call every wrong
    token a tie) of the largest |logit|."""
    tie_rtol = finite_number("tie_rtol", tie_rtol)
    logits, tokens = np.asarray(logits, np.float32), np.asarray(tokens)
    if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits {logits.shape} must be [B, n, V] for tokens {tokens.shape}")
    if tokens.dtype.kind not in "iu" or tokens.size and not (
            0 <= tokens.min() and tokens.max() < logits.shape[-1]):
        raise ValueError(f"tokens must be integer ids in [0, V={logits.shape[-1]}); got "
                         f"dtype {tokens.dtype}"
                         + (f", ids {tokens.min()}..{tokens.max()}" if tokens.size else ""))
    best = logits.max(-1)
    chosen = np.take_along_axis(logits, tokens[..., None].astype(np.int64), -1)[..., 0]
    scale = np.abs(logits).max(-1)
    exact = tokens == logits.argmax(-1)
    tie = ~exact & (best - chosen <= tie_rtol * scale)
    first = tuple(int(np.flatnonzero(~row)[0]) if (~row).any() else None for row in exact)
    gaps = tuple((int(b), int(i), float(best[b, i] - chosen[b, i]),
                  float((best[b, i] - chosen[b, i]) / scale[b, i]))
                 for b, i in zip(*np.nonzero(~exact)))
    return Verdict(int(exact.sum()), int(tie.sum()), int((~exact & ~tie).sum()), first, gaps)


def judge(config: ModelConfig, values, prompt, tokens, *, tie_rtol: float = TIE_RTOL,
          expected: Expected | None = None) -> Verdict:
    """Greedy `tokens` [B, n] that a decode path produced after `prompt` [B, P], against
    the reference (`values`: its params, dequantised as the path's oracle, or quantised
    `mk.model.quant.QuantWeight`s the reference dequantises a layer at a time as it reads them:
    a model too big to hold dequantised) teacher-forced on them: token i is judged by
    the reference's logits after prompt + tokens[:i]. `expected` (`expect`'s, same
    config, values and prompt) saves that prefill when the tokens are its own: its logits
    are then the very ones the prefill would give."""
    prompt, tokens = np.asarray(prompt), np.asarray(tokens)
    if prompt.ndim != 2 or tokens.ndim != 2 or prompt.shape[0] != tokens.shape[0]:
        raise ValueError(f"prompt {prompt.shape} and tokens {tokens.shape} must be [B, P] "
                         "and [B, n] with the same B")
    if expected is not None and np.array_equal(expected.tokens, tokens):
        return judge_logits(expected.logits, tokens, tie_rtol=tie_rtol)
    return judge_logits(_teacher_forced(config, values, prompt, tokens), tokens,
                        tie_rtol=tie_rtol)


def _teacher_forced(config: ModelConfig, values, prompt, tokens):
    """The reference's logits [B, n, V] for each of `tokens` [B, n] after `prompt` [B, P]:
    one prefill over prompt + tokens[:-1]."""
    P, n = prompt.shape[1], tokens.shape[1]
    seq = jnp.asarray(np.concatenate([prompt, tokens[:, :-1]], 1), jnp.int32)
    capacity = -(-(P + n) // 8) * 8
    logits, _ = reference.prefill(config, values, seq, max_context=capacity, quantised=True)
    return logits[:, P - 1:]


@dataclasses.dataclass(frozen=True)
class Expected:
    """The reference's own greedy run after a prompt: its tokens [B, n] and the logits
    [B, n, V] `judge` reads for exactly those tokens."""

    tokens: np.ndarray
    logits: np.ndarray


def expect(config: ModelConfig, values, prompt, steps: int, *,
           max_context: int | None = None) -> Expected:
    """What `judge` needs to judge a path that decodes as the reference does, computed
    before the path's tokens exist: the hardware tier runs it in a CPU-only process
    (`cpu_only`) while the chip decodes."""
    prompt, values = np.asarray(prompt), jax.tree.map(jnp.asarray, values)
    tokens = np.asarray(reference.generate(config, values, prompt, steps,
                                           max_context=max_context, quantised=True))
    return Expected(tokens, np.asarray(_teacher_forced(config, values, prompt, tokens)))


def cpu_only() -> None:
    """A worker process's initializer: jax there uses the CPU only (the chip is the
    parent's)."""
    jax.config.update("jax_platforms", "cpu")


# -- The hardware record ---------------------------------------------------------------------
def record_path(chip: str) -> Path:
    """Where the hardware tier's record for `chip` lives: MEASURED/<chip>-exact.json."""
    if chip not in TPU_NAMES:
        raise ValueError(f"chip={chip!r} must be one of {TPU_NAMES}")
    return MEASURED / f"{chip}-exact.json"


def load_record(path: str | os.PathLike) -> dict:
    """A record the tier wrote (checked for the fields `verified` reads)."""
    data = untrusted.load_json(path, "exactness record")  # a regular file, bounded
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a record is an object, not a {type(data).__name__}")
    for field in ("chip", "device_kind", "jax", "libtpu", "commit", "when", "cases"):
        if field not in data:
            raise ValueError(f"{path}: field {field!r} is missing")
    if not isinstance(data["cases"], list):
        raise ValueError(f"{path}: cases must be a list of cases")
    for case in data["cases"]:
        for field in ("name", "family", "exact", "ties", "wrong", "total"):
            if not isinstance(case, dict) or field not in case:
                raise ValueError(f"{path}: a case lacks {field!r}: {str(case)[:200]}")
    return data


def kernel_changed_since(commit: str, root: str | os.PathLike = ".") -> bool | None:
    """Whether a commit after `commit` changed `KERNEL_PATHS` (None: no git history to
    tell, e.g. an installed wheel)."""
    try:
        out = subprocess.run(["git", "log", "--format=%H", f"{commit}..HEAD", "--",
                              *KERNEL_PATHS], cwd=root, capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def verified(root: str | os.PathLike = ".") -> list[dict]:
    """One row per family of `FAMILY_PRESETS`: the chips whose record holds its cases,
    with exact/ties/wrong summed, the record's commit and date, and `stale` (kernel code
    changed since that commit; None: unknown). A family with no record has chip None."""
    records = [load_record(p) for p in sorted(MEASURED.glob("*-exact.json"))]
    rows = []
    for family, preset in FAMILY_PRESETS.items():
        found = False
        for rec in records:
            cases = [c for c in rec["cases"] if c["family"] == family]
            if not cases:
                continue
            found = True
            rows.append(dict(family=family, preset=preset, chip=rec["chip"],
                             cases=len(cases), commit=rec["commit"][:7], when=rec["when"],
                             **{k: sum(c[k] for c in cases)
                                for k in ("exact", "ties", "wrong", "total")},
                             stale=kernel_changed_since(rec["commit"], root)))
        if not found:
            rows.append(dict(family=family, preset=preset, chip=None))
    return rows


# -- Matmuls the chip would round -----------------------------------------------------------
def default_precision_f32_dots(fn, *args, axis_env=(), **kwargs) -> list[str]:
    """The dots inside every kernel fn(*args, **kwargs) traces (`mk.measure.bounds.kernel_jaxprs`)
    that take a float32 operand at default precision, as "kernel: shapes at source line".

    Interpret mode multiplies float32 in float32 whatever the precision; Mosaic, at default
    precision, in one bf16 pass of the MXU (a v5e compile of an [8, 256] x [256, 256]
    float32 dot: 4 vmatmul at default, 24 at HIGHEST, `contract_precision<fp32>`). So a
    float32 dot at default precision is a kernel that computes one thing in interpret mode
    and another on a chip: on a v5e, float32 MoE models picked other experts than the
    reference (a router flip, tokens wrong by O(1)) where interpret mode was exact."""
    found = []

    def walk(name, jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and any(
                    v.aval.dtype == jnp.float32 for v in eqn.invars) and not _highest(
                    eqn.params.get("precision")):
                shapes = " x ".join(str(v.aval.shape) for v in eqn.invars)
                found.append(f"{name}: {shapes} at {source_info_util.summarize(eqn.source_info)}")
            for sub in core.jaxprs_in_params(eqn.params):
                walk(name, sub)

    for name, body, _ in kernel_jaxprs(fn, *args, axis_env=axis_env, **kwargs):
        walk(name, body)
    return found


def _highest(precision) -> bool:
    if precision is None:
        return False
    both = precision if isinstance(precision, tuple) else (precision, precision)
    return all(p == lax.Precision.HIGHEST for p in both)
