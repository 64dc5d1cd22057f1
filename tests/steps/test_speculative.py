"""`mode: speculative` through the `run` command: exact greedy output, telemetry, speedup in the results."""

import json

import pytest

from tests.conftest import TINY_LLAMA, tiny_manifest
from tests.test_cli import run_cli

DRAFT = {**TINY_LLAMA, "num_hidden_layers": 1}  # different weights, same byte tokenizer


@pytest.mark.e2e
def test_speculative_greedy_equals_generate_and_reports_telemetry(tmp_path):
    prompts = '["hello hello hello", "abc abc abc abc"]'
    runs = f"""      - id: plain
        mode: generate
        generate: {{prompts: {prompts}, batch_size: 2, max_new_tokens: 12, temperature: 0}}
      - id: spec
        mode: speculative
        speculative: {{draft: {{config: {DRAFT}, device: cpu}}, prompts: {prompts}, batch_size: 2,
                      max_new_tokens: 12, temperature: 0, spec_k: 3, spec_k_adaptive: true}}
      - id: lookup
        mode: speculative
        speculative: {{draft: prompt-lookup, prompts: {prompts}, max_new_tokens: 12, temperature: 0}}
"""
    done = run_cli(tiny_manifest(tmp_path, runs), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    plain, spec, lookup = (json.loads((folder / "tiny" / r / "results.json").read_text())
                           for r in ("plain", "spec", "lookup"))
    expected = [r["token_ids"] for r in plain["prompts"]]
    assert [r["token_ids"] for r in spec["prompts"]] == expected  # greedy: the target's own output, any draft
    assert [r["token_ids"] for r in lookup["prompts"]] == expected
    metrics = spec["metrics"]
    assert metrics["draft_forwards"] > 0 and metrics["target_forwards"] > 0
    assert metrics["new_tokens"] == sum(len(t) for t in expected)
    assert 0.0 <= metrics["acceptance_rate"] <= 1.0 and metrics["speedup"] > 0 and metrics["predicted_speedup"] > 0
    assert lookup["metrics"]["draft_forwards"] == 0 and lookup["metrics"]["draft_cost_ratio"] == 0.0
    assert spec["telemetry"][0]["k_history"]  # k over time, per row

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    child = next(r for r in runs if r.info.run_name == "tiny/spec")
    assert child.data.metrics["acceptance_rate"] == metrics["acceptance_rate"]
    k_over_time = [m.value for m in client.get_metric_history(child.info.run_id, "spec_k")]
    assert k_over_time == [k for row in spec["telemetry"][0]["k_history"] for k in row] and len(k_over_time) > 1


@pytest.mark.e2e
def test_speculative_needs_its_block_and_reads_no_other(tmp_path):
    runs = """      - id: spec
        mode: speculative
        generate: {prompts: ["x"]}
"""
    done = run_cli("check", tiny_manifest(tmp_path, runs))
    assert done.returncode == 2 and "mode speculative reads the 'speculative' block: remove 'generate'" in done.stderr


@pytest.mark.slow
@pytest.mark.e2e
def test_a_draft_with_another_tokenizer_proposes_through_text(tmp_path):
    """SmolLM2 (49k vocabulary) as target, a tiny byte-tokenizer model as draft: the step maps through text and
    the output is the target's greedy output."""
    path = tmp_path / "m.yaml"
    path.write_text(f"""name: t
seed: 0
tracking: {{mlflow: false, runs_dir: {tmp_path / 'runs'}}}
targets:
  - name: smol
    model: {{id: zoo:smollm2-135m, device: cpu}}
    runs:
      - id: plain
        mode: generate
        generate: {{prompts: ["The capital of France is", "def add(a, b):"], batch_size: 2, max_new_tokens: 10,
                   temperature: 0}}
      - id: spec
        mode: speculative
        speculative: {{draft: {{config: {DRAFT}, device: cpu}}, prompts: ["The capital of France is",
                      "def add(a, b):"], batch_size: 2, max_new_tokens: 10, temperature: 0, spec_k: 3}}
""")
    done = run_cli(path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "another tokenizer" in done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    plain, spec = (json.loads((folder / "smol" / r / "results.json").read_text()) for r in ("plain", "spec"))
    assert [r["token_ids"] for r in spec["prompts"]] == [r["token_ids"] for r in plain["prompts"]]
    assert spec["metrics"]["draft_forwards"] > 0
