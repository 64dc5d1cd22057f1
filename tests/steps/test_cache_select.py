"""`mode: auto-cache-select` and `cache_kind: auto` through the `run` command: table, plot, plan, MLflow."""

import json

import pytest

from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

SETTINGS = ("cache_candidates: [fp32, q8_0, q4_0], max_seq_len: 256, cache_quality_prompt_len: 12, "
            "cache_quality_decode_steps: 2, cache_quality_windows: 2, cache_quality_ppl_len: 160, "
            "cache_auto_bench_steps: 2, cache_auto_bench_prompt_len: 8, cache_auto_bench_repeats: 1, "
            "cache_quality_max_mean_kl: 10, cache_quality_max_delta_nll: 10, cache_quality_max_ppl_ratio: 10, "
            "cache_budget_mb: 0.1, cache_plan_path: {plans}")


def _runs(plans) -> str:
    settings = SETTINGS.format(plans=plans)
    return f"""      - id: pick
        mode: auto-cache-select
        generate: {{{settings}}}
      - id: use
        mode: generate
        generate: {{prompts: ["hello"], max_new_tokens: 4, temperature: 0, cache_kind: auto, {settings}}}
"""


@pytest.mark.e2e
def test_selection_is_tabled_plotted_persisted_and_reused(tmp_path):
    plans = tmp_path / "plans" / "cache_plans.json"
    done = run_cli(tiny_manifest(tmp_path, _runs(plans)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    pick = json.loads((folder / "tiny" / "pick" / "results.json").read_text())
    chosen = pick["selection"]["kind"]
    assert chosen in {"q8_0", "q4_0"} and pick["selection"]["source"] == "measured"  # fp32 is over budget
    assert not pick["selection"]["reused"] and pick["selection"]["fields"]["batch_size"] == 1
    for name in ("cache_candidates.csv", "cache_candidates.png", "cache_plan.json"):
        assert (folder / "tiny" / "pick" / name).stat().st_size > 0
    table = (folder / "tiny" / "pick" / "cache_candidates.csv").read_text()
    assert table.startswith("kind,est MiB,meas MiB,ΔNLL") and "over budget" in table
    assert "ΔNLL" in done.stdout and "verdict" in done.stdout  # the table is printed
    stored = json.loads(plans.read_text())["plans"]
    assert list(stored) == [pick["selection"]["key"]] and stored[pick["selection"]["key"]]["kind"] == chosen

    use = json.loads((folder / "tiny" / "use" / "results.json").read_text())  # same settings: plan reused
    assert use["cache_selection"]["reused"] and use["cache_selection"]["kind"] == chosen
    assert use["metrics"]["new_tokens"] == 4

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    child = next(r for r in runs if r.info.run_name == "tiny/pick")
    assert child.data.params["cache_kind.chosen"] == chosen
    assert child.data.metrics[f"{chosen}.estimated_mib"] <= 0.1
    assert {"cache_candidates.png", "cache_plan.json"} <= {a.path for a in client.list_artifacts(child.info.run_id)}


@pytest.mark.e2e
def test_nothing_within_budget_fails_the_step_clearly(tmp_path):
    runs = _runs(tmp_path / "plans.json").replace("cache_budget_mb: 0.1", "cache_budget_mb: 0.0001")
    done = run_cli(tiny_manifest(tmp_path, runs), "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "no cache kind fits cache_budget_mb=0.0001" in done.stderr


@pytest.mark.e2e
def test_a_fixed_cache_kind_in_auto_cache_select_is_a_schema_error(tmp_path):
    runs = _runs(tmp_path / "plans.json").replace("mode: auto-cache-select\n        generate: {",
                                                  "mode: auto-cache-select\n        generate: {cache_kind: q8_0, ")
    done = run_cli("check", tiny_manifest(tmp_path, runs))
    assert done.returncode == 2 and "chooses the cache kind itself" in done.stderr


@pytest.mark.e2e
def test_a_plan_that_cannot_be_saved_keeps_every_measurement(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    plans = tmp_path / "a-file" / "cache_plans.json"  # its folder cannot be made
    runs = _runs(plans).split("      - id: use")[0]
    done = run_cli(tiny_manifest(tmp_path, runs), "tracking.mlflow=false", cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "the measurements are kept" in done.stderr and "cache plan was not saved" in done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    pick = json.loads((folder / "tiny" / "pick" / "results.json").read_text())
    assert pick["selection"]["plan_saved"] is False and "cannot write cache plans" in pick["selection"]["plan_error"]
    assert pick["metrics"]["plan_saved"] == 0.0 and len(pick["selection"]["candidates"]) == 3
    for name in ("cache_candidates.csv", "cache_candidates.png", "cache_plan.json"):
        assert (folder / "tiny" / "pick" / name).stat().st_size > 0


@pytest.mark.e2e
def test_weight_candidates_choose_weights_and_cache_under_one_memory_budget(tmp_path):
    """The unquantized tiny model's 0.4 MiB of weights are over the 0.3 MiB budget: a quantized pair is chosen; the
    table, plan and MLflow say which weights."""
    settings = SETTINGS.format(plans=tmp_path / "plans.json").replace("cache_budget_mb: 0.1",
                                                                      "memory_budget_mb: 0.3")
    runs = f"""      - id: joint
        mode: auto-cache-select
        generate: {{weight_candidates: [none, int8], {settings}}}
"""
    done = run_cli(tiny_manifest(tmp_path, runs), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    selection = json.loads((folder / "tiny" / "joint" / "results.json").read_text())["selection"]
    assert selection["weights"] == "int8" and selection["source"] == "measured"
    rows = {(r["weights"], r["kind"]): r for r in selection["candidates"]}
    assert len(rows) == 6 and all(not r["fits"] for (w, _), r in rows.items() if w == "none")
    assert all(r["total_mib"] <= 0.3 and r["passed"] for (w, _), r in rows.items() if w == "int8")
    table = (folder / "tiny" / "joint" / "cache_candidates.csv").read_text()
    assert table.startswith("weights,weights MiB,total MiB,kind,") and "over memory budget" in table
    assert "weights int8, cache" in done.stdout
    assert (folder / "tiny" / "joint" / "cache_candidates.png").stat().st_size > 10_000


@pytest.mark.e2e
def test_weight_candidates_are_read_by_auto_cache_select_only(tmp_path):
    runs = """      - id: g
        mode: generate
        generate: {weight_candidates: [int8], cache_kind: auto}
"""
    done = run_cli("check", tiny_manifest(tmp_path, runs))
    assert done.returncode == 2 and "weight_candidates is read by mode auto-cache-select" in done.stderr
