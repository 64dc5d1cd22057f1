"""auto cache selection: budget filter, each gate, the on-fail policy, plan reuse and staleness."""

import json

import pytest
import torch

import runner.infer.select.autocache as autocache
from runner.errors import InferenceError
from runner.infer.cache.layers import Q8_0Layer
from runner.infer.config.decoding import GenerateConfig
from runner.infer.generation.generator import Generator
from runner.infer.select.autocache import choose, gate_failures, select_cache_kind

FAST = dict(cache_quality_prompt_len=12, cache_quality_decode_steps=2, cache_quality_windows=2,
            cache_quality_ppl_len=160, cache_auto_bench_steps=2, cache_auto_bench_prompt_len=8,
            cache_auto_bench_repeats=1, max_seq_len=256)


def _config(tmp_path, **settings) -> GenerateConfig:
    return GenerateConfig(cache_plan_path=str(tmp_path / "plans.json"), **{**FAST, **settings})


def _select(lm, config, batch_size=1):
    return select_cache_kind(lm.model, lm.tokenizer, config, batch_size=batch_size, identity=lm.fingerprint)


@pytest.mark.parametrize("gate, metrics", [
    ("ΔNLL", {"delta_nll": 0.2, "ppl_ratio": 1.0, "mean_kl": 0.0}),
    ("PPL ratio", {"delta_nll": 0.0, "ppl_ratio": 1.2, "mean_kl": 0.0}),
    ("mean KL", {"delta_nll": 0.0, "ppl_ratio": 1.0, "mean_kl": 0.5}),
    ("ΔNLL", {"delta_nll": float("nan"), "ppl_ratio": 1.0, "mean_kl": 0.0}),
])
def test_each_gate_fails_for_its_own_reason(gate, metrics):
    config = GenerateConfig(cache_quality_max_delta_nll=0.05, cache_quality_max_ppl_ratio=1.05,
                            cache_quality_max_mean_kl=0.1)
    (failure,) = gate_failures(metrics, config)
    assert failure.startswith(gate + " ")
    assert gate_failures({"delta_nll": 0.05, "ppl_ratio": 1.05, "mean_kl": 0.1}, config) == []  # limits inclusive


def test_budget_drops_kinds_that_do_not_fit(tiny_lm, tmp_path):
    # tiny llama: 2 layers × K,V × 2 heads × head_dim 16 → fp32 512 B/token; at 256 tokens: 0.125 MiB.
    selection = _select(tiny_lm, _config(tmp_path, cache_candidates=["fp32", "q8_0", "q4_0"], cache_budget_mb=0.1,
                                         cache_quality_max_mean_kl=10, cache_quality_max_delta_nll=10,
                                         cache_quality_max_ppl_ratio=10))
    rows = {row["kind"]: row for row in selection.rows}
    assert rows["fp32"]["verdict"].startswith("over budget") and "delta_nll" not in rows["fp32"]
    assert selection.kind in {"q8_0", "q4_0"} and selection.source == "measured" and not selection.reused
    assert all(rows[k]["estimated_mib"] <= 0.1 and rows[k]["tokens_per_s"] > 0 for k in ("q8_0", "q4_0"))


def test_nothing_fits_is_a_clear_error(tiny_lm, tmp_path):
    with pytest.raises(InferenceError, match=r"no cache kind fits cache_budget_mb=0.001 .*the smallest, q4_0"):
        _select(tiny_lm, _config(tmp_path, cache_candidates=["fp16", "q4_0"], cache_budget_mb=0.001))


def test_a_candidate_made_to_fail_the_kl_gate_fails_it(tiny_lm, tmp_path):
    config = _config(tmp_path, cache_candidates=["q4_0", "fp32"], cache_quality_max_mean_kl=0.0,
                     cache_quality_max_delta_nll=10, cache_quality_max_ppl_ratio=10)
    selection = _select(tiny_lm, config)
    rows = {row["kind"]: row for row in selection.rows}
    assert not rows["q4_0"]["passed"] and rows["q4_0"]["verdict"].startswith("mean KL")
    assert rows["fp32"]["passed"] and selection.kind == "fp32"  # the model's own dtype: KL exactly 0


def test_out_of_memory_in_one_candidate_rejects_only_that_one(tiny_lm, tmp_path, monkeypatch):
    """Fault injection (a CPU cannot be made to run out of memory on cue): the q8_0 probe raises OOM."""
    real_probe = autocache.run_probe

    def probe(model, probe, kind):
        if kind == "q8_0":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_probe(model, probe, kind)

    monkeypatch.setattr(autocache, "run_probe", probe)
    selection = _select(tiny_lm, _config(tmp_path, cache_candidates=["q8_0", "fp16"]))
    rows = {row["kind"]: row for row in selection.rows}
    assert not rows["q8_0"]["passed"]
    assert rows["q8_0"]["verdict"] == "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rows["fp16"]["passed"] and selection.kind == "fp16"


def test_no_survivor_follows_the_on_fail_policy(tiny_lm, tmp_path):
    strict = dict(cache_candidates=["q4_0", "nf4"], cache_quality_max_mean_kl=0.0)
    config = _config(tmp_path, **strict, cache_quality_on_fail="reference")
    selection = _select(tiny_lm, config)
    assert (selection.kind, selection.source, selection.reused) == ("fp32", "gate_failed", False)
    reused = _select(tiny_lm, config)
    assert (reused.kind, reused.source, reused.reused) == ("fp32", "gate_failed", True)  # a reused plan keeps it
    with pytest.raises(InferenceError, match="no cache kind passed the quality gates .*q4_0: mean KL"):
        _select(tiny_lm, _config(tmp_path / "other", **strict, cache_quality_on_fail="error"))
    # the fallback must fit the budget too: fp32 needs 0.125 MiB at 256 tokens
    with pytest.raises(InferenceError, match="the fallback, the reference fp32, is over budget"):
        _select(tiny_lm, _config(tmp_path / "third", **strict, cache_budget_mb=0.1))


def test_a_fresh_plan_is_reused_without_measuring(tiny_lm, tmp_path, monkeypatch):
    config = _config(tmp_path, cache_candidates=["fp32", "q8_0"])
    first = _select(tiny_lm, config)
    monkeypatch.setattr(autocache, "measure_candidates", _must_not_measure)
    second = _select(tiny_lm, config)
    assert second.reused and second.kind == first.kind and second.key == first.key
    assert second.rows == first.rows
    with pytest.raises(AssertionError, match="measured"):  # anything that changes the answer changes the key
        _select(tiny_lm, config.model_copy(update={"cache_budget_mb": 100.0}))
    with pytest.raises(AssertionError, match="measured"):
        _select(tiny_lm, config, batch_size=2)
    for change in ({"cache_quality_max_mean_kl": 0.2}, {"cache_quality_data": str(_text_file(tmp_path))},
                   {"cache_candidates": ["q8_0"]}, {"max_seq_len": 512}):
        with pytest.raises(AssertionError, match="measured"):
            _select(tiny_lm, config.model_copy(update=change))
    assert _select(tiny_lm, config.model_copy(update={"cache_candidates": ["fp32", "q8"]})).reused  # alias, same key


def test_a_stale_plan_is_measured_again_only_when_probing(tiny_lm, tmp_path, monkeypatch):
    config = _config(tmp_path, cache_candidates=["fp32", "q8_0"], cache_plan_probe_interval_sec=1e-6)
    _select(tiny_lm, config)
    assert not _select(tiny_lm, config).reused  # older than 1 µs: stale, measured again
    monkeypatch.setattr(autocache, "measure_candidates", _must_not_measure)
    assert _select(tiny_lm, config.model_copy(update={"cache_plan_probe": False})).reused


def test_generator_with_auto_selects_then_decodes(tiny_lm, tmp_path):
    config = _config(tmp_path, cache_kind="auto", cache_candidates=["q8_0"], cache_quality_max_mean_kl=10,
                     max_new_tokens=4, temperature=0)
    gen = Generator(tiny_lm.model, config=config, tokenizer=tiny_lm.tokenizer)
    prompt = tiny_lm.tokenizer(["hello"], return_tensors="pt").input_ids
    out = gen.generate(prompt)
    assert out.shape[1] == prompt.shape[1] + 4 and gen.selection.kind == "q8_0"
    assert isinstance(gen.cache.layers[0], Q8_0Layer)
    first = gen.selection
    gen.reset()
    gen.generate(prompt.repeat(2, 1))  # another batch size: the budget differs, so it is selected again
    assert gen.selection is not first and gen.selection.fields["batch_size"] == 2
    with pytest.raises(ValueError, match="tokenizer"):
        Generator(tiny_lm.model, config=config)


def test_choose_takes_the_fastest_survivor_or_the_first_without_benchmark(tmp_path):
    rows = [{"kind": "fp16", "passed": True, "tokens_per_s": 10.0}, {"kind": "q8_0", "passed": False},
            {"kind": "nf4", "passed": True, "tokens_per_s": 12.0},
            {"kind": "q4_0", "passed": True, "tokens_per_s": 9.0}]
    reference = {"kind": "fp32", "fits": True, "verdict": ""}
    assert choose(rows, GenerateConfig(), reference)[:2] == ("nf4", "measured")
    assert choose(rows, GenerateConfig(cache_auto_benchmark=False), reference)[:2] == ("fp16", "measured")


def test_a_speed_difference_within_the_spread_is_a_tie_broken_by_quality_then_bytes():
    def rows():
        return [{"kind": "fp16", "passed": True, "tokens_per_s": 14.0, "tokens_per_s_spread": 3.0, "delta_nll": 0.0,
                 "estimated_mib": 8.0},
                {"kind": "q8_0", "passed": True, "tokens_per_s": 12.1, "tokens_per_s_spread": 2.5, "delta_nll": 0.01,
                 "estimated_mib": 2.1},
                {"kind": "q4_0", "passed": True, "tokens_per_s": 9.0, "tokens_per_s_spread": 0.5, "delta_nll": 0.04,
                 "estimated_mib": 1.1}]
    reference = {"kind": "fp32", "fits": True, "verdict": ""}
    quality = rows()
    kind, _, reason = choose(quality, GenerateConfig(), reference)
    assert kind == "fp16" and "2 candidates tied on speed within the spread" in reason and "best quality" in reason
    assert [r["speed_verdict"] for r in quality] == ["tied", "tied", "slower"]  # 14 − 9 > 3: q4_0 is slower
    assert quality[0]["verdict"] == "chosen: tied on speed within the spread, best quality"
    smallest = rows()
    assert choose(smallest, GenerateConfig(cache_auto_tie_break="bytes"), reference)[0] == "q8_0"
    apart = rows()
    apart[0]["tokens_per_s_spread"] = apart[1]["tokens_per_s_spread"] = 0.5  # 14 vs 12.1, spreads 0.5: a real gap
    kind, _, reason = choose(apart, GenerateConfig(cache_auto_tie_break="bytes"), reference)
    assert kind == "fp16" and "beyond the others' spread" in reason
    assert apart[0]["verdict"] == "chosen: fastest beyond the spread"


def _text_file(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text("A different evaluation text, long enough for every probe. " * 80)
    return path


def _must_not_measure(*args, **kwargs):
    raise AssertionError("measured although a fresh plan exists")


def test_probes_longer_than_max_seq_len_name_the_settings(tiny_lm, tmp_path):
    with pytest.raises(InferenceError,
                       match=r"cache_quality_prompt_len \+ cache_quality_decode_steps \+ 1 = 303 exceed"):
        _select(tiny_lm, _config(tmp_path, cache_quality_prompt_len=300))
    with pytest.raises(InferenceError, match="raise cache_quality_ppl_len"):  # the needle probe needs ~100 byte tokens
        _select(tiny_lm, _config(tmp_path, cache_quality_ppl_len=60))


def test_candidates_are_spelled_one_way_and_unknown_kinds_are_schema_errors():
    from pydantic import ValidationError

    from runner.infer.select.autocache import candidates

    config = GenerateConfig(cache_candidates=["q8", "q8_0", "kivi4:g64", "kivi2"])
    assert candidates(config) == ["q8_0", "kivi4:g64:r64", "kivi2:g32:r32"]  # options recorded in the plan
    with pytest.raises(ValidationError, match="did you mean 'kivi4'"):
        GenerateConfig(cache_kind="kiv4")
    with pytest.raises(ValidationError, match="residual length must be a positive multiple"):
        GenerateConfig(cache_candidates=["kivi4:g32:r48"])


@pytest.fixture
def static_engine(tiny_lm, monkeypatch):
    """tiny_lm's compiled engine running its static step uncompiled (as in test_compiled.py)."""
    from runner.infer.compiled import engine as compiled

    engine = compiled.CompiledEngine(tiny_lm.model, compile=False)
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, engine)
    return engine


def test_the_speed_pick_times_on_the_engine_the_run_decodes_with(tiny_lm, tmp_path, static_engine):
    config = _config(tmp_path, cache_candidates=["fp32", "q8_0", "kivi4:g8:r16:o1"], cache_quality_max_mean_kl=10,
                     cache_quality_max_delta_nll=10, cache_quality_max_ppl_ratio=10, engine="compiled")
    selection = _select(tiny_lm, config)
    rows = {row["kind"]: row for row in selection.rows}
    assert selection.fields["settings"]["engine"] == "compiled"
    for kind in ("fp32", "q8_0", "kivi4:g8:r16:o1"):  # timed on static states of the engine (KIVI options too),
        row = rows[kind]  # each shape prepared before the timing
        assert row["timed_on"] == "compiled" and row["compile_s"] >= 0 and row["tokens_per_s"] > 0, row
        assert any(key[0] == kind for key in static_engine.warm)
    assert static_engine.stats.recompiles == 0
    eager = _select(tiny_lm, config.model_copy(update={"engine": "eager"}))
    assert eager.key != selection.key and not eager.reused  # the engine is part of the plan's key
    assert {row.get("timed_on") for row in eager.rows if row.get("tokens_per_s")} == {"eager"}
    assert all("compile_s" not in row for row in eager.rows)


@pytest.mark.compile
def test_the_speed_pick_on_the_compiled_engine_compiles_before_timing_and_never_recompiles(tmp_path):
    """Really compiles two shapes (fp32 and q8_0 at batch 1): about a minute each on two loaded cores; fp32's step
    is the native C++ one where the kernels are built (nothing compiled: 0 s)."""
    from runner.infer.compiled import engine as compiled
    from runner.infer.loading.models import load_model
    from tests.conftest import TINY_LLAMA

    lm = load_model(config=TINY_LLAMA, device="cpu", seed=2)  # its own model object: its own compiled engine
    config = _config(tmp_path, cache_candidates=["fp32", "q8_0"], cache_quality_max_mean_kl=10,
                     cache_quality_max_delta_nll=10, cache_quality_max_ppl_ratio=10, engine="compiled",
                     cache_auto_bench_repeats=3)
    selection = _select(lm, config)
    stats = compiled.engine_for(lm.model).stats
    native = compiled.engine_for(lm.model).native is not None
    assert all(row["timed_on"] == "compiled" for row in selection.rows)
    assert {row["kind"]: row["compile_s"] > 0 for row in selection.rows} == {"fp32": not native, "q8_0": True}
    assert stats.recompiles == 0 and sorted(key[0] for key in stats.compile_s) == ["fp32", "q8_0"]
    assert {row["speed_verdict"] for row in selection.rows} <= {"fastest", "tied", "slower"}


def _stored(path):
    doc = json.loads(path.read_text())
    (key,) = doc["plans"]
    return doc, key


@pytest.mark.parametrize("change, problem", [
    (lambda p: p.update(kind="fp12"), "unknown cache kind 'fp12': "),
    (lambda p: p.pop("rows"), "rows missing or of the wrong type"),
    (lambda p: p.update(source="guessed"), "source 'guessed' is neither 'measured' nor 'gate_failed'"),
    (lambda p: p["rows"][0].pop("passed"), "row 0 lacks kind, passed, verdict"),
    (lambda p: p["rows"][1].update(estimated_mib="lots"), "row 1: estimated_mib not a number"),
    (lambda p: p.update(kind="q4_0"), "the chosen kind 'q4_0' has no passing row"),
])
def test_a_reused_plan_that_does_not_fit_is_measured_again_with_a_warning(tiny_lm, tmp_path, monkeypatch, caplog,
                                                                         change, problem):
    config = _config(tmp_path, cache_candidates=["fp32", "q8_0"], cache_quality_max_mean_kl=10,
                     cache_auto_benchmark=False)  # the first passing: the same choice each time
    first = _select(tiny_lm, config)
    doc, key = _stored(tmp_path / "plans.json")
    change(doc["plans"][key])
    (tmp_path / "plans.json").write_text(json.dumps(doc))
    measured = []
    real = autocache.measure_candidates
    monkeypatch.setattr(autocache, "measure_candidates", lambda *a, **k: measured.append(1) or real(*a, **k))
    with caplog.at_level("WARNING", logger="runner.infer.select.cache_plans"):
        second = _select(tiny_lm, config)
    assert measured == [1] and not second.reused and second.kind == first.kind
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    prefix = f"cache plan {key[:12]} in {tmp_path / 'plans.json'} is unusable ({problem}"
    assert message.startswith(prefix) and message.endswith("): measuring again")
    assert f"(cache plan {key[:12]} was unusable ({problem}" in second.reason
    assert autocache.cache_plan_problem(_stored(tmp_path / "plans.json")[0]["plans"][key]) == ""  # replaced
