"""`run results` and `run compare` on a temporary MLflow store written by our own MlflowMirror."""

import pytest

from runner.execute.results import Store, compare_table, direction, results_table, verdict
from runner.execute.tracking import MlflowMirror, default_tracking_uri
from tests.test_cli import run_cli


def invocation(runs_dir, experiment: str, name: str, steps: dict) -> str:
    """One parent run and a FINISHED child per step: {step key: (mode, metrics, params)} → the parent's id."""
    mirror = MlflowMirror(default_tracking_uri(runs_dir), experiment, runs_dir / "mlartifacts")
    parent = mirror.start(name, {})
    for key, (mode, metrics, params) in steps.items():
        child = mirror.start(key, {"runner.mode": mode}, parent=parent)
        mirror.log(child, params=params, metrics=metrics)
        mirror.end(child, "FINISHED")
    mirror.end(parent, "FINISHED")
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("store") / "runs"
    runs_dir.mkdir()
    ids = {
        "a": invocation(runs_dir, "bench", "bench", {"smol/matrix": ("bench", {
            "b1.ours_tokens_per_s": 100.0, "b1.ours_tokens_per_s_spread": 4.0, "b1.ours_ttft_ms": 20.0,
            "b1.ours_ttft_ms_spread": 1.0, "b4.ours_tokens_per_s": 300.0, "b4.ours_tokens_per_s_spread": 10.0}, {})}),
        "b": invocation(runs_dir, "bench", "bench", {"smol/matrix": ("bench", {
            "b1.ours_tokens_per_s": 90.0, "b1.ours_tokens_per_s_spread": 3.0, "b1.ours_ttft_ms": 20.5,
            "b1.ours_ttft_ms_spread": 1.0, "b4.ours_tokens_per_s": 330.0, "b4.ours_tokens_per_s_spread": 10.0}, {})}),
        "g": invocation(runs_dir, "quickstart", "quickstart", {
            "smol/greedy": ("generate", {"tokens_per_s": 40.0}, {"generate": {"temperature": 0.0}}),
            "smol/sampled": ("generate", {"tokens_per_s": 35.0}, {"generate": {"temperature": 0.8}})}),
    }
    return runs_dir, Store(None, str(runs_dir)), ids


def test_results_lists_steps_newest_first_and_filters(store):
    _, s, _ = store
    table = results_table(s)
    assert list(table["name"]) == ["smol/sampled", "smol/greedy", "smol/matrix", "smol/matrix"]
    assert list(results_table(s, mode="generate")["name"]) == ["smol/sampled", "smol/greedy"]
    assert list(results_table(s, experiment="bench")["mode"]) == ["bench", "bench"]
    assert list(results_table(s, name="greedy")["name"]) == ["smol/greedy"]
    assert len(results_table(s, all_runs=True)) == 7  # three parents too
    chosen = results_table(s, mode="generate", columns=["tokens_per_s", "generate.temperature"])
    assert list(chosen["tokens_per_s"]) == [35.0, 40.0]
    assert list(chosen["generate.temperature"]) == ["0.8", "0.0"]
    assert list(results_table(s, where=["generate.temperature=0.80"])["name"]) == ["smol/sampled"]
    matched = results_table(s, where=["runner.mode=bench", "b4.ours_tokens_per_s=330"],
                            columns=["b1.ours_tokens_per_s"])
    assert list(matched["b1.ours_tokens_per_s"]) == [90.0]  # the second bench run, not the first
    assert results_table(s, where=["no.such.key=1"]).empty


def test_unknown_experiment_names_the_ones_there(store):
    from runner.errors import RunnerError

    with pytest.raises(RunnerError, match="did you mean 'bench'\\? there are: Default, bench, quickstart"):
        results_table(store[1], experiment="benhc")


def test_a_column_no_run_has_is_refused_with_the_closest_one(store):
    from runner.errors import RunnerError

    with pytest.raises(RunnerError, match="no run has a metric, param or tag 'tokens_per_sec': did you mean "
                                          "'tokens_per_s'\\?"):
        results_table(store[1], columns=["tokens_per_sec"])
    assert list(results_table(store[1], columns=["params.generate.temperature"]).columns)[-1] == \
        "params.generate.temperature"


def test_compare_flags_only_changes_beyond_the_spread(store):
    _, s, ids = store
    table = compare_table(s, ids["a"][:8], ids["b"][:8]).set_index("metric")
    assert table.loc["smol/matrix/b1.ours_tokens_per_s", "delta"] == -10.0
    assert table.loc["smol/matrix/b1.ours_tokens_per_s", "spread"] == 4.0
    assert table.loc["smol/matrix/b1.ours_tokens_per_s", "verdict"] == "REGRESSION"  # 10 slower, spread 4
    assert table.loc["smol/matrix/b4.ours_tokens_per_s", "verdict"] == "improvement"  # 30 faster, spread 10
    assert table.loc["smol/matrix/b1.ours_ttft_ms", "verdict"] == "within spread"  # 0.5 slower, spread 1
    assert not table.index.str.endswith("_spread").any()


@pytest.mark.e2e
def test_compare_cli_exit_codes(store):
    runs_dir, _, ids = store
    done = run_cli("compare", ids["a"], ids["b"], "--runs-dir", runs_dir, "--fail-on-regression")
    assert done.returncode == 1, done.stderr
    assert "REGRESSION" in done.stdout and "1 regression beyond the runs' spread" in done.stdout
    assert run_cli("compare", ids["a"], ids["b"], "--runs-dir", runs_dir).returncode == 0
    missing = run_cli("compare", "nope", ids["b"], "--runs-dir", runs_dir)
    assert missing.returncode == 2 and "no run with an id starting 'nope'" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.e2e
def test_results_cli_prints_the_table_and_explains_a_missing_store(store, tmp_path):
    runs_dir, _, _ = store
    done = run_cli("results", "--runs-dir", runs_dir, "--mode", "generate", "--columns", "tokens_per_s")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["run_id", "experiment", "name", "mode", "status", "started", "tokens_per_s"]
    assert [line.split()[2] for line in lines[1:]] == ["smol/sampled", "smol/greedy"]
    empty = run_cli("results", "--runs-dir", tmp_path / "nothing")
    assert empty.returncode == 2 and "no MLflow store at" in empty.stderr


@pytest.mark.parametrize("name, expected", [
    ("b1.ours_tokens_per_s", 1), ("tokens_per_s", 1), ("speedup", 1), ("acceptance_rate", 1), ("x/ours_bw_fraction", 1),
    ("ours_ttft_ms", -1), ("prefill_s", -1), ("ours_kv_mib", -1), ("fp16.delta_nll", -1), ("cells_failed", -1),
    ("cells", 0)])
def test_direction_of_metric_names(name, expected):
    assert direction(name) == expected


def test_verdict_needs_a_spread_and_a_direction():
    assert verdict("tokens_per_s", -5.0, None) == ""
    assert verdict("tokens_per_s", None, 1.0) == "only in one run"
    assert verdict("cells", 3.0, 1.0) == "changed"
    assert verdict("ttft_ms", 3.0, 1.0) == "REGRESSION"
    assert verdict("ttft_ms", -3.0, 1.0) == "improvement"


def test_where_on_a_numeric_column_with_a_text_value_is_refused(store):
    from runner.errors import RunnerError

    with pytest.raises(RunnerError) as caught:
        results_table(store[1], where=["tokens_per_s=fast"])
    assert str(caught.value) == ("--where tokens_per_s=fast: tokens_per_s holds numbers (e.g. 35.0), and 'fast' is "
                                 "not one")
    with pytest.raises(RunnerError, match="generate.temperature holds numbers"):  # a param, numbers in every run
        results_table(store[1], where=["params.generate.temperature=hot"])
    assert results_table(store[1], where=["runner.mode=bench"])["mode"].tolist() == ["bench", "bench"]  # text: fine


def test_compare_given_a_step_or_a_folder_says_what_it_got_and_what_to_pass(store, tmp_path, capsys):
    import json

    from runner.cli import main

    runs_dir, s, ids = store
    step = s.children(s.run(ids["a"]))[0].info.run_id
    assert main(["compare", step, ids["b"], "--runs-dir", str(runs_dir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: A '{step}' is the run of one step (smol/matrix), not of an invocation: 'run compare' compares "
        f"invocations step by step; pass its parent run, {ids['a']} (see 'run results --all')"]
    run_folder, step_folder = tmp_path / "20260101T000000Z-bench", tmp_path / "20260101T000000Z-bench" / "smol" / "m"
    step_folder.mkdir(parents=True)
    (step_folder / "results.json").write_text("{}")
    (run_folder / "status.json").write_text(json.dumps({"state": "finished", "mlflow_run_id": ids["a"]}))
    assert main(["compare", str(step_folder), ids["b"], "--runs-dir", str(runs_dir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: A '{step_folder}' is a step's folder, not an invocation's: 'run compare' compares invocations step "
        f"by step; pass the run folder {run_folder} (or its MLflow run id)"]
    assert main(["compare", str(run_folder), ids["b"], "--runs-dir", str(runs_dir)]) == 0  # a run folder: its run
    assert "smol/matrix/b1.ours_tokens_per_s" in capsys.readouterr().out
