# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Speculative decoding on the megakernel
#
# [Open in Colab](https://colab.research.google.com/github/mk-megakernel/mk/blob/v0.1.0/notebooks/09_speculative_sweep.ipynb)
#
# A decode step reads every weight once whether it checks one row or eight, so a target
# model can verify gamma drafted tokens plus one of its own in the time of about one step.
# This notebook answers:
#
# - How does the megakernel verify gamma + 1 rows in one call, and why is greedy
#   speculative decoding exactly the target's greedy decoding?
# - What acceptance length tau do the drafters (a separate model, the target's own first
#   layers, prompt lookup) reach on the tiny models, and does the Leviathan et al. formula
#   (1 - a^(gamma+1)) / (1 - a) explain it?
# - How do tokens/s per user = tau / (t_verify(gamma + 1 rows) + t_draft) move with tau,
#   gamma, batch and the chip, and how do they compare with the published 350 / 709 / 1,515
#   tokens/s (published with a mean acceptance length, forced by the release's benchmark
#   scripts)?
#
# Kernel runs here are TPU interpret mode on a CPU: their times say nothing about a TPU.
# Every TPU or GPU time below is a modelled, conventional or simulated step in the words
# defined once in [notebook 00's ledger](00_decode_is_memory_bound.ipynb) (its section
# "The ledger", `mk.cost.ledger.TERMS`); tau is measured (counted from real drafts).

# %% tags=["hide-input"]
# Colab bootstrap, the same in every notebook. On Colab without the mk-megakernel package,
# pip installs MK_SOURCE (this release's tag; set the environment variable MK_SOURCE to
# install another ref or a fork) with the `colab` extra (the profiler; nothing of Colab's
# own Jupyter packages moves), then asks for a restart. Anywhere, a folder named mk that
# is not the package stops here, saying so.
import importlib.metadata
import importlib.util
import os
import sys

MK_SOURCE = os.environ.get("MK_SOURCE", "git+https://github.com/mk-megakernel/mk@v0.1.0")
if "google.colab" in sys.modules:
    try:
        importlib.metadata.version("mk-megakernel")
    except importlib.metadata.PackageNotFoundError:
        # %pip install -q "mk-megakernel[colab] @ {MK_SOURCE}"
        # `from None`: with the PackageNotFoundError as its context, IPython 7.34 on Python
        # 3.13 shows "Internal Python error in the inspect module" instead of this message.
        raise SystemExit("mk installed: Runtime > Restart session, then run all cells "
                         "again.") from None
mk_spec = importlib.util.find_spec("mk")
if mk_spec is None or mk_spec.origin is None:
    raise ModuleNotFoundError(
        "the mk package is not installed: pip install 'mk-megakernel[notebooks,profile]'"
        + (f"; {list(mk_spec.submodule_search_locations)} is a folder named mk, not the "
           "package: rename it or work in another directory" if mk_spec else ""))

# %% tags=["parameters"]
preset: str = "tiny"  # a name from mk.model.presets.PRESET_NAMES
batch: int = 1  # B, sequences decoded together
rows: int = 1  # T, query rows per sequence in one step (1 is plain decode)
context: int = 256  # S, cached positions per sequence (the KV cache's capacity)
chip: str = "v6e"  # a name from mk.model.chips.CHIP_NAMES: the chip of rooflines and budgets
backend: str = "auto"  # "auto" (Mosaic on a TPU, else interpret), "interpret" or "hardware"
seed: int = 0  # seed of the random weights and inputs
checkpoint: str = ""  # a local Hugging Face checkpoint folder; "" for random weights
gamma: int = 3  # drafted tokens per step, 1..7 (the verifier checks gamma + 1 rows)
megakernel_steps: int = 4  # tokens generated with the megakernel verifier (interpret: ~1 s each)
demo_drafter: str = "forced"  # the megakernel demo's drafter: "self", "ngram" or "forced"
demo_acceptance: int = 3  # tau of the "forced" oracle: 2 of 3 drafts kept every step
tau_steps: int = 24  # tokens per run when measuring tau (XLA reference verifier)
tau_batch: int = 4  # sequences per run when measuring tau (more sequences, steadier tau)
draft_checkpoint: str = ""  # a local HF folder of a draft model sharing checkpoint's vocab
hf_target: str = ""  # a Hugging Face repo id to download (Colab has internet): "Qwen/Qwen3-1.7B"
hf_draft: str = ""  # the draft model's repo id, e.g. "Qwen/Qwen3-0.6B"
allow_download: bool = False  # True lets hf_target / hf_draft download from the hub
sweep_preset: str = "qwen3.5-27b"  # the model of the throughput sweep
sweep_draft: str = "qwen3-0.6b"  # the sweep's draft model (a preset), "" for none
sweep_context: int = 4096  # cached positions per sequence in the sweep
solutions: bool = False  # True checks the worked solution in place of your fix (headless runs)

# %%
import numpy as np
from IPython.display import Markdown, display
from tqdm.auto import tqdm

import mk
import mk.cost.published
import mk.course.run
from mk.cost import calibration, ledger, perf
from mk.course import course, teach
from mk import plots
from mk.model import reference
from mk.speculative import spec

mk.course.run.check_parameters(globals())  # papermill's -p names, every parameter's type
if (hf_target or hf_draft) and not allow_download:
    raise ValueError(f"hf_target={hf_target!r} / hf_draft={hf_draft!r} would download from "
                     "the Hugging Face hub: set allow_download=True as well to allow it")
if hf_target or hf_draft:  # only when asked: this machine has no internet
    from huggingface_hub import snapshot_download

    files = ["*.json", "*.safetensors"]
    checkpoint = snapshot_download(hf_target, allow_patterns=files) if hf_target else checkpoint
    draft_checkpoint = (snapshot_download(hf_draft, allow_patterns=files) if hf_draft
                        else draft_checkpoint)
run = mk.course.run.validate_run(preset=preset, batch=batch, rows=rows, context=context, chip=chip,
                          backend=backend, seed=seed, checkpoint=checkpoint)
spec.check_gamma(gamma)  # gamma = 0 or > 7 stops here with a ValueError
config = run.config
params = mk.load_checkpoint(checkpoint)[1] if checkpoint else mk.init_params(config, run.seed)
prompts = np.random.default_rng(run.seed).integers(0, config.vocab, (max(run.batch,
                                                                      tau_batch), 8))
prompt = prompts[:run.batch]
print(f"{config.name}: B={run.batch}, gamma={gamma} (T={gamma + 1} rows), S={run.context}; "
      f"kernels run on: {mk.kernels.backend.resolve(run.backend)}")

# %% [markdown]
# ## One step: draft, verify gamma + 1 rows, keep the agreeing prefix
#
# The drafter proposes $d_1 \dots d_\gamma$. The target runs the last kept token and the
# drafts as $T = \gamma + 1$ rows at positions $p \dots p + \gamma$ in one megakernel call:
# row $i$'s argmax $t_i$ is what the target would emit after $d_1 \dots d_i$. The step keeps
# $d_1 \dots d_n$ for the longest prefix with $d_{i+1} = t_i$, plus the bonus token $t_n$:
# $\tau = n + 1$ tokens per call. Under sampling, draft $i$ is kept with probability
# $\min(1, p_i(d)/q_i(d))$ and the first rejected one is redrawn from the residual
# $\max(p_i - q_i, 0) / \sum_v \max(p_i(v) - q_i(v), 0)$ (normalised),
# which makes the output distributed exactly as the target's.
#
# The rejected rows $p + n + 1 \dots p + \gamma$ stay in the cache; the next step starts at
# $p + n + 1$ and overwrites them before reading, and the causal mask hides anything past a
# row's own position (`tests/test_spec.py` poisons those rows to check it).
#
# Here the megakernel verifies. The default drafter is the `forced` oracle (it knows the
# target's greedy tokens and spoils draft number `demo_acceptance`), so drafts ARE
# accepted and the kept-prefix path of the verifier runs: a random tiny model's own
# first layers ("self") agree with it on almost nothing (tau = 1), which would test only
# the rejection path.

# %%
options = {"acceptance_length": demo_acceptance} if demo_drafter == "forced" else {}
mk_tokens, mk_stats = spec.generate(config, params, prompt, megakernel_steps,
                                    drafter=demo_drafter, gamma=gamma, verifier="megakernel",
                                    backend=run.backend, max_context=run.context,
                                    progress=True, **options)
want = np.asarray(reference.generate(config, params, prompt, megakernel_steps,
                                     max_context=run.context))
print("megakernel-verified:", np.asarray(mk_tokens).tolist())
print("target greedy      :", want.tolist())
print(f"{mk_stats.verifier_calls} megakernel calls of T={gamma + 1} rows, "
      f"{mk_stats.drafter_calls} drafter calls, tau={mk_stats.acceptance_length:.2f}")

# %% [markdown]
# ## The acceptance and rollback code
#
# What ran above, in the code. The acceptance rule is one line over the drafts and the
# target's greedy tokens:

# %%
teach.excerpt(spec.accept_greedy, [
    ("n = np.cumprod", "return n, target",
     "Draft i (0-based) is compared with row i's greedy token: row i is fed the kept "
     "token before draft i, so its argmax is what the target says draft i should be. "
     "`cumprod` keeps the prefix up to the first disagreement; the bonus is row n's token."),
])

# %% [markdown]
# and the loop of `generate` applies it, writes the kept tokens and rolls back what the
# rejected rows changed:

# %%
teach.excerpt(spec.generate, [
    ("target, logits, cache = verifier.step(", "target, logits, cache = verifier.step(",
     "One verifier call of gamma + 1 rows writes KV rows p .. p + gamma."),
    ("if sampling is None:", "n, bonus = accept_greedy(drafts, target)",
     "Greedy: the exact rule above (sampling: rejection sampling)."),
    ("for b in np.flatnonzero(active):", "cache = verifier.keep(cache, n + 1)",
     "Kept drafts and the bonus go into the sequence; `keep` rolls a hybrid's linear "
     "states back to row n (KV rows need none: the next step overwrites them first)."),
])

# %% [markdown]
# ## Exercise: accept on the wrong row
#
# Here is an acceptance rule with one index wrong. **Predict**: with the forced drafter at
# L = 3 (drafts 1 and 2 equal the target's greedy tokens, draft 3 does not), what tau does
# it measure, and are the tokens still the target's greedy ones? Then **fix** a copy:
# `my_accept` must pass `course.check_acceptance` run with it in `accept_greedy`'s place.

# %%
plots.show_source(course.accept_on_the_next_row)
with course.planted("accept_wrong_row"):
    try:
        course.check_acceptance(config, params, prompt[:1], 8)
    except course.ExerciseFailed as caught:
        print("the check catches it:", caught)

# %% [markdown]
# Write your fix in the next cell; its check fails until you do. `solutions = True`
# (parameters cell) checks the worked solution instead; `course.reveal("09-accept")`
# explains it.

# %%
def my_accept(drafts, target):
    """drafts [B, g], the target's greedy tokens target [B, g + 1] -> (kept drafts n [B],
    the bonus token [B]): the rule above with its index fixed."""
    ...


with course.replaced("accept_wrong_row", course.attempt("09-accept", my_accept, solutions)):
    fixed_tau = course.check_acceptance(config, params, prompt[:1], 8)
print(f"the rule passes: forced L=3 measures tau = {fixed_tau:.2f}")

# %% [markdown]
# ## Measured acceptance length of each drafter
#
# On `tau_batch` random prompts of the run's model, with the XLA reference as the verifier
# (it gives the same tokens as the megakernel, as above, and compiles once for every gamma;
# see `mk.speculative.spec`). The tiny
# models are random, so no trained draft model exists for them: "model" is a stand-in,
# the target's first layer with 10 % noise on every weight (`spec.noisy_copy`); "self" is
# the target's first ceil(L/2) layers with its lm_head; "ngram" looks the last tokens up in
# the sequence so far. The fitted per-token rate $a$ is the maximum-likelihood rate of the
# measured histograms.

# %%
if checkpoint and draft_checkpoint:  # a real pair (Colab: see the note below)
    drafters = {"model": {"draft": mk.load_checkpoint(draft_checkpoint)}, "self": {},
                "ngram": {}}
else:
    drafters = {"model": {}, "self": {}, "ngram": {}}
gammas = range(1, spec.MAX_GAMMA + 1)
measured = {name: [spec.generate(config, params, prompts[:tau_batch], tau_steps, drafter=name,
                                 gamma=g, verifier="reference", bucket=tau_batch,
                                 max_context=run.context, **kw)[1]
                   for g in tqdm(gammas, desc=f"tau of {name}", leave=False)]
            for name, kw in drafters.items()}
alpha = {name: spec.fit_rate(runs) for name, runs in measured.items()}
display(plots.table([{"drafter": name, "a (fitted)": f"{alpha[name]:.3f}"}
                     | {f"tau g={g}": f"{s.acceptance_length:.2f}" for g, s in zip(gammas, runs)}
                     for name, runs in measured.items()]))

# %%
import plotly.graph_objects as go

fig = go.Figure()
for i, (name, runs) in enumerate(measured.items()):
    color = ["#1f77b4", "#d62728", "#2ca02c"][i]
    fig.add_scatter(x=list(gammas), y=[s.acceptance_length for s in runs], mode="markers",
                    name=f"{name}: measured", marker=dict(color=color, size=10))
    fig.add_scatter(x=list(gammas), y=[float(spec.expected_length(alpha[name], g))
                                       for g in gammas], mode="lines", line=dict(color=color),
                    name=f"{name}: (1 - a^(g+1)) / (1 - a), a = {alpha[name]:.2f}")
fig.update_layout(title=f"Acceptance length on {config.name} ({tau_batch} sequences x "
                        f"{tau_steps} tokens per point)",
                  xaxis_title="gamma (drafted tokens per step)",
                  yaxis_title="tau (tokens per verification)")
plots.show(fig)

# %% [markdown]
# With a real pair on Colab: set `hf_target = "Qwen/Qwen3-1.7B"` and
# `hf_draft = "Qwen/Qwen3-0.6B"` with `allow_download = True` (they share the vocab; the
# cell after the parameters downloads them),
# or point `checkpoint` and `draft_checkpoint` at local folders. The prompt is random token
# ids (mk has no tokenizer), which lowers tau against real text.
#
# ## Forced acceptance: the benchmarking device
#
# `data/published.csv` records the published 709 and 1,515 tokens/s as runs with a *mean*
# acceptance length (6 for both); the release's benchmark scripts force that acceptance
# (the rows' source, and `mk.cost.ledger`'s note). To study a given tau without a drafter
# that reaches it, `drafter="forced"` keeps a fixed number of tokens per step losslessly: an oracle that
# knows the target's greedy continuation spoils draft number L, so each step keeps exactly
# L tokens (its own cost is not draft time). A mean tau of L and a forced tau of L give the
# same tokens per verification step; they differ in the step-to-step spread.

# %%
forced = {L: spec.generate(config, params, prompts[:tau_batch], tau_steps, drafter="forced",
                           gamma=spec.MAX_GAMMA, acceptance_length=L, verifier="reference",
                           bucket=tau_batch, max_context=run.context)[1].acceptance_length
          for L in range(1, spec.MAX_GAMMA + 2)}
print("forced L -> measured tau:", forced)

# %% [markdown]
# ## Tokens/s per user against tau, gamma, batch and chip
#
# $$\text{tokens/s per user} = \frac{\tau}{t_\text{verify}(\gamma + 1\ \text{rows}) +
# t_\text{draft}}$$
#
# with $t_\text{verify}$ the modelled step (`mk.speculative.spec.step_ms`: the larger of the HBM floor
# and the tile floor (the measured tile cost table, slow end of the bundle rate) plus the collectives,
# checked below) for the `sweep_preset` model on the
# fewest chips (a power of two) of each kind that hold it, all devices sharing the step, and
# $t_\text{draft} = \gamma$ steps of the `sweep_draft` model on the same chips. Without a
# drafter ($t_\text{draft} = 0$) every gamma gives the same line, because verifying 8 rows
# costs about what 1 row costs (printed below the plot); the draft cost is what separates
# them. A line is one gamma; it stops at $\tau = \gamma + 1$. The slider moves the batch;
# it is precomputed, so it also works in the static HTML page.

# %%
from plotly.subplots import make_subplots

sweep_chips, batches = ("v5e", "v6e", "tpu7x", "gb200"), (1, 2, 4, 8)
target = mk.preset(sweep_preset)
chips_needed = {c: perf.min_chips(target, c, batch=max(batches), context=sweep_context)
                for c in sweep_chips}
devices = {c: n * mk.chip(c).cores_per_chip for c, n in chips_needed.items()}
drafter = mk.preset(sweep_draft) if sweep_draft else None
sweep = {(c, b, g): [spec.throughput(target, c, gamma=g, acceptance_length=t, batch=b,
                                     context=sweep_context, tp=devices[c],
                                     draft=drafter).tokens_per_s_per_user
                     for t in range(1, g + 2)]
         for c in tqdm(sweep_chips, desc="sweep") for b in batches for g in gammas}
fig = make_subplots(1, len(sweep_chips), shared_yaxes=True,
                    subplot_titles=[f"{chips_needed[c]} {c}" for c in sweep_chips])
owner = []
for (c, b, g), ys in sweep.items():
    fig.add_scatter(x=list(range(1, g + 2)), y=ys, mode="lines+markers", name=f"gamma={g}",
                    legendgroup=f"g{g}", showlegend=c == sweep_chips[0], visible=b == 1,
                    line=dict(color=f"hsl({40 * g}, 70%, 45%)"),
                    row=1, col=sweep_chips.index(c) + 1)
    owner.append(b)
fig.update_layout(
    title=f"{target.name}: tokens/s per user, modelled step (S={sweep_context}, "
          f"draft {sweep_draft or 'none'})",
    yaxis_title="throughput (tokens/s per user)", sliders=[dict(active=0, pad=dict(t=40), steps=[
        dict(method="update", label=f"batch {b}", args=[{"visible": [o == b for o in owner]}])
        for b in batches])])
for i in range(len(sweep_chips)):  # short: four subplots share the width
    fig.update_xaxes(title_text="tau (tokens)", row=1, col=i + 1)
plots.show(fig)
for c in sweep_chips:
    one, eight = (spec.step_ms(target, c, batch=1, rows=r, context=sweep_context,
                               tp=devices[c]) for r in (1, 8))
    print(f"{c}: verifying 8 rows takes {eight / one:.3f}x the time of 1 row (batch 1)")

# %% [markdown]
# Modelled, against what a TPU v5e measured: one dispatched step of 8 rows and of 1 row,
# same model, batch and cache (data/measured/v5e-steps.json, `benchmarks/tpu_steps.py`):

# %%
steps_record = calibration.load_steps(calibration.steps_path("v5e"))
ONE = calibration.ONE_STEP
by_shape = {(r["model"], r.get("layers"), r["batch"], r["context"], r["rows"]): r
            for r in steps_record["rows"] if r.get(ONE)}


def measured_at(row):
    made = calibration.provenance(steps_record, row)
    return f"{str(made['commit'])[:7]}, {str(made['when'])[:10]}"


for (model, layers, b, s_, n), r8 in by_shape.items():
    r1 = by_shape.get((model, layers, b, s_, 1))
    if n == 8 and r1 is not None:
        print(f"{model}{'' if layers is None else f' (first {layers} layers)'} B={b} S={s_}: "
              f"8 rows {r8[ONE] * 1e3:.3f} ms ({measured_at(r8)}), 1 row {r1[ONE] * 1e3:.3f} "
              f"ms ({measured_at(r1)}): {r8[ONE] / r1[ONE]:.3f}x, measured on v5e")

# %% [markdown]
# The live panel (Jupyter or Colab with a kernel; the static page shows it as text) adds
# the context and a draft model's time; a draft model shares the target's chips.

# %%
def panel(tau=6, gamma=7, batch=1, chip="tpu7x", context=0, draft="none"):
    if tau > gamma + 1:
        print(f"tau={tau} needs gamma >= {tau - 1}")
        return
    t = spec.throughput(target, chip, gamma=gamma, acceptance_length=tau, batch=batch,
                        context=context, tp=devices[chip],
                        draft=None if draft == "none" else mk.preset(draft))
    print(f"{target.name} on {chips_needed[chip]} {chip}: verify {t.verify_ms:.3f} ms + draft "
          f"{t.draft_ms:.3f} ms -> {t.tokens_per_s_per_user:,.0f} tokens/s per user")


plots.knobs(panel, tau=(1, 8), gamma=(1, 7), batch=(1, 8), chip=list(sweep_chips),
            context=(0, 32768, 1024), draft=["none", "qwen3-0.6b", "qwen3-1.7b"])

# %% [markdown]
# ## The published acceptance-length runs, side by side
#
# From `mk.cost.ledger`, under the assumptions it names once for notebooks 00, 09 and 11: batch 1,
# T = 8 verification rows keeping the published mean tau, every device of the run sharing
# the step, each row's own context (the cached positions of the release's benchmark
# scripts, `mk.cost.published.Published.context`), no draft time. The
# model of each system: the simulated step for TPU rows (the ring's slots sized by Little's
# law), the conventional step for the GB200 rows. Nothing is fitted; error = model /
# published - 1. The words (published, HBM floor, modelled, simulated and conventional
# step) are those of [notebook 00's ledger](00_decode_is_memory_bound.ipynb).

# %%
published = [r for r in ledger.entries(simulate_tpu=True, speculative_only=True)
             if "modelled" in r]
model_of = {r["run"]: ("simulated step", "simulated") if "simulated" in r
            else ("conventional step", "conventional") for r in published}
comparison = [{
    "run": r["run"], "S": r["context"], "published tok/s": f"{r['published']:,.0f}",
    "HBM floor tok/s": f"{r['hbm_floor']:,.0f}",
    "modelled step tok/s": f"{r['modelled']:,.0f} ({r['modelled_error']:+.0%})",
    "system model": model_of[r["run"]][0],
    "system model tok/s": f"{r[model_of[r['run']][1]]:,.0f} "
                          f"({r[model_of[r['run']][1] + '_error']:+.0%})"}
    for r in published]
display(plots.table(comparison))
ratios = {}
for r in published:
    if r["system"] == "tpu7x":
        gpu = next(g for g in published if g["preset"] == r["preset"] and g["tau"] == r["tau"]
                   and g["system"] == "gb200")
        ratios[r["run"]] = {k: r[k] / gpu[k] for k in ("published", "modelled", "hbm_floor")}
        ratios[r["run"]]["system models"] = r["simulated"] / gpu["conventional"]
        print(f"{r['run']}: TPU / GB200 " + ", ".join(f"{k} {v:.2f}x"
                                                      for k, v in ratios[r["run"]].items()))

# %% [markdown]
# ## Worked problems
#
# **1.** A step costs about the same for 1 and gamma + 1 rows while it is HBM-bound. With a
# verification step of t_v and a draft cost of t_d per step, what tau makes speculation
# pay? *Formula:* tokens/s $= \tau / (t_v + t_d) > 1 / t_v \iff \tau > 1 + t_d / t_v$.
# **2.** The published Kimi K3 run: 709 tokens/s at tau 6: how long is one verification
# step? *Formula:* $t = \tau / \text{tokens/s}$. Work them out, then open the answers
# (the cell's output is folded on the site):

# %% tags=["hide-output"]
kimi = next(r for r in mk.cost.published.published() if r.model == "Kimi K3" and r.system == "tpu7x")
print(f"1. with a drafter costing 20 % of a verification step: tau > {1 + 0.2:.1f}")
print(f"2. {kimi.acceptance_length:g} / {kimi.tokens_per_s:g} tokens/s = "
      f"{1e3 * kimi.acceptance_length / kimi.tokens_per_s:.2f} ms per step")

# %% [markdown]
# *Takeaway:* speculation multiplies tokens per weight pass; it pays whenever the drafter
# is cheaper than (tau - 1) verification steps.
#
# ## Closing note
#
# Generated from the outputs above:

# %%
at_gamma = {n: measured[n][gamma - 1] for n in measured}
display(Markdown(
    f"Measured on {plots.escape(config.name)} ({tau_batch} sequences x {tau_steps} tokens, "
    f"gamma {gamma}): "
    + ", ".join(f"**{plots.escape(n)}** tau {s.acceptance_length:.2f} (a = {alpha[n]:.2f})"
                for n, s in at_gamma.items())
    + f"; forced acceptance L gave tau = L for L = 1..{spec.MAX_GAMMA + 1}. Random tiny "
    "models are hard to draft for, so these are far below the published tau of 3 and 6.\n\n"
    + "\n".join(f"- {plots.escape(r['run'])}: published {r['published tok/s']}, HBM floor "
                f"{r['HBM floor tok/s']}, modelled step {r['modelled step tok/s']}, "
                f"{plots.escape(r['system model'])} {r['system model tok/s']}"
                for r in comparison)))

# %% [markdown]
# **Takeaway.** While a step is bound by its weight bytes, verifying gamma + 1 rows costs
# about what one row costs (the printed 8-row / 1-row ratios), so tokens/s per user grows
# almost linearly with tau, and a drafter pays off once tau exceeds about
# 1 + t_draft / t_verify. Chip for chip the HBM floors put the GB200 runs slightly ahead
# (more HBM bandwidth) and so do the modelled steps (the printed TPU / GB200 ratios below
# 1); our system models (simulated TPU step against the conventional GB200 step) disagree
# between the two models; the published runs put TPU v7 ahead. So these numbers cannot
# say whether the software or the hardware makes the published difference: the GB200
# run's software stack, parallelism and batch are not stated, and our models reproduce
# neither published number (the table's errors say by how much). Where a published TPU
# run is faster than its modelled step (a negative error in that column), an assumption of
# the model fails for it: the modelled step charges the MXU at its bf16 rate and puts every
# collective on the critical path; feeding the FP4 experts to the MXU at its fp8 rate
# (`compute="fp8"`) or overlapping the collectives would each shorten it.
#
# ## Questions
#
# 1. gamma = 3 and every draft is right. How many tokens does the step keep, and which KV
#    rows did it write? <details><summary>Answer</summary>4 (3 drafts and the bonus); rows
#    p .. p + 3, all kept.</details>
# 2. Draft 1 is wrong. Which rows of the KV cache now hold rejected tokens, and why is that
#    harmless? <details><summary>Answer</summary>Rows p + 1 .. p + gamma. The next step
#    starts at p + 1 and writes its rows before any row reads them; the causal mask hides
#    rows past a row's own position.</details>
# 3. Why does a hybrid model (gated DeltaNet, KDA) need `keep` and a plain transformer not?
#    <details><summary>Answer</summary>A linear layer's state is advanced by every row fed,
#    accepted or not, and is not indexed by position: the state after the last kept row
#    must be restored. KV rows are indexed by position and overwritten.</details>

# %% [markdown]
# ## Checks

# %%
assert fixed_tau == 3, fixed_tau
assert (np.asarray(mk_tokens) == want).all(), "megakernel speculative tokens != target greedy"
assert mk_stats.acceptance_length > 1 or demo_drafter != "forced", "no draft was accepted"
assert all(forced[L] == L for L in forced), f"forced acceptance is not exact: {forced}"
for name, runs in measured.items():
    assert all(1 <= s.acceptance_length <= s.gamma + 1 for s in runs), name
assert len(comparison) == 6, comparison
assert all(v["published"] > 1 for v in ratios.values()), "the published TPU runs lead"
for c in sweep_chips:  # the sweep's t_verify is the ledger's modelled step
    kw = dict(batch=1, context=sweep_context, tp=devices[c])
    t = spec.throughput(target, c, gamma=spec.MAX_GAMMA, acceptance_length=1, **kw)
    assert t.verify_ms == perf.modelled_step_ms(target, c, rows=spec.MAX_GAMMA + 1, **kw), c
for bad in (0, spec.MAX_GAMMA + 1):
    try:
        spec.check_gamma(bad)
    except ValueError:
        continue
    raise AssertionError(f"gamma={bad} was accepted")
print("checks passed")
