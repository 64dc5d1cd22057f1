"""Joint selection of weights and cache kind: the memory budget, the gates, the speed pick, the plan and its key.

The measurements are stubbed (quality by weights and kind, speed by a table) so each rule is tested on figures chosen
to exercise it; the quantization itself and the budget's bytes are real (the tiny model's)."""

import pytest

import runner.infer.select.autocache as autocache
import runner.infer.select.joint as jointselect
from runner.errors import InferenceError
from runner.infer.config.decoding import GenerateConfig
from runner.infer.loading.texts import load_text
from runner.infer.measure.timing import Summary
from runner.infer.quant.weights import estimate_weight_bytes, weight_bytes
from runner.infer.select.autocache import cache_plan_fields, select_cache_kind
from runner.infer.select.joint import choose_pair, pair_budget, select_weights_and_cache

MIB = 2**20
FAST = dict(cache_quality_prompt_len=12, cache_quality_decode_steps=2, cache_quality_windows=2,
            cache_quality_ppl_len=160, cache_auto_bench_steps=2, cache_auto_bench_prompt_len=8,
            cache_auto_bench_repeats=1, max_seq_len=256)


def _config(tmp_path, **settings) -> GenerateConfig:
    return GenerateConfig(cache_plan_path=str(tmp_path / "plans.json"),
                          **{**FAST, "cache_candidates": ["fp32", "q8_0"], **settings})


class Stubs:
    """Quality per (weights, kind) and decode tokens/s per pair, in place of the probes and the timing."""

    def __init__(self, monkeypatch, delta_nll: dict, speed: dict):
        self.delta_nll, self.speed, self.probed = delta_nll, speed, []
        monkeypatch.setattr(jointselect, "run_probe", self.run_probe)
        monkeypatch.setattr(jointselect, "compare", self.compare)
        self.real_time = autocache.time_decode_pairs  # cache-only selections (kind names) are really timed
        monkeypatch.setattr(autocache, "time_decode_pairs", self.time)  # the speed pick both selections share

    def run_probe(self, model, probe, kind):
        weights = _weights_of(model)
        self.probed.append((weights, kind))
        return (weights, kind)

    def compare(self, reference, candidate):
        if candidate[1] is None:
            return {}
        d = self.delta_nll[candidate]
        return {"delta_nll": d, "ppl_ratio": 1.0 + d, "mean_kl": d, "measured_bytes_per_token": 1.0}

    def time(self, pairs, prompt, steps, repeats, warmup=1, engine="eager", max_seq_len=None):
        if not set(pairs) <= set(self.speed):
            return self.real_time(pairs, prompt, steps, repeats, warmup, engine, max_seq_len)
        return {name: _timing(*self.speed[name]) for name in pairs}


def _weights_of(model) -> str:
    """none / int8 / int8-dynamic told apart by what their first projection stores."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    if not hasattr(weight, "__tensor_flatten__"):
        return "none"
    return "int8" if weight.act_quant_kwargs is None else "int8-dynamic"


def _timing(median, spread):
    class Timing:
        decode_tokens_per_s = Summary(median, median, spread, 3)
        ttft_s = Summary(0.01, 0.01, 0.0, 3)
    return Timing()


def _select(lm, config):
    return select_weights_and_cache(lm.model, lm.tokenizer, config, batch_size=1, identity=lm.fingerprint)


def test_the_memory_budget_counts_weights_and_cache(tiny_lm, tmp_path):
    config = _config(tmp_path, weight_candidates=["none", "int8"], memory_budget_mb=0.3)
    none_mib, int8_mib = weight_bytes(tiny_lm.model) / MIB, estimate_weight_bytes(tiny_lm.model, "int8") / MIB
    assert none_mib > 0.3 > int8_mib + 0.125  # the unquantized weights alone are over; int8 + an fp32 cache fit
    over = pair_budget(tiny_lm.model, "none", none_mib, "q8_0", config, 1)
    fits = pair_budget(tiny_lm.model, "int8", int8_mib, "fp32", config, 1)
    assert not over["fits"] and over["verdict"].startswith("over memory budget") and "weights 0.4" in over["verdict"]
    assert fits["fits"] and fits["total_mib"] == pytest.approx(int8_mib + 0.125)
    cache_bound = pair_budget(tiny_lm.model, "int8", int8_mib, "fp32", config.model_copy(
        update={"cache_budget_mb": 0.1}), 1)
    assert not cache_bound["fits"] and cache_bound["verdict"].startswith("over budget")  # the cache's own budget


def test_the_fastest_surviving_pair_is_chosen_and_the_plan_reused(tiny_lm, tmp_path, monkeypatch):
    stubs = Stubs(monkeypatch,
                  delta_nll={("int8", "fp32"): 0.001, ("int8", "q8_0"): 0.002, ("int8-dynamic", "fp32"): 0.2,
                             ("int8-dynamic", "q8_0"): 0.03},
                  speed={"int8 + fp32": (100.0, 1.0), "int8 + q8_0": (90.0, 1.0), "int8-dynamic + q8_0": (120.0, 1.0)})
    config = _config(tmp_path, weight_candidates=["none", "int8", "int8-dynamic"], memory_budget_mb=0.3)
    selection = _select(tiny_lm, config)
    rows = {(r["weights"], r["kind"]): r for r in selection.rows}
    assert not rows[("none", "fp32")]["fits"] and ("none", "fp32") not in stubs.probed  # over budget: not measured
    assert rows[("int8-dynamic", "fp32")]["verdict"].startswith("ΔNLL 0.2 > 0.05")  # the gate
    assert (selection.weights, selection.kind, selection.source) == ("int8-dynamic", "q8_0", "measured")
    assert rows[("int8-dynamic", "q8_0")]["verdict"] == "chosen: fastest beyond the spread"
    assert rows[("int8", "fp32")]["verdict"] == "passed gates, slower"
    assert rows[("int8", "q8_0")]["measured_weight_mib"] == pytest.approx(rows[("int8", "q8_0")]["weight_mib"])
    monkeypatch.setattr(jointselect, "measure_pairs", lambda *a, **k: pytest.fail("measured again"))
    again = _select(tiny_lm, config)
    assert again.reused and (again.weights, again.kind) == ("int8-dynamic", "q8_0") and again.key == selection.key


def test_ties_within_the_spread_go_to_quality_then_total_bytes(tiny_lm, tmp_path, monkeypatch):
    Stubs(monkeypatch, delta_nll={("int8", "fp32"): 0.001, ("int8", "q8_0"): 0.004},
          speed={"int8 + fp32": (100.0, 5.0), "int8 + q8_0": (98.0, 5.0)})
    quality = _select(tiny_lm, _config(tmp_path, weight_candidates=["int8"]))
    assert (quality.weights, quality.kind) == ("int8", "fp32")  # tied on speed, better ΔNLL
    size = _select(tiny_lm, _config(tmp_path / "b", weight_candidates=["int8"], cache_auto_tie_break="bytes"))
    assert (size.weights, size.kind) == ("int8", "q8_0")  # tied on speed, fewer total bytes


def test_no_surviving_pair_falls_back_to_the_unquantized_reference_if_it_fits(tiny_lm, tmp_path, monkeypatch):
    Stubs(monkeypatch, delta_nll={("int8", "fp32"): 0.5, ("int8", "q8_0"): 0.5}, speed={})
    selection = _select(tiny_lm, _config(tmp_path, weight_candidates=["int8"]))
    assert (selection.weights, selection.kind, selection.source) == ("none", "fp32", "gate_failed")
    with pytest.raises(InferenceError, match="the fallback, the reference none \\+ fp32, is over memory budget"):
        _select(tiny_lm, _config(tmp_path / "b", weight_candidates=["int8"], memory_budget_mb=0.3))
    with pytest.raises(InferenceError, match="no \\(weights, cache kind\\) pair fits .*the smallest, int8 \\+ q8_0"):
        _select(tiny_lm, _config(tmp_path / "c", weight_candidates=["none", "int8"], memory_budget_mb=0.01))


def test_choose_pair_without_benchmark_takes_the_first_survivor():
    config = GenerateConfig(weight_candidates=["int8"], cache_auto_benchmark=False)
    rows = [{"weights": "int8", "kind": "fp32", "passed": False, "verdict": "ΔNLL"},
            {"weights": "int4:g64", "kind": "q8_0", "passed": True, "verdict": "passed gates"}]
    assert choose_pair(rows, config, {})[:3] == ("int4:g64", "q8_0", "measured")


def test_the_key_covers_the_weight_candidates_and_cache_keys_stay_as_they_were(tiny_lm, tmp_path, monkeypatch):
    text = load_text("pydoc")
    plain = _config(tmp_path)
    fields = cache_plan_fields(tiny_lm.model, plain, tiny_lm.fingerprint, 1, text)
    assert "weight_candidates" not in fields["settings"] and "torchao" not in fields  # cache-only plans: same key
    joint = jointselect.joint_fields(tiny_lm.model, _config(tmp_path, weight_candidates=["int4"]),
                                     tiny_lm.fingerprint, 1, text)
    assert joint["settings"]["weight_candidates"] == ["int4:g64"] and joint["torchao"]  # canonical
    assert {k: v for k, v in joint["settings"].items() if k not in ("weight_candidates", "memory_budget_mb")} == \
        fields["settings"]
    Stubs(monkeypatch, delta_nll={("int8", "fp32"): 0.0, ("int8", "q8_0"): 0.0, ("int8-dynamic", "fp32"): 0.0,
                                  ("int8-dynamic", "q8_0"): 0.0},
          speed={"int8 + fp32": (1.0, 0.0), "int8 + q8_0": (1.0, 0.0), "int8-dynamic + fp32": (1.0, 0.0),
                 "int8-dynamic + q8_0": (1.0, 0.0)})
    keys = {_select(tiny_lm, _config(tmp_path, **change)).key for change in (
        {"weight_candidates": ["int8"]}, {"weight_candidates": ["int8", "int8-dynamic"]},
        {"weight_candidates": ["int8"], "memory_budget_mb": 10.0})}
    assert len(keys) == 3
    cache_only = select_cache_kind(tiny_lm.model, tiny_lm.tokenizer, plain, batch_size=1, identity=tiny_lm.fingerprint)
    assert cache_only.weights is None and cache_only.key not in keys


def test_memory_budget_alone_is_a_config_error():
    with pytest.raises(ValueError, match="memory_budget_mb bounds weights \\+ cache of the weight_candidates"):
        GenerateConfig(memory_budget_mb=100)
