"""benchmarks/tpu_models.py (issue 60) without a TPU: it refuses to write a chip's record
off a chip, and refuses a malformed record rather than merging it. Its rows run in
`make test-slow` in interpret mode (tests/test_tpu.py's tier judges the kernels on a chip;
this script's own rows run only there)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import tpu_models  # noqa: E402

import mk  # noqa: E402
from mk.kernels import backend  # noqa: E402
from mk.measure import exactness, measure  # noqa: E402
from mk.model import checkpoint, reference, untrusted  # noqa: E402
from mk.step.plan import DecodePlan  # noqa: E402


@pytest.mark.skipif(backend.on_tpu(), reason="on a TPU main([]) would run every row")
def test_off_a_tpu_it_refuses_unless_interpret_mode_is_asked_for(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tpu_models.main([])
    assert "no TPU here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpu_models.main(["--interpret", "--json", str(tmp_path / "v5e-models.json")])
    assert "a path not named for a TPU" in capsys.readouterr().err


@pytest.mark.parametrize("record", [[], {"rows": {}}, {"rows": [{"model": "tiny"}]}])
def test_a_malformed_record_is_refused_naming_the_file(tmp_path, record):
    path = tmp_path / "models.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="models.json: must be an object with a list 'rows'"):
        tpu_models._earlier_rows(path, dict(chip=None, jax="", libtpu=""))


@pytest.mark.slow
def test_the_interpret_rows_are_exact(tmp_path):
    """Each interpret row in its own process, judged exact, the record written; the
    reference runs saved first (`--expect-only`) and judged against after."""
    path, saved = tmp_path / "interpret-models.json", tmp_path / "expected"
    tpu_models.main(["--interpret", "--steps", "4", "--expected", str(saved),
                     "--expect-only"])
    assert len(list(saved.glob("*.npz"))) == len(tpu_models.INTERPRET_ROWS)
    tpu_models.main(["--interpret", "--json", str(path), "--steps", "4", "--expected",
                     str(saved)])
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == len(tpu_models.INTERPRET_ROWS)
    assert all(r.get("exact") == r.get("total") for r in rows), rows


def test_a_saved_reference_run_is_read_back_and_a_wrong_one_refused(tmp_path, monkeypatch):
    """`--expected`'s files: a row's run saved and read back as it was, and then not run
    again; a file of another row's shapes or not a saved run refused naming it."""
    row = dict(model="tiny", formats={"dense": "int8"}, batch=2, context=64, steps=3,
               routes="drawn")
    path = tpu_models.expected_file(tmp_path, row)
    assert path.name == "tiny-dense=int8-b2-c64-s3.npz"
    V = mk.preset("tiny").vocab
    logits = np.random.default_rng(0).standard_normal((2, 3, V)).astype(np.float32)
    tpu_models.save_expected(path, exactness.Expected(np.arange(6).reshape(2, 3), logits),
                             12.5)
    got, seconds = tpu_models.load_expected(path, 2, 3, V)
    assert seconds == 12.5 and np.array_equal(got.tokens, np.arange(6).reshape(2, 3))
    assert np.array_equal(got.logits, logits)
    with pytest.raises(ValueError, match=r"s3.npz: holds .* this row needs integer tokens "
                                         r"\[2, 4\]"):
        tpu_models.load_expected(path, 2, 4, V)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz: not a saved reference run"):
        tpu_models.load_expected(tmp_path / "junk.npz", 2, 3, V)
    monkeypatch.setattr(tpu_models, "_in_cpu_child", lambda *a: pytest.fail("ran again"))
    out = tpu_models.run_row("tiny", {"dense": "int8"}, 2, 64, 3, "interpret", tmp_path,
                             expect_only=True)
    assert out["reference_s"] == 12.5 and out["expected"] == path.name


def test_tokens_not_the_references_own_are_judged_in_a_child_and_caught():
    """`run_row`'s other path: the reference (a CPU-only child) teacher-forced on tokens
    that differ from its own run; a planted wrong token is counted wrong."""
    expected, _ = tpu_models._in_cpu_child(tpu_models._reference, "tiny", {}, 1, 64, 4)
    tokens = expected.tokens.copy()
    tokens[0, 2] = (tokens[0, 2] + 1) % mk.preset("tiny").vocab  # the planted bug
    verdict = tpu_models._in_cpu_child(tpu_models._judge, "tiny", {}, 1, tokens)
    assert verdict.first == (2,) and verdict.wrong >= 1  # the tokens before it: exact
    assert verdict.exact + verdict.ties + verdict.wrong == 4 and verdict.exact >= 2


def test_the_committed_record_and_notebook_12_say_what_the_chip_measured():
    """data/measured/v5e-models.json: every row exact but one of a biased router's drawn
    routes (chaotic: `mk.model.checkpoint.pin_routes`; 05d and docs/colab.md say so,
    tests/test_claims.py), its peak under the plan's count for a donating `generate`
    (which today's plan still counts), and notebook 12's prose quotes the numbers of each
    row it names (qwen3-4b bf16, qwen3-8b int8) as recorded."""
    record = untrusted.load_json(measure.MEASURED / "v5e-models.json", "models record")
    for row in record["rows"]:
        chaotic = (checkpoint.pinnable(mk.preset(row["model"]))
                   and row.get("routes", "drawn") == "drawn")
        assert chaotic or row["wrong"] == 0 and row["exact"] == row["total"] > 0, row
        assert row["peak_gib"] < row["planned_gib"] <= row["limit_gib"], row
        plan = DecodePlan.make(mk.preset(row["model"]), batch=row["batch"],
                               context=row["context"], formats=row["formats"])
        fit = plan.fits(record["chip"], prompt=tpu_models.PROMPT, donate=True)
        assert round(fit.hbm_bytes / tpu_models.GIB, 2) == row["planned_gib"], row
    prose = " ".join(line.lstrip("# ") for line in (
        Path(__file__).resolve().parent.parent / "notebooks" / "12_quantised_weights.py"
    ).read_text(encoding="utf-8").splitlines())
    for model, named in (("qwen3-4b", "qwen3-4b bf16"), ("qwen3-8b", "qwen3-8b int8")):
        row, = (r for r in record["rows"] if r["model"] == model)
        assert (f"{named} counted {row['planned_gib']:.1f} GiB for a donating `generate` "
                f"and peaked at {row['peak_gib']:.1f}") in prose, named


def test_a_biased_routers_routes_are_pinned_and_its_saved_run_named_so():
    """gpt-oss's rows run on weights whose routes `pin_routes` fixed (random routers are
    chaotic: the chip's tokens could not be judged against the CPU's): every token of a
    prompt picks each MoE layer's pinned experts, with the margin; a plain model's rows keep
    their drawn routes, and a model with no router bias is refused by name."""
    config = mk.preset("tiny-gpt-oss")
    row = tpu_models._row("tiny-gpt-oss", {"experts": "fp4"}, 1, 64, 8)
    assert row["routes"] == "pinned"
    assert tpu_models.expected_file(Path("x"), row).name.endswith("-s8-pinned.npz")
    assert tpu_models._row("tiny", {}, 1, 64, 8)["routes"] == "drawn"
    drawn = mk.init_params(config, 0, {"experts": "fp4"})
    params = tpu_models._params(config, {"experts": "fp4"})
    raised = np.asarray(params["router_logit_bias"], np.float32) - np.asarray(
        drawn["router_logit_bias"], np.float32)
    pinned = [set(np.flatnonzero(r)) for r in raised]
    assert all(len(p) == config.experts_per_token for p in pinned)
    assert np.allclose(raised[raised != 0], checkpoint.PINNED_MARGIN, atol=0.1)
    assert len({frozenset(p) for p in pinned}) > 1  # each layer its own experts
    prompt = np.random.default_rng(1).integers(0, config.vocab, (2, 8))
    _, _, taps = reference.decode_step(config, params, reference.init_cache(config, 2, 16),
                                       prompt, np.zeros(2, np.int32), taps=True,
                                       quantised=True)
    for layer in config.moe_layers:
        i = config.mlp_index(layer)[1]
        h = reference.mlp_input(config, params, layer, taps["attn"][layer])
        _, chosen = reference.routes(config, params, i, h)
        assert all(set(c) == pinned[i] for c in np.asarray(chosen).tolist()), layer
    with pytest.raises(ValueError, match="tiny: no router_logit_bias"):
        checkpoint.pin_routes(mk.preset("tiny"), mk.init_params(mk.preset("tiny")))
    with pytest.raises(ValueError, match=r"margin=-1 must be a finite number in \(0, inf\)"):
        checkpoint.pin_routes(config, drawn, margin=-1)


def test_route_chaos_compares_two_prefills_and_names_a_bad_format(capsys):
    """benchmarks/route_chaos.py (pin_routes' why, measured on gpt-oss-20b on the CPU): on
    tiny-gpt-oss, pinned, rms_eps x 1.1 keeps every token and moves no logit past 1e-3 of
    their spread; a format that is not group=scheme is refused by name."""
    import route_chaos
    out = route_chaos.sensitivity("tiny-gpt-oss", {"experts": "fp4"}, True, 1.1)
    assert out["tokens"] == out["moved_tokens"] and len(out["tokens"]) == route_chaos.PROMPT
    assert out["max_change"] < 1e-3 * out["std"]
    with pytest.raises(SystemExit):
        route_chaos.main(["--preset", "tiny-gpt-oss", "--formats", "experts"])
    assert "each must be group=scheme" in capsys.readouterr().err


def test_a_failed_rows_error_keeps_where_in_the_checkout_it_failed():
    """An out-of-memory's last 400 characters name only jax's dispatch (gpt-oss-20b's first
    run on the v5e); the record keeps this checkout's last frames before them."""
    root = Path(tpu_models.__file__).resolve().parent.parent
    stderr = "\n".join([
        "Traceback (most recent call last):",
        f'  File "{root}/benchmarks/tpu_models.py", line 112, in run_row',
        "    params = mk.init_params(config, 0, formats)",
        f'  File "{root}/mk/model/checkpoint.py", line 100, in _random_stack',
        "    return quant.QuantWeight(jnp.asarray(data), jnp.asarray(scale), scheme)",
        '  File "/opt/jax/_src/dispatch.py", line 88, in apply_primitive',
        "    outs = fun(*args)",
        "ValueError: RESOURCE_EXHAUSTED: Attempting to allocate 3.10G. " + "x" * 500])
    said = tpu_models.failure(stderr)
    assert said.index("checkpoint.py\", line 100") < said.index("tpu_models.py\", line 112")
    assert "dispatch.py" not in said.split(" | ")[0] and said.endswith("x" * 50)
    assert tpu_models.failure("Killed") == "Killed"
