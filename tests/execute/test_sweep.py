"""Sweeps: Hydra's grammar expands the grid, every point is validated before anything runs, each point
gets its own folder and MLflow run under the sweep's, launchers compose, the failure policy holds."""

import json
from pathlib import Path

import pytest
import yaml

from runner.errors import ManifestError
from runner.execute.sweep import expand, split_sweep, sweep_arguments, validate_points
from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
TEMP = "targets.0.runs.0.generate.temperature"
RUNS = """      - id: g
        mode: generate
        generate: {prompts: ["hello", "a longer prompt"], batch_size: 2, max_new_tokens: 5, temperature: 0.9}
"""


def test_hydra_grammar_lists_ranges_and_choice_expand_in_order():
    arguments = sweep_arguments({TEMP: [0.0, 0.7], "name": "choice(a,b)"}, ["seed=range(1,3)", "x=1"])
    points = expand(arguments, "m.yaml")
    assert len(points) == 2 * 2 * 2
    assert points[0].values == {TEMP: "0.0", "name": "a", "seed": "1"}
    assert points[-1].values == {TEMP: "0.7", "name": "b", "seed": "2"}
    assert all("++x=1" in p.overrides for p in points) and "x" not in points[0].values
    assert len({p.overrides for p in points}) == 8


def test_manifest_sweep_values_of_any_type_reach_the_points_unquoted():
    sweep = {"targets.0.model.dtype": ["float32", "bfloat16"], "x": ["a b", "it's", None, True], "one": [1]}
    points = expand(sweep_arguments(sweep, []), "m.yaml", list(sweep))
    assert len(points) == 8 and points[0].values == {"targets.0.model.dtype": "float32", "x": "a b", "one": "1"}
    assert [p.values["x"] for p in points[:4]] == ["a b", "it's", "null", "true"]
    assert points[1].overrides == ("++targets.0.model.dtype='float32'", "++x='it\\'s'", "++one=1")


def test_command_line_wins_over_the_manifests_sweep_for_the_same_key():
    points = expand(sweep_arguments({TEMP: [0.0, 0.7]}, [f"{TEMP}=0.1,0.2,0.3"]), "m.yaml")
    assert [p.values[TEMP] for p in points] == ["0.1", "0.2", "0.3"]


def test_split_sweep_tells_sweeps_from_plain_overrides():
    assert split_sweep(["seed=1", "a=1,2", "b=range(3)", "c=[1,2]"], "m.yaml") == (["seed=1", "c=[1,2]"],
                                                                               ["a=1,2", "b=range(3)"])


def test_every_bad_point_is_named_before_anything_runs(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    points = expand(sweep_arguments({}, [f"{TEMP}=0.5,-1", "targets.0.runs.0.generate.top_p=0.9,1.5"]), str(path))
    with pytest.raises(ManifestError) as caught:
        validate_points(path, points)
    text = str(caught.value)
    assert "nothing ran" in text and len(caught.value.problems) == 4  # (0.5, 1.5), (-1, 0.9), and (-1, 1.5) twice
    assert f"point 1 ({TEMP}=0.5, targets.0.runs.0.generate.top_p=1.5)" in text
    assert "point 0 " not in text


@pytest.mark.e2e
def test_a_bad_point_exits_2_and_creates_nothing(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    done = run_cli(path, "-m", f"{TEMP}=0.5,-2", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"point 1 ({TEMP}=-2)" in done.stderr and "nothing ran" in done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.e2e
def test_sweep_without_m_is_a_clear_error(tmp_path):
    done = run_cli("check", tiny_manifest(tmp_path, RUNS), f"{TEMP}=0.5,0.7")
    assert done.returncode == 2 and "add -m" in done.stderr and "Traceback" not in done.stderr


def _mlflow_runs(tmp_path, experiment="t"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


@pytest.mark.e2e
def test_sweep_points_get_their_folders_and_child_runs_tagged_with_the_values(tmp_path):
    path = tiny_manifest(tmp_path, RUNS, extra=f"sweep: {{{TEMP}: [0.0, 0.9]}}")
    done = run_cli(path, "-m", "seed=3,4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    record = json.loads((folder / "sweep.json").read_text())
    assert record["state"] == "finished" and [p["state"] for p in record["points"]] == ["finished"] * 4
    values = [p["values"] for p in record["points"]]
    assert values[1] == {TEMP: "0.0", "seed": "4"} and values[2] == {TEMP: "0.9", "seed": "3"}
    for index, value in enumerate(values):
        resolved = yaml.safe_load((folder / str(index) / "manifest.resolved.yaml").read_text())
        assert "sweep" not in resolved and resolved["seed"] == int(value["seed"])
        assert resolved["targets"][0]["runs"][0]["generate"]["temperature"] == float(value[TEMP])
        result = json.loads((folder / str(index) / "tiny" / "g" / "results.json").read_text())
        assert result["spec"]["temperature"] == float(value[TEMP]) and result["seed"] == int(value["seed"])

    runs = _mlflow_runs(tmp_path)
    (parent,) = [r for r in runs if r.data.tags.get("runner.sweep") == "parent"]
    points = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    steps = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in {p.info.run_id for p in points}]
    assert parent.info.status == "FINISHED" and len(points) == 4 and len(steps) == 4 and len(runs) == 9
    assert all(r.info.status == "FINISHED" for r in runs)
    tagged = sorted((r.data.tags[f"sweep.{TEMP}"], r.data.tags["sweep.seed"]) for r in steps)
    assert tagged == [("0.0", "3"), ("0.0", "4"), ("0.9", "3"), ("0.9", "4")]
    assert {r.data.tags["runner.sweep_id"] for r in runs} == {folder.name}


@pytest.mark.e2e
def test_rerunning_a_points_resolved_manifest_reproduces_its_sampled_tokens(tmp_path):
    path = tiny_manifest(tmp_path, RUNS, extra=f"sweep: {{{TEMP}: [0.9]}}")
    assert run_cli(path, "seed=7", "tracking.mlflow=false", cwd=tmp_path).returncode == 0
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    again = tmp_path / "again"
    again.mkdir()
    done = run_cli(folder / "0" / "manifest.resolved.yaml", f"tracking.runs_dir={again}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (second,) = [p for p in again.iterdir() if p.is_dir()]
    a, b = (json.loads((f / "tiny" / "g" / "results.json").read_text()) for f in (folder / "0", second))
    assert [r["token_ids"] for r in a["prompts"]] == [r["token_ids"] for r in b["prompts"]]
    assert a["hash"] == b["hash"]  # same resolved inputs, code and environment


@pytest.mark.e2e
def test_joblib_launcher_runs_points_in_separate_processes_without_collisions(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    done = run_cli(path, "-m", f"{TEMP}=0.0,0.9", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    pids = {json.loads((folder / str(i) / "status.json").read_text())["pid"] for i in (0, 1)}
    assert len(pids) == 2 and done.args and all(pid > 0 for pid in pids)
    for i in (0, 1):
        assert json.loads((folder / str(i) / "status.json").read_text())["state"] == "finished"
    runs = _mlflow_runs(tmp_path)
    assert len(runs) == 1 + 2 + 2 and all(r.info.status == "FINISHED" for r in runs)
    assert len({r.data.tags["runner.run_folder"] for r in runs if "runner.run_folder" in r.data.tags}) == 2


@pytest.mark.e2e
def test_on_failure_stop_skips_the_remaining_points_and_continue_runs_them(tmp_path):
    runs = RUNS.replace('prompts: ["hello", "a longer prompt"]', "prompts_file: p.txt")
    (tmp_path / "p.txt").write_text("hello\n")
    sweep = "targets.0.runs.0.generate.max_seq_len=3,2048,2048"  # point 0: the prompt does not fit
    for policy, states in (("stop", ["failed", "skipped", "skipped"]),
                           ("continue", ["failed", "finished", "finished"])):
        path = tiny_manifest(tmp_path, runs, extra=f"on_failure: {policy}")
        done = run_cli(path, "-m", sweep, f"tracking.runs_dir={tmp_path / policy}", "tracking.mlflow=false",
                       cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "1 of 3 points failed: 0" in done.stderr
        (folder,) = [p for p in (tmp_path / policy).iterdir() if p.is_dir()]
        assert [p["state"] for p in json.loads((folder / "sweep.json").read_text())["points"]] == states


@pytest.mark.parametrize("launcher, target", [
    ("joblib", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
    ("slurm", "hydra_plugins.runner_launchers.waiting.SlurmLauncher"),
    ("local", "hydra_plugins.runner_launchers.waiting.LocalLauncher"),
    ("ray", "hydra_plugins.runner_launchers.waiting.RayLauncher"),
])
def test_example_launcher_configs_compose_with_the_sweep_manifest(launcher, target):
    """Composed as Hydra composes a multirun (not launched: no cluster here)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "manifests"), version_base=None):
            cfg = GlobalHydra.instance().hydra.compose_config(
                "sweep", overrides=[f"+launchers={launcher}"], run_mode=RunMode.MULTIRUN,
                with_log_configuration=False)
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.launcher._target_ == target
    expected = {"joblib": ("n_jobs", 2), "slurm": ("array_parallelism", 16), "local": ("cpus_per_task", 1),
                "ray": ("ray", None)}[launcher]
    if expected[1] is not None:
        assert cfg.hydra.launcher[expected[0]] == expected[1]
    else:
        assert cfg.hydra.launcher.ray.init.address == "auto"
        assert cfg.hydra.launcher.ray.init.object_store_memory is None  # the plugin's 75 MB: refused by a cluster
        assert cfg.hydra.launcher.ray.remote.max_retries == 0  # a killed point is recorded, not silently rerun


def test_cluster_launchers_are_the_plugins_waiting_for_every_job():
    """Hydra instantiates them (plugin scan: the hydra_plugins package); they differ from the plugins only in
    waiting for every point before a dead one is reported (docs/clusters.md: the rest used to be abandoned)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
    from hydra_plugins.runner_launchers import waiting
    from runner.execute.sweep import _job_died

    names = set(Plugins.instance().class_name_to_class)
    assert {f"hydra_plugins.runner_launchers.waiting.{n}" for n in ("SlurmLauncher", "LocalLauncher")} <= names
    for ours, theirs in ((waiting.SlurmLauncher, submitit_launcher.SlurmLauncher),
                         (waiting.LocalLauncher, submitit_launcher.LocalLauncher)):  # by name: Hydra's scan
        bases = [f"{c.__module__}.{c.__qualname__}" for c in ours.__mro__]  # may import a module twice
        assert f"{theirs.__module__}.{theirs.__qualname__}" in bases
    died = type("UncompletedJobError", (Exception,), {"__module__": "submitit.core.utils"})
    assert _job_died(died("job 5_1 was cancelled")) and not _job_died(KeyError("models"))


def test_the_example_sweep_manifest_has_four_valid_points():
    from runner.manifest.compose import load_manifest

    path = ROOT / "manifests" / "sweep.yaml"
    manifest, _ = load_manifest(path)
    points = expand(sweep_arguments(manifest.sweep, []), str(path))
    validate_points(path, points)
    top_p = "targets.0.runs.0.generate.top_p"
    assert [p.values for p in points] == [{TEMP: t, top_p: p} for t in ("0.7", "1.0") for p in ("0.8", "0.95")]


@pytest.mark.slow
@pytest.mark.e2e
def test_example_sweep_on_smollm2_reproduces_a_sampled_point_from_its_resolved_manifest(tmp_path):
    short = ["targets.0.runs.0.generate.max_new_tokens=6", "tracking.mlflow=false"]
    done = run_cli(ROOT / "manifests" / "sweep.yaml", *short, f"tracking.runs_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("[runner] loading") == 1  # the points share the model in one process
    (folder,) = (tmp_path / "a").iterdir()
    again = run_cli(folder / "3" / "manifest.resolved.yaml", f"tracking.runs_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    (second,) = (tmp_path / "b").iterdir()
    a, b = (json.loads((f / "smollm2" / "sample" / "results.json").read_text()) for f in (folder / "3", second))
    assert a["spec"]["temperature"] == 1.0 and a["spec"]["top_p"] == 0.95
    assert [r["token_ids"] for r in a["prompts"]] == [r["token_ids"] for r in b["prompts"]]
    assert all(0 < len(r["token_ids"]) <= 6 for r in a["prompts"])


def test_an_unknown_launcher_or_launcher_setting_is_named_before_anything_runs():
    from runner.execute.launchers import validate_launcher

    path = ROOT / "manifests" / "sweep.yaml"
    validate_launcher(path, [], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=3"])
    for bad, message in (("hydra/launcher=jobib", "Could not find 'hydra/launcher/jobib'"),
                         ("hydra.launcher.n_jobz=3", "Could not override 'hydra.launcher.n_jobz'")):
        with pytest.raises(ManifestError) as caught:
            validate_launcher(path, [], ["hydra/launcher=joblib", bad] if "n_jobz" in bad else [bad])
        assert f"override '{bad}'" in str(caught.value) and message in str(caught.value)
