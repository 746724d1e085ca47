"""Mutation testing: plant realistic bugs one at a time and run the tests CI runs against
each, so a developer sees which bugs the suite would let through before a reviewer does.

A mutant is data (`MUTANTS`): a name saying what it breaks, its edits (module path, the
original snippet, which must occur exactly once, and the mutated one), the tests to run
(pytest node ids or files, run as `make test` runs them: the `slow` ones deselected), or,
for a mutant that cannot change behaviour, the reason it is equivalent. Each mutant is
applied to a temporary copy of the repository's tracked files (never the live tree),
its tests run there, and the copy restored before the next one.

    python tools/mutate.py                 # every mutant (hours on 2 cores)
    python tools/mutate.py --only plan     # the mutants whose name contains "plan"
    python tools/mutate.py --list          # names, modules, tests; nothing runs
    python tools/mutate.py --check         # every snippet still found once (seconds)

Prints one line per mutant (caught / SURVIVED / error / hung) and a score; exits 1 when a
mutant survived, errored or hung, or a snippet is stale. A mutant whose tests outlive
`--timeout` (a ring waiting on a semaphore no DMA signals hangs interpret mode) is "hung":
CI would fail it only on its time limit, naming no test, so it is not counted caught.
`make mutate` runs it; `make test-slow` runs `make mutate`. tests/test_mutate.py runs
`--check` in CI, so the list cannot go stale silently.

The names of the issue-21 round (17 behaviour-changing mutants) and of the issue-40 round
(the five survivors, the small_sems allocation) are kept; the rest are reconstructed from
the code they break.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str  # what it breaks
    edits: tuple[tuple[str, str, str], ...]  # (module path, original, mutated)
    tests: tuple[str, ...] = ()  # pytest node ids or files
    equivalent: str = ""  # why no test can catch it (then no tests)

    def __post_init__(self):
        if bool(self.tests) == bool(self.equivalent):
            raise ValueError(f"mutant {self.name!r}: give tests or a reason it is "
                             "equivalent, not both")


def _m(name, path, original, mutated, *tests, equivalent=""):
    return Mutant(name, ((path, original, mutated),), tuple(tests), equivalent)


DA = "mk/kinds/attention/decode_attention.py"
T_DA = "tests/kernels/test_decode_attention.py"
T_RIVALS = ("tests/kernels/test_weight_streaming.py::"
            "test_an_edge_tile_searches_the_kinds_on_where_it_runs_and_drops_their_rivals")
COUNTS = "tests/test_counts.py::"
MULTIPLY = "                multiply()"
ISSUE = "                self._issue(holder, layer, holder_copy, holder_t, slot)"
MUTANTS = [
    # -- issue 40: the five that survived every CI test, and the semaphore allocation --
    _m("plan: ring cover all-reduces one row, not M", "mk/step/plan.py",
       "allreduce_s(M * local.hidden * PARTIAL_SUM_BYTES, tp, spec, collective)",
       "allreduce_s(local.hidden * PARTIAL_SUM_BYTES, tp, spec, collective)",
       COUNTS + "test_ring_cover_holds_one_all_reduce_of_all_m_rows_at_tp_2"),
    _m("plan: HBM holds a KV cache for linear layers too", "mk/step/plan.py",
       "return (caches * K * H * len(c.full_layers) * self.batch",
       "return (caches * K * H * c.layers * self.batch",
       COUNTS + "test_plan_hbm_bytes_are_the_megakernels_operands_and_no_kv_for_linear_layers"),
    _m("KV tile counts: one tile too many written at a tile's end",
       "mk/kernels/kv_stream.py",
       "return read, sum(last_kv_tile(p, rows, kv_tile) + 1 - p // kv_tile for p in pos)",
       "return read, sum(last_kv_tile(p, rows, kv_tile) + 2 - p // kv_tile for p in pos)",
       COUNTS + "test_plan_kv_tiles_read_and_written_match_numpys_tile_index"),
    _m("sim: KV tiles per sequence ignore the T new rows", "mk/kinds/attention/kinds.py",
       "for i in range(first, first + kv_tiles(sim.context, sim.rows, tile, window))]",
       "for i in range(first, first + kv_tiles(sim.context, 1, tile, window))]",
       COUNTS + "test_simulator_kv_bytes_count_the_new_rows_tiles_and_full_layers_only"),
    _m("deltanet: value heads read key heads interleaved (h % Nk)",
       "mk/kinds/linear/deltanet.py", "key = pl.multiple_of((h // G) * Hk, LANES)",
       "key = pl.multiple_of((h % config.linear_key_heads) * Hk, LANES)",
       "tests/test_head_maps.py::test_gated_deltanet_value_head_h_reads_key_head_h_over_g"),
    _m("MoE kind: two small semaphores under the router bias's index 2",
       "mk/kinds/mlp/kinds.py", "small_sems=pltpu.SemaphoreType.DMA((len(self.small_loads),))",
       "small_sems=pltpu.SemaphoreType.DMA((2,))",
       "tests/test_bounds.py::test_every_megakernel_index_is_inside_its_allocation"),
    _m("attention: query heads read kv heads interleaved", DA,
       "c, j = divmod(n, group)\n        stage[...] = src_vmem[:, pl.ds(n * H, H)]",
       "j, c = divmod(n, heads // group)\n        stage[...] = src_vmem[:, pl.ds(n * H, H)]",
       "tests/test_head_maps.py::test_gqa_query_head_n_reads_kv_head_n_over_g", T_DA),
    _m("MLA: head n's value up-projection is the next head's", "mk/kinds/attention/mla.py",
       "w_uv = s.wkv_b[:, n * (Hn + Ho) + Hn:(n + 1) * (Hn + Ho)].astype(F32)",
       "w_uv = s.wkv_b[:, (n + 1) % N * (Hn + Ho) + Hn:((n + 1) % N + 1) * (Hn + Ho)]"
       ".astype(F32)", "tests/test_kimi.py::test_megakernel_32_greedy_tokens_match_transformers"
       "_generate"),
    _m("MLA: head n's absorbed query uses the next head's W_uk", "mk/kinds/attention/mla.py",
       "w_uk = s.wkv_b[:, n * (Hn + Ho):n * (Hn + Ho) + Hn].astype(F32)",
       "w_uk = s.wkv_b[:, (n + 1) % N * (Hn + Ho):(n + 1) % N * (Hn + Ho) + Hn].astype(F32)",
       "tests/test_kimi.py::test_megakernel_32_greedy_tokens_match_transformers_generate"),
    _m("KDA: head h's decays read from key head 0", "mk/kinds/linear/deltanet.py",
       "decays[1][b, h, :T] = decays[0][m, pl.ds(key, Hk)]",
       "decays[1][b, h, :T] = decays[0][m, pl.ds(0, Hk)]",
       "tests/test_head_maps.py::test_kda_head_h_reads_its_own_key_head_and_decays"),
    # -- issue 21's round, by its names --
    _m("RoPE sign", "mk/kinds/attention/attention_prologue.py",
       "return x * cos + partner * sign * sin", "return x * cos - partner * sign * sin",
       "tests/kernels/test_attention_prologue.py"),
    _m("softmax rescale: the running sum not rescaled", DA,
       "s.l[rows, :] = alpha * s.l[rows, :] + jnp.sum(probs, 1, keepdims=True)",
       "s.l[rows, :] = s.l[rows, :] + jnp.sum(probs, 1, keepdims=True)", T_DA),
    _m("causal mask of new rows: every new row sees all of them", DA,
       "visible = i * tile + self.column <= p + self.row_t  # [R, kv_tile]",
       "visible = i * tile + self.column <= p + self.T - 1  # [R, kv_tile]", T_DA),
    _m("one KV tile fewer", "mk/kernels/kv_stream.py",
       "end = last_kv_tile(position, rows, kv_tile) + 1\n",
       "end = last_kv_tile(position, rows, kv_tile)\n", T_DA),
    _m("short write-back window (one sublane tile short)", DA,
       "return min(kv_tile, _round_up(rows - 1, sub) + sub)",
       "return min(kv_tile, _round_up(rows, sub))", T_DA),
    _m("MoE renormalisation inverted", "mk/kinds/mlp/routing.py",
       "    if routing.renormalise:\n        total",
       "    if not routing.renormalise:\n        total",
       "tests/kernels/test_mlp.py"),
    _m("MoE slot for id: a slot's weight is expert s's, not ids[s]'s", "mk/kinds/mlp/mlp.py",
       "jnp.where(expert == ids_smem[s], combine_vmem[...], 0.0)",
       "jnp.where(expert == s, combine_vmem[...], 0.0)", "tests/kernels/test_mlp.py"),
    _m("ring prefetch before read: tile g + slots issued into the slot being read",
       "mk/kernels/ring.py", f"{MULTIPLY}\n{ISSUE}", f"{ISSUE}\n{MULTIPLY}",
       "tests/kernels/test_weight_streaming.py", "tests/kernels/test_mlp.py"),
    _m("ring issues g + slots - 1 at the edge, its one holder known", "mk/kernels/ring.py",
       "seg.start + t + self.n - after.start)", "seg.start + t + self.n - 1 - after.start)",
       "tests/kernels/test_mlp.py"),
    # (a search that seeks another tile leaves a slot no DMA fills: "hung", not caught)
    _m("ring's edge search finds the next layer's tile but fetches this layer's",
       "mk/kernels/ring.py",
       "return self._holders(layer < s.layers, layer, local, local, candidates)",
       "return self._holders(layer < s.layers, layer - over.astype(jnp.int32), local, "
       "local, candidates)", "tests/test_megakernel.py"),
    # (a slot carried wrongly waits on a semaphore no DMA signals: "hung", not caught)
    _m("stream rivals: one reached in the next layer is dropped too", "mk/kernels/stream.py",
       "if s in crossing or not rivals(segment, s))", "if not rivals(segment, s))", T_RIVALS),
    _m("stream rivals: kinds of two roles taken for rivals", "mk/kernels/stream.py",
       "b.kind is not None and a.kind[0] == b.kind[0] \\\n",
       "b.kind is not None \\\n", T_RIVALS),
    _m("ring carried panel: advances every tile, not after a panel's last step",
       "mk/kernels/ring.py", "jnp.where(last, j + 1, j))", "jnp.where(last, j, j + 1))",
       "tests/kernels/test_weight_streaming.py", "tests/kernels/test_mlp.py"),
    _m("ring edge runs: a run of edge tiles forgets its last tile", "mk/kernels/ring.py",
       "                runs[-1][1] = t + 1", "                runs[-1][1] = t",
       "tests/kernels/test_weight_streaming.py", "tests/kernels/test_mlp.py"),
    _m("folded tile: every stacked block meets the first column block", "mk/kernels/fold.py",
       "parts += [product[b * m:(b + 1) * m, b * c:(b + 1) * c] for b in range(s)]",
       "parts += [product[b * m:(b + 1) * m, 0:c] for b in range(s)]",
       "tests/kernels/test_weight_streaming.py"),
    _m("folded layout: row blocks laid out in the wrong order", "mk/kernels/fold.py",
       "return jnp.swapaxes(blocks, -3, -2).reshape(*lead, rows // fold, fold * cols)",
       "return jnp.swapaxes(blocks, -3, -2)[..., ::-1, :].reshape(*lead, rows // fold, "
       "fold * cols)",
       "tests/kernels/test_weight_streaming.py"),
    _m("ring duplicate issue: the prologue issues one tile too many", "mk/kernels/ring.py",
       "lax.fori_loop(first, min(first + self.n, self.stream.total), issue, 0)",
       "lax.fori_loop(first, min(first + self.n + 1, self.stream.total), issue, 0)",
       "tests/kernels/test_weight_streaming.py", "tests/kernels/test_mlp.py"),
    _m("argmax ties go to the highest id", "mk/kernels/collectives.py",
       "index = jnp.min(jnp.where(logits == best, local, Vs), axis=1, keepdims=True)",
       "index = jnp.max(jnp.where(logits == best, local, -1), axis=1, keepdims=True)",
       "tests/test_collectives.py", "tests/test_megakernel.py"),
    _m("all-reduce missing a peer: one reduce-scatter round short",
       "mk/kernels/collectives.py",
       'for r in reversed(range(check_devices(n, "n"))):  # d = n/2, ..., 1',
       'for r in reversed(range(1, check_devices(n, "n"))):  # d = n/2, ..., 1',
       "tests/test_collectives.py"),
    _m("two-phase all-reduce sums its chunk's partials left to right, not in tree order",
       "mk/kernels/collectives.py",
       "gathered[pl.ds(me, 1)] = tree_sum(recv[...])[None]",
       "gathered[pl.ds(me, 1)] = sum(recv[i] for i in range(1, n))[None] + recv[0][None]",
       "tests/test_collectives.py"),
    _m("RMSNorm (1 + w): the norm offset dropped in the kernel's weights", "mk/step/megakernel.py",
       "return params[name].astype(jnp.float32) + config.norm_offset",
       "return params[name].astype(jnp.float32)", "tests/test_hybrid.py"),
    _m("RMSNorm eps outside the sqrt", "mk/model/ops.py",
       "x * lax.rsqrt(squares + eps) * scale",
       "x * (lax.rsqrt(squares) + eps) * scale",
       "tests/test_reference.py"),
    _m("residual RMSNorm over a lane-padded model's padding too", "mk/model/ops.py",
       "/ (width or x.shape[-1])", "/ x.shape[-1]", "tests/test_gpt_oss.py"),
    _m("greedy acceptance keeps one draft more", "mk/speculative/spec.py",
       "n = np.cumprod(drafts == target[:, :-1], axis=1).sum(axis=1)",
       "n = np.minimum(np.cumprod(drafts == target[:, :-1], axis=1).sum(axis=1) + 1, "
       "drafts.shape[1])", "tests/test_spec.py"),
    _m("K/V rows spliced at position - 1", DA, "        first = p - i * tile\n",
       "        first = p - 1 - i * tile\n", T_DA),
    _m("speculative sampling: the residual max(p - q, 0) unclipped", "mk/speculative/spec.py",
       "    residual = np.maximum(residual, 0.0)\n", "", "tests/test_spec.py"),
    # -- reconstructed from the code added since (issue 40's 31 new, by what they break) --
    _m("int4 zero point: the low three bits flipped, not bit 3 (not q + 8)", "mk/model/unpack.py",
       "INT4_FLIP = -0x77777778", "INT4_FLIP = 0x77777777", "tests/test_quant.py",
       "tests/kernels/test_weight_streaming.py"),
    _m("loader: Qwen3.5's gated q_proj split in halves, not per head", "mk/model/hf_layout.py",
       "(np.arange(D), column // H * 2 * H + column % H + offset))",
       "(np.arange(D), column + offset // H * width))",
       "tests/test_checkpoint.py", "tests/test_oracle_transformers.py",
       "tests/test_hybrid.py::test_prefill_logits_match_transformers_forward"),
    _m("plan: cache capacity rounded to 8 rows, not 16", "mk/step/plan.py",
       'S = -(-positive_int("positions", positions) // 16) * 16',
       'S = -(-positive_int("positions", positions) // 8) * 8', "tests/test_plan.py",
       "tests/test_sim.py"),
    _m("perf: collective time of one row, not M", "mk/cost/perf.py",
       "* allreduce_s(m * config.hidden * PARTIAL_SUM_BYTES, tp, spec,",
       "* allreduce_s(config.hidden * PARTIAL_SUM_BYTES, tp, spec,", "tests/test_perf.py"),
    _m("sim: all-reduce of one row, not M", "mk/cost/sim.py",
       "self.collective(M * D * perf.PARTIAL_SUM_BYTES)",
       "self.collective(D * perf.PARTIAL_SUM_BYTES)",
       COUNTS + "test_simulator_all_reduces_m_rows_twice_a_layer_at_tp_2"),
    _m("delta rule: the state not decayed", "mk/kinds/linear/delta_rule.py",
       "        s = s * decay(t)\n", "        s = s\n", "tests/kernels/test_deltanet.py"),
    _m("delta rule: beta dropped", "mk/kinds/linear/delta_rule.py",
       "delta = jnp.where(at_t, (v - remembered) * beta(t), 0.0)",
       "delta = jnp.where(at_t, (v - remembered), 0.0)", "tests/kernels/test_deltanet.py"),
    _m("profiles: captures relative to the working directory (notebooks/profiles/)",
       "mk/measure/profiling.py", 'return root / "profiles"', 'return Path("profiles").absolute()',
       "tests/test_profiling.py::test_captures_go_to_mk_profiles_else_the_checkouts_profiles"
       "_else_the_working_directory",
       "tests/test_profiling.py::test_notebook_08_run_by_papermill_in_notebooks_writes_under"
       "_the_top_level_profiles"),
    _m("KV tile counts: reads one tile fewer", "mk/kernels/kv_stream.py",
       "read = sum(kv_tiles(p, rows, kv_tile, window) for p in pos)",
       "read = sum(kv_tiles(p, rows, kv_tile, window) - 1 for p in pos)",
       COUNTS + "test_plan_kv_tiles_read_and_written_match_numpys_tile_index"),
    # -- issue 35: fp4's placement decoder, byte-matched expert tiles, packed loops --
    _m("fp4 fed fp8: the tile product's gain of 64 dropped", "mk/model/unpack.py",
       "return total if gain == 1.0 else total * gain", "return total",
       "tests/test_megakernel.py::test_fp8_fed_weights_decode_the_references_tokens"),
    _m("fp4 decoder: the second rows' signs dropped", "mk/model/unpack.py",
       "((words << 2) & SECOND_UP) | ((words >> 2) & 0x10101010)",
       "((words << 2) & 0x0C0C0C0C) | ((words >> 2) & 0x10101010)", "tests/test_quant.py"),
    _m("model_block: the other weights' tiles not matched to the experts' bytes",
       "mk/step/one_layer.py",
       "most_bytes=min(OTHERS_OVER_REPEAT_BYTES * smallest, TILE_BYTES),",
       "most_bytes=TILE_BYTES,",
       "tests/test_plan.py::test_tiles_feed_every_mxu_and_experts_take_tiles_of_their_own"),
    _m("MoE joins fp8 experts' gate and up, cutting their 128-column scale blocks",
       "mk/kinds/mlp/kinds.py", 'if used % quant.column_block(dict(c.formats).get("experts")):',
       "if False:",
       "tests/test_quant_shards.py::test_fp8_experts_stay_apart_where_joining_them_would_cut"
       "_a_scale_block"),
    _m("step bytes: an expert matrix on the block's tile priced by its neighbours' own",
       "mk/step/step_bytes.py", "tiles = [own.get(n, tile) for n in names",
       "tiles = [own[n] for n in names if n in own",
       "tests/test_quant.py::test_predicted_step_bytes_shrink_by_each_formats_bits_per_value"),
    _m("bundles: a run of bundles printed out inside a trip ends the loop", "mk/cost/bundles.py",
       "if r.depth is not None and (r.depth >= d or not run)), None)",
       "if r.depth is not None), None)",
       "tests/test_bundles.py::test_loops_are_read_from_a_dump_in_libtpus_format"),
    _m("bundles: a trip through an expert charged whole to each of its tiles",
       "mk/cost/bundles.py", "return -(-lp.bundles // "
                             "lp.wait_granules.count(max(lp.wait_granules)))",
       "return lp.bundles",
       "tests/test_bundles.py::test_a_trip_through_an_expert_of_one_tile_matrices_costs_each"
       "_tile_its_share"),
    _m("sim: a packed tile's recorded loop ignored", "mk/cost/sim.py",
       "        if (s.scheme, s.tile) in packed:", "        if False:",
       "tests/test_bundles.py::test_a_trip_through_an_expert_of_one_tile_matrices_costs_each"
       "_tile_its_share"),
    # -- issue 35: gate and up joined in one lane tile --
    _m("joined experts: up rotated the wrong way", "mk/kinds/mlp/joined_experts.py",
       "up = pltpu.roll(joined, joined.shape[1] - used, 1)", "up = pltpu.roll(joined, used, 1)",
       "tests/kernels/test_mlp.py::test_a_joined_products_gate_and_up_come_out_of_their_lanes"),
    _m("joined experts: gate|up taken from the padded widths", "mk/kinds/mlp/kinds.py",
       "parts, self.config.own_width(\"expert_ffn\"), self.joined)",
       "parts, self.config.expert_ffn, self.joined)",
       "tests/test_tensor_parallel.py::test_a_split_width_short_of_a_tile_is_padded_with_zeros"),
    _m("joined experts: the activation's padding lanes not zeroed", "mk/kinds/mlp/mlp.py",
       "            act = jnp.where(lax.broadcasted_iota(jnp.int32, act.shape, 1) < used, act, "
       "0.0)",  # noqa: E501 - the source line as written
       "            act = act",
       equivalent="the lanes past `used` meet down's zero rows (the shard's padding): finite "
                  "values times zero add nothing; the mask guards an inf there, which random "
                  "and real weights do not make"),
    # -- issue 35: the router split by experts --
    _m("split router: logits gathered in the wrong device order", "mk/kinds/mlp/kinds.py",
       "jnp.concatenate([parts[i] for i in range(n)], axis=1)",
       "jnp.concatenate([parts[n - 1 - i] for i in range(n)], axis=1)",
       "tests/test_tensor_parallel.py::test_kimi_fp4_experts_joined_at_tp_give_transformers"
       "_greedy_tokens"),
    _m("split router: the simulator skips the gather", "mk/kinds/mlp/kinds.py",
       "        if self.kind.router_shards > 1:  # the logits' all-gather",
       "        if False:  # the logits' all-gather",
       "tests/test_bundles.py::test_the_recorded_tensor_parallel_shards_stream_through_their"
       "_collectives"),
    _m("split router: mk.cost.perf forgets the gathers", "mk/cost/perf.py",
       "+ sum(len(k.layers) * k.collectives_s(m, spec, ici_latency_s)",
       "+ 0 * sum(len(k.layers) * k.collectives_s(m, spec, ici_latency_s)",
       "tests/test_ledger.py::test_the_collective_chain_moves_with_the_assumed_latency_of_a"
       "_message_round"),
    # -- issue 35: measured routing --
    _m("routing trace: routes the MLP's output, not its input", "mk/cost/routing_trace.py",
       'reference.mlp_input(config, params, layer, taps["attn"][layer])',
       'reference.mlp_input(config, params, layer, taps["mlp"][layer])',
       "tests/test_routing_trace.py::test_a_recorded_trace_counts_transformers_router_choices"),
    _m("routing trace: one expert's probability squared away", "mk/cost/routing_trace.py",
       "-np.expm1(tokens * np.log1p(-np.asarray(shares, np.float64)))",
       "-np.expm1(tokens * np.log1p(-np.asarray(shares, np.float64) ** 2))",
       "tests/test_routing_trace.py::test_even_routing_is_uniform_and_one_favourite_pair_is"
       "_shared"),
    # -- issue 65: hostile files, wrong answers, the bundle-rate invariant --
    _m("untrusted: a named pipe is read as a file", "mk/model/untrusted.py",
       "    if not stat.S_ISREG(st.st_mode):",
       "    if False:",
       "tests/test_routing_trace.py::test_a_named_pipe_is_refused_before_it_is_opened"),
    _m("check_tokens: one token against another passes (0-d argwhere)", "mk/course/grading.py",
       "bad = np.argwhere(np.atleast_1d(got != want))",
       "bad = np.argwhere(got != want)",
       "tests/test_course.py::test_check_tokens_names_the_first_difference"),
    _m("review: the bundle-rate invariant never compares the ends", "mk/course/review.py",
       "assert slow.step_s >= fast.step_s * (1 - RTOL), (",
       "assert slow.step_s >= 0, (",
       "tests/test_review.py::test_each_invariant_fails_on_a_step_that_breaks_it"),
]


def tracked_copy(dest: Path) -> None:
    """Copy the repository's files (tracked, and new ones git does not ignore; as they are
    in the working tree) to dest."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, check=True, capture_output=True)
    files = listed.stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def stale(mutant: Mutant, root: Path = ROOT) -> list[str]:
    """Why the mutant's edits cannot be applied at `root` (empty when they can)."""
    problems = []
    for path, original, mutated in mutant.edits:
        text = (root / path).read_text() if (root / path).is_file() else None
        if text is None:
            problems.append(f"{path}: no such file")
        elif text.count(original) != 1:
            problems.append(f"{path}: the original occurs {text.count(original)} times")
        elif original == mutated:
            problems.append(f"{path}: the mutation changes nothing")
    for test in mutant.tests:
        if not (root / test.split("::")[0]).is_file():
            problems.append(f"{test}: no such test file")
    return problems


def run_one(mutant: Mutant, copy: Path, python: str, timeout: float
            ) -> tuple[str, float, str]:
    """(result, seconds, the failing tests' summary) of one mutant in `copy`."""
    if mutant.equivalent:
        return "equivalent", 0.0, mutant.equivalent
    saved = {}
    for path, original, mutated in mutant.edits:
        target = copy / path
        saved[target] = target.read_text()
        target.write_text(saved[target].replace(original, mutated, 1))
    env = dict(os.environ, PYTHONPATH=str(copy), JAX_PLATFORMS="cpu",
               TPU_SKIP_MDS_QUERY="1", MK_PROFILES=str(copy / "profiles"))
    start = time.time()
    try:
        done = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "-n", "0", *mutant.tests], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hung", time.time() - start, f"its tests ran past --timeout {timeout:.0f} s"
    finally:
        for target, text in saved.items():
            target.write_text(text)
    seconds = time.time() - start
    lines = done.stdout.splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    failed += [line.strip() for line in lines if line.startswith("E ")][:1]  # why
    if done.returncode == 0:
        return "SURVIVED", seconds, ""
    if done.returncode == 1:
        return "caught", seconds, "; ".join(failed[:1] + failed[-1:])
    return "error", seconds, (done.stdout + done.stderr).strip().splitlines()[-1:][0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[],
                        help="run the mutants whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--check", action="store_true",
                        help="check every mutant applies to the tree, run nothing")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a mutant's tests may run before it counts as hung")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(o in m.name for o in args.only)]
    if not chosen:
        print(f"no mutant's name contains any of {args.only}")
        return 2
    problems = {m.name: stale(m) for m in chosen}
    for name, why in problems.items():
        for line in why:
            print(f"STALE {name}: {line}")
    if args.check or any(problems.values()):
        print(f"{len(chosen)} mutants, {sum(bool(p) for p in problems.values())} stale")
        return 1 if any(problems.values()) else 0
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {', '.join(p for p, *_ in m.edits)}\n    "
                  f"{', '.join(m.tests) or 'equivalent: ' + m.equivalent}")
        return 0
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="mk-mutate-") as tmp:
        copy = Path(tmp)
        tracked_copy(copy)
        for m in chosen:
            result, seconds, detail = run_one(m, copy, args.python, args.timeout)
            counts[result] = counts.get(result, 0) + 1
            print(f"{result:10} {seconds:7.1f} s  {m.name}" + (f"\n{'':21}{detail}"
                                                            if detail else ""), flush=True)
    behavioural = len(chosen) - counts.get("equivalent", 0)
    print(f"caught {counts.get('caught', 0)} of {behavioural} behaviour-changing mutants; "
          f"survived {counts.get('SURVIVED', 0)}, errors {counts.get('error', 0)}, "
          f"hung {counts.get('hung', 0)}, equivalent {counts.get('equivalent', 0)}")
    return 1 if counts.get("SURVIVED") or counts.get("error") or counts.get("hung") else 0


if __name__ == "__main__":
    sys.exit(main())
