"""`mode: bench` end to end on the tiny model: the table, a failing cell, plots, MLflow; and its pure parts."""

import math

import pandas as pd
import pytest

from runner.manifest.blocks import BenchBlock
from runner.steps.bench import matrix, metric_name, metrics, with_spec_speedup
from runner.steps.shared import markdown
from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

BENCH = """      - id: matrix
        mode: bench
        bench:
          batch_sizes: [1, 2]
          prompt_lens: [12, 5000]      # 5000 does not fit the 1200-character text: that cell fails
          max_new_tokens: 4
          cache_kinds: [fp32, q8]
          repeats: 2
          data: text.txt
          speculative: {draft: prompt-lookup, spec_k: 2}
"""


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 27)
    path = tiny_manifest(tmp, BENCH)
    done = run_cli(path, cwd=tmp)
    folder = next((tmp / "runs").glob("*-t"))
    return tmp, done, folder / "tiny" / "matrix"


def test_every_cell_is_a_row_and_a_bad_cell_only_fails_itself(bench_run):
    _, done, step = bench_run
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(step / "bench.csv")
    assert len(table) == 2 * 2 * 2 * 2  # batch × prompt_len × kind × speculative
    failed = table[table["status"] == "failed"]
    assert set(failed["prompt_len"]) == {5000} and len(failed) == 8
    assert failed["error"].str.contains("5000").all()
    ok = table[table["status"] == "ok"]
    plain = ok[ok["speculative"] == "off"]
    assert (plain["ours_tokens_per_s"] > 0).all() and (plain["hf_tokens_per_s"] > 0).all()
    assert (plain["ratio_tokens_per_s"] - plain["ours_tokens_per_s"] / plain["hf_tokens_per_s"]).abs().max() < 1e-9
    assert (plain["ours_ttft_ms"] > 0).all() and (plain["ours_itl_ms_p90"] >= plain["ours_itl_ms"]).all()
    q8, fp32 = plain[plain["cache_kind"] == "q8"], plain[plain["cache_kind"] == "fp32"]
    assert (q8["ours_kv_mib"].to_numpy() < fp32["ours_kv_mib"].to_numpy()).all()
    spec = ok[ok["speculative"] == "on"]
    assert spec["spec_speedup"].notna().all() and spec["ours_acceptance"].between(0, 1).all()
    assert spec[spec["batch"] == 2]["hf_error"].str.startswith("n/a above batch 1").all()
    assert spec[spec["batch"] == 2]["ours_batched"].all() and not spec[spec["batch"] == 1]["ours_batched"].any()


def test_markdown_table_and_plots_are_left(bench_run):
    _, done, step = bench_run
    assert "| dtype | cache_kind | speculative | batch |" in done.stdout
    for name in ("throughput_vs_batch.png", "latency_vs_prompt_len.png"):
        assert (step / name).stat().st_size > 10_000


def test_metrics_reach_mlflow_with_their_spread(bench_run):
    from runner.execute.results import Store

    tmp, _, _ = bench_run
    store = Store(None, str(tmp / "runs"))
    (run,) = [r for r in store.runs() if r.data.tags.get("runner.mode") == "bench"]
    metrics = run.data.metrics
    assert metrics["cells"] == 16 and metrics["cells_failed"] == 8
    assert metrics["b1_p12_n4_q8_float32.ours_tokens_per_s"] > 0
    assert "b1_p12_n4_q8_float32.ours_tokens_per_s_spread" in metrics
    assert metrics["bandwidth_gbs"] > 0


def test_matrix_groups_cells_by_dtype_and_defaults_to_the_dtype_kind():
    spec = BenchBlock(batch_sizes=[1, 4], prompt_lens=64, max_new_tokens=[8, 16], dtypes=["bfloat16", "float32"])
    cells = matrix(spec, "float32")
    assert len(cells) == 2 * 2 * 2
    assert [c["dtype"] for c in cells] == ["bfloat16"] * 4 + ["float32"] * 4
    assert {c["cache_kind"] for c in cells if c["dtype"] == "bfloat16"} == {"bf16"}
    assert {c["cache_kind"] for c in cells if c["dtype"] == "float32"} == {"fp32"}


def test_spec_speedup_is_over_the_same_cell_without_speculation():
    base = {"dtype": "float32", "cache_kind": "fp32", "batch": 1, "prompt_len": 8, "new_tokens": 4,
            "engine": "eager"}
    table = with_spec_speedup(pd.DataFrame([
        {**base, "speculative": "off", "ours_tokens_per_s": 100.0},
        {**base, "speculative": "on", "ours_tokens_per_s": 150.0},
        {**base, "prompt_len": 16, "speculative": "on", "ours_tokens_per_s": 90.0}]))
    assert table["spec_speedup"].iloc[1] == 1.5
    assert math.isnan(table["spec_speedup"].iloc[0]) and math.isnan(table["spec_speedup"].iloc[2])


def test_metric_names_are_mlflow_safe_and_failed_cells_are_counted():
    row = {"batch": 2, "prompt_len": 8, "new_tokens": 4, "cache_kind": "kivi4:g32:r32", "dtype": "float16",
           "speculative": "off", "status": "ok", "ours_tokens_per_s": 5.0, "ours_tokens_per_s_spread": 0.5}
    assert metric_name(row) == "b2_p8_n4_kivi4-g32-r32_float16"
    out = metrics(pd.DataFrame([row, {**row, "batch": 4, "status": "failed"}]), bandwidth=None)
    assert out == {"cells": 2.0, "cells_failed": 1.0, "b2_p8_n4_kivi4-g32-r32_float16.ours_tokens_per_s": 5.0,
                   "b2_p8_n4_kivi4-g32-r32_float16.ours_tokens_per_s_spread": 0.5}


def test_markdown_rounds_and_marks_missing_values():
    text = markdown(pd.DataFrame([{"kind": "q8|0", "tokens_per_s": 1234.56, "ratio": 0.98765, "x": float("nan")}]))
    assert text.splitlines() == ["| kind | tokens_per_s | ratio | x |", "|---|---|---|---|",
                                 "| q8\\|0 | 1235 | 0.988 | - |"]


@pytest.mark.e2e
def test_each_dtype_reloads_the_model_and_halves_the_native_cache(tmp_path):
    runs = """      - id: dtypes
        mode: bench
        bench: {batch_sizes: 1, prompt_lens: 16, max_new_tokens: 3, dtypes: [float32, bfloat16], repeats: 1,
                baseline: none, roofline: false}
"""
    done = run_cli(tiny_manifest(tmp_path, runs), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "loading config model as bfloat16" in done.stderr
    table = pd.read_csv(next((tmp_path / "runs").glob("*-t")) / "tiny" / "dtypes" / "bench.csv")
    assert list(table["cache_kind"]) == ["fp32", "bf16"] and (table["status"] == "ok").all()
    assert "hf_tokens_per_s" not in table and "ours_bw_fraction" not in table
    assert table["ours_kv_mib"].iloc[1] * 2 == pytest.approx(table["ours_kv_mib"].iloc[0])


def test_engines_are_an_axis_and_engine_is_one_of_them():
    spec = BenchBlock.model_validate({"engine": "compiled", "cache_kinds": ["fp32", "q8_0"],
                                     "baseline": ["hf", "hf-compiled"]})
    assert spec.engines == ["compiled"] and spec.baseline == ["hf", "hf-compiled"]
    cells = matrix(BenchBlock.model_validate({"engines": ["eager", "compiled"], "baseline": "none"}), "float32")
    assert [c["engine"] for c in cells] == ["eager", "compiled"]
    with pytest.raises(ValueError, match="not both"):
        BenchBlock.model_validate({"engine": "compiled", "engines": ["eager"]})
    assert BenchBlock.model_validate({"engines": ["compiled"], "cache_kinds": ["kivi4"]}).cache_kinds == ["kivi4"]


@pytest.mark.e2e
def test_quantizations_are_an_axis_with_weight_and_total_bytes(tmp_path):
    runs = """      - id: weights
        mode: bench
        bench: {batch_sizes: 1, prompt_lens: 16, max_new_tokens: 3, quantizations: [none, int8, int4:g32],
                dtypes: [float32, bfloat16], repeats: 1, baseline: hf, roofline: false}
"""
    done = run_cli(tiny_manifest(tmp_path, runs), "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "with int8 weights" in done.stderr and "| quantization | weight_mib | ours_total_mib |" in done.stdout
    table = pd.read_csv(next((tmp_path / "runs").glob("*-t")) / "tiny" / "weights" / "bench.csv")
    assert list(table["quantization"]) == ["none", "int8", "int4:g32"] * 2
    failed = table[table["status"] != "ok"]  # int4 in float32: those cells fail with the reason, the others run
    assert list(failed["dtype"]) == ["float32"] and failed["error"].str.contains("runs in bfloat16").all()
    ok = table[table["status"] == "ok"].set_index(["dtype", "quantization"])["weight_mib"]
    assert ok["float32", "none"] > 3 * ok["float32", "int8"]  # float32 → int8
    assert ok["bfloat16", "none"] > ok["bfloat16", "int8"] > ok["bfloat16", "int4:g32"] > 0
    assert (table["ours_total_mib"] - table["weight_mib"] - table["ours_kv_mib"]).abs().max() < 1e-9
    assert (table[table["status"] == "ok"]["hf_tokens_per_s"] > 0).all()  # generate() runs quantized weights too
    assert metric_name(table.iloc[1].to_dict()) == "b1_p16_n3_fp32_float32_wint8"
