"""`mode: serve` end to end on the tiny model: points for our scheduler and both baselines on the same requests,
the tables, plots, the SLO verdict, MLflow, and greedy outputs that agree across systems."""

import json

import pandas as pd
import pytest
import torch
from transformers import AutoConfig

from runner.infer.cache.registry import estimate_cache_bytes
from tests.conftest import TINY_LLAMA, tiny_manifest
from tests.test_cli import run_cli

SERVE = """      - id: load
        mode: serve
        serve:
          arrival: poisson
          rate: [20, 200]
          num_requests: 6
          warmup_requests: 1
          prompt_tokens: {dist: uniform, min: 4, max: 24}
          output_tokens: {dist: uniform, min: 3, max: 8}
          data: text.txt
          slo: {ttft_ms: 60000, tpot_ms: 60000}
          max_batch_size: 4
          kv_blocks: 64
          block_size: 4
          cache_kinds: [fp32, q8_0]
          baselines: [static, transformers]
"""


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    done = run_cli(tiny_manifest(tmp, SERVE), cwd=tmp)
    folder = next((tmp / "runs").glob("*-t"))
    return done, folder / "tiny" / "load"


@pytest.mark.e2e
def test_every_system_serves_every_point_on_the_same_requests(serve_run):
    done, step = serve_run
    assert done.returncode == 0, done.stderr
    points = pd.read_csv(step / "serve_points.csv")
    assert len(points) == 2 * 3 * 2  # rates × systems × cache kinds
    ok = points[points["status"] == "ok"]
    not_run = points[points["status"] != "ok"]
    assert set(ok["system"]) == {"ours", "static", "transformers"}
    # transformers' continuous batching keeps its own float cache: the q8_0 points say why they did not run
    assert set(not_run["system"]) <= {"transformers"} and (not_run["cache_kind"] == "q8_0").all()
    assert (ok["completed"] == 6).all() and (ok["refused"] == 0).all()
    assert (ok["output_tokens_per_s"] > 0).all() and (ok["p90_ttft_ms"] >= ok["p50_ttft_ms"]).all()
    config = AutoConfig.for_model(**TINY_LLAMA)
    for _, ours in ok[ok["system"] == "ours"].iterrows():  # the pool's storage: some blocks, never past kv_blocks
        block_bytes = estimate_cache_bytes(config, ours["cache_kind"], 1, 4, torch.float32)
        assert 0 < ours["kv_allocated_mib"] * 2**20 <= 64 * block_bytes
    requests = pd.read_csv(step / "serve_requests.csv")
    assert len(requests) == len(ok) * 6
    per_request = requests.groupby(["x", "cache_kind", "id"])
    assert (per_request["prompt_tokens"].nunique() == 1).all(), "every system got the same prompts"
    assert (per_request["output_tokens"].nunique() == 1).all(), "and produced exactly the tokens asked"


@pytest.mark.e2e
def test_greedy_outputs_agree_between_our_scheduler_and_static_batching(serve_run):
    _, step = serve_run
    requests = pd.read_csv(step / "serve_requests.csv", dtype={"output_ids": str})
    ours = requests[requests["system"] == "ours"].set_index(["x", "cache_kind", "id"])["output_ids"]
    static = requests[requests["system"] == "static"].set_index(["x", "cache_kind", "id"])["output_ids"]
    assert len(ours) == len(static) == 2 * 2 * 6
    assert (ours.sort_index() == static.sort_index()).all()


@pytest.mark.e2e
def test_results_plots_and_the_slo_verdict_are_left(serve_run):
    done, step = serve_run
    results = json.loads((step / "results.json").read_text())
    assert results["max_rate_meeting_slo"]["ours/fp32"] == 200  # a one-minute SLO: every point meets it
    assert results["metrics"]["ours_fp32_x20.completed"] == 6
    metrics = results["metrics"]
    assert "ours_fp32_x20.ratio_static_throughput" in metrics
    best = max(v for k, v in metrics.items() if k.startswith("ours_") and k.endswith(".output_tokens_per_s"))
    assert metrics["max_output_tokens_per_s"] == best
    for name in ("latency_vs_rate.png", "throughput_vs_rate.png", "goodput_vs_rate.png",
                 "latency_distributions.png", "kv_blocks_over_time.png"):
        assert (step / name).stat().st_size > 1000, name
    assert "| system | cache_kind | x |" in done.stdout


COMPILED = """      - id: load
        mode: serve
        serve:
          arrival: poisson
          rate: 50
          num_requests: 5
          warmup_requests: 1
          prompt_tokens: {dist: uniform, min: 4, max: 24}
          output_tokens: {dist: uniform, min: 3, max: 8}
          data: text.txt
          max_batch_size: 4
          block_size: 4
          engines: [eager, compiled]
          cache_kinds: [q8_0, kivi4:g8:r16, kivi2:g8:r8:s2]
          baselines: none
"""


@pytest.mark.e2e
@pytest.mark.compile
def test_the_compiled_engine_is_an_axis_with_its_compile_time_and_no_recompiles(tmp_path):
    """engines: [eager, compiled]: the compiled points carry their compile seconds and 0 recompilations, give the
    eager scheduler's greedy tokens (KIVI too), and KIVI with sinks' compiled point says why it did not run."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    done = run_cli(tiny_manifest(tmp_path, COMPILED), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = next((tmp_path / "runs").glob("*-t")) / "tiny" / "load"
    points = pd.read_csv(step / "serve_points.csv").set_index(["system", "cache_kind"])
    compiled = points.loc[("ours-compiled", "q8_0")]
    assert compiled["status"] == "ok" and compiled["recompiles"] == 0 and compiled["compile_s"] > 0
    allocated = estimate_cache_bytes(AutoConfig.for_model(**TINY_LLAMA), "q8_0", int(compiled["slot_rows"]),
                                     int(compiled["slot_columns"]), torch.float32)
    assert compiled["slot_rows"] >= 4 and compiled["kv_allocated_mib"] * 2**20 == pytest.approx(allocated)
    kivi = points.loc[("ours-compiled", "kivi4:g8:r16")]
    assert kivi["status"] == "ok" and kivi["recompiles"] == 0 and kivi["compile_s"] > 0
    assert compiled["stagings"] == 0  # only KIVI waits for a block boundary
    assert compiled["shared_forwards"] == 0  # q8_0 K/V: the C++ step does not serve it, prompts are prefilled apart
    assert points.loc[("ours-compiled", "kivi2:g8:r8:s2"), "status"].startswith("not run: KIVI with sinks (s2)")
    assert (points.loc[[("ours", "q8_0"), ("ours", "kivi4:g8:r16"), ("ours", "kivi2:g8:r8:s2")], "status"]
            == "ok").all()
    requests = pd.read_csv(step / "serve_requests.csv", dtype={"output_ids": str})
    for kind in ("q8_0", "kivi4:g8:r16"):
        tokens = requests[requests["cache_kind"] == kind].set_index(["system", "id"])["output_ids"]
        assert (tokens.loc["ours-compiled"] == tokens.loc["ours"]).all(), kind
    metrics = json.loads((step / "results.json").read_text())["metrics"]
    assert "ours-compiled_q8_0_x50.ratio_eager_throughput" in metrics


WEIGHTS = """      - id: load
        mode: serve
        serve:
          arrival: constant
          rate: 100
          num_requests: 4
          prompt_tokens: {dist: uniform, min: 4, max: 16}
          output_tokens: 5
          data: text.txt
          slo: {ttft_ms: 60000}
          max_batch_size: 4
          quantizations: [none, int8]
          baselines: [static]
"""


@pytest.mark.e2e
def test_weight_quantizations_are_an_axis_each_served_by_every_system_on_its_weights(tmp_path):
    """quantizations: [none, int8]: the model is loaded again with int8 weights and every system serves both
    (fewer weight MiB for int8), the same requests; each series has its own metrics, SLO verdict and greedy
    agreement between our scheduler and static batching on the same weights."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    done = run_cli(tiny_manifest(tmp_path, WEIGHTS), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = next((tmp_path / "runs").glob("*-t")) / "tiny" / "load"
    points = pd.read_csv(step / "serve_points.csv").set_index(["system", "quantization"])
    assert sorted(points.index) == [("ours", "int8"), ("ours", "none"), ("static", "int8"), ("static", "none")]
    assert (points["status"] == "ok").all() and (points["completed"] == 4).all()
    mib = points["weight_mib"]
    assert mib[("ours", "int8")] == mib[("static", "int8")] < mib[("ours", "none")]
    requests = pd.read_csv(step / "serve_requests.csv", dtype={"output_ids": str})
    ids = requests.set_index(["system", "quantization", "id"])["output_ids"].sort_index()
    for weights in ("none", "int8"):
        assert (ids.loc["ours", weights] == ids.loc["static", weights]).all()
    results = json.loads((step / "results.json").read_text())
    assert results["max_rate_meeting_slo"] == {"ours/model": 100, "static/model": 100, "ours/model/int8": 100,
                                               "static/model/int8": 100}
    assert {"ours_model_x100.ratio_static_throughput",
            "ours_model_wint8_x100.ratio_static_throughput"} <= set(results["metrics"])


PREFIX = """      - id: load
        mode: serve
        serve:
          arrival: constant
          rate: 100
          num_requests: 3
          turns: 2
          prompt_tokens: 12
          output_tokens: 5
          data: text.txt
          max_batch_size: 4
          block_size: 4
          prefix_caching: true
          baselines: [static]
"""


@pytest.mark.e2e
def test_prefix_caching_serves_a_conversations_next_turn_from_the_last_ones_blocks(tmp_path):
    """turns: 2 with prefix_caching: turn 2 arrives when turn 1 has finished, and finds turn 1's full prompt blocks
    retained (12 tokens: 3 blocks of 4); its greedy tokens are still static batching's."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    done = run_cli(tiny_manifest(tmp_path, PREFIX), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = next((tmp_path / "runs").glob("*-t")) / "tiny" / "load"
    requests = pd.read_csv(step / "serve_requests.csv", dtype={"output_ids": str}).set_index(["system", "id"])
    ours = requests.loc["ours"]
    assert (ours["cached_prompt_tokens"] == [0, 12] * 3).all()  # ids: conversation × 2 + turn
    assert (requests.loc["static", "cached_prompt_tokens"] == 0).all()
    assert (ours["output_ids"] == requests.loc["static", "output_ids"]).all()
    metrics = json.loads((step / "results.json").read_text())["metrics"]
    assert metrics["ours_model_x100.cached_prompt_tokens"] == 36  # the point's hits, in MLflow too


SPECULATIVE = f"""      - id: load
        mode: serve
        serve:
          arrival: constant
          rate: 50
          num_requests: 4
          prompt_tokens: 24
          output_tokens: 24
          data: text.txt
          max_batch_size: 4
          block_size: 4
          cache_kinds: [fp32, kivi4:g8:r16]
          speculative: [none, prompt-lookup, draft]
          spec_k: 3
          draft: {{config: {TINY_LLAMA}, device: cpu}}
          baselines: [none]
"""


@pytest.mark.e2e
def test_prompt_lookup_speculation_is_an_axis_with_the_same_greedy_tokens(tmp_path):
    """speculative: [none, prompt-lookup, draft]: systems ours-lookup and ours-draft serve the same requests to the
    same greedy tokens as ours, with their drafts' acceptance in the point and MLflow (the draft is the target's
    twin: all accepted); a KIVI kind is a point not run, with the reason."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    done = run_cli(tiny_manifest(tmp_path, SPECULATIVE), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = next((tmp_path / "runs").glob("*-t")) / "tiny" / "load"
    points = pd.read_csv(step / "serve_points.csv").set_index(["system", "cache_kind"])
    assert 0 < points.loc[("ours-lookup", "fp32"), "acceptance"] <= 1
    assert points.loc[("ours-lookup", "kivi4:g8:r16"), "status"].startswith("not run: speculation")
    requests = pd.read_csv(step / "serve_requests.csv", dtype={"output_ids": str})
    fp32 = requests[requests["cache_kind"] == "fp32"].set_index(["system", "id"])
    assert (fp32.loc["ours-lookup", "output_ids"] == fp32.loc["ours", "output_ids"]).all()
    assert (fp32.loc["ours-draft", "output_ids"] == fp32.loc["ours", "output_ids"]).all()
    assert points.loc[("ours-draft", "fp32"), "acceptance"] == 1.0
    assert points.loc[("ours-draft", "fp32"), "drafted_tokens"] > 0
    assert points.loc[("ours-draft", "kivi4:g8:r16"), "status"].startswith("not run: speculation")
    metrics = json.loads((step / "results.json").read_text())["metrics"]
    assert metrics["ours-lookup_fp32_x50.acceptance"] == points.loc[("ours-lookup", "fp32"), "acceptance"]
    assert metrics["ours-lookup_fp32_x50.ratio_eager_throughput"] > 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.e2e
def test_an_endpoint_launched_by_the_step_serves_the_same_load_over_http(tmp_path):
    """`endpoints:` with `launch`: the step starts `run serve` on its own manifest, sends it the same seeded load
    over HTTP, stops it after; the HTTP system's greedy tokens are the in-process scheduler's, its prompt counts the
    server's own."""
    port = _free_port()
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    runs = f"""      - id: load
        mode: serve
        serve:
          rate: 50
          num_requests: 5
          prompt_tokens: {{dist: uniform, min: 4, max: 24}}
          output_tokens: 6
          data: text.txt
          max_batch_size: 4
          baselines: [none]
          endpoints:
            - name: ours-http
              url: http://127.0.0.1:{port}
              model: tiny
              prompt_format: token_ids
              launch: ["{{python}}", -m, runner, serve, -q, "{{manifest_dir}}/m.yaml", --port, "{port}"]
"""
    done = run_cli(tiny_manifest(tmp_path, runs), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = next((tmp_path / "runs").glob("*-t")) / "tiny" / "load"
    points = pd.read_csv(step / "serve_points.csv").set_index("system")
    assert points.loc["ours-http", "status"] == "ok" and points.loc["ours-http", "completed"] == 5
    assert points.loc["ours-http", "prompt_tokens_mismatched"] == 0
    assert points.loc["ours-http", "prompt_tokens_unchecked"] == 0
    requests = pd.read_csv(step / "serve_requests.csv", dtype={"output_ids": str}).set_index(["system", "id"])
    assert (requests.loc["ours-http", "output_tokens"] == 6).all()
    assert (requests.loc["ours-http", "output_ids"] == requests.loc["ours", "output_ids"]).all()
    assert "serving tiny at http://127.0.0.1" in (step / "endpoint-ours-http.log").read_text()
