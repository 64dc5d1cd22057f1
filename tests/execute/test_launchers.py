"""A sweep's launcher that cannot start is named by `run check -m` and `run -m` alike, before any point runs:
its software missing (Ray, SLURM's commands), its service not answering (a Ray head, SLURM's controller), or
settings its library refuses. Whether ray or sbatch exist on this machine is set by each test, not assumed."""

import socket
from pathlib import Path

import pytest

from runner.cli import main
from runner.execute import launchers

SWEEP = Path(__file__).resolve().parents[2] / "manifests" / "sweep.yaml"
RAY_START = ("start one (ray start --head), pass its address (hydra.launcher.ray.init.address=HOST:6379), or "
             "hydra.launcher.ray.init.address=null to start a local Ray for the sweep")
SLURM_HINT = "run the sweep where SLURM answers (a cluster's login node), or try it on this machine first with " \
             "+launchers=local"


def refused(capsys, tmp_path, *args) -> str:
    """`run check -m` and `run -m` both exit 2 with the same single error line, and nothing is made."""
    lines = []
    for command in (["check"], []):
        code = main([*command, str(SWEEP), "-m", *args, f"tracking.runs_dir={tmp_path / 'runs'}"])
        err = capsys.readouterr().err.splitlines()
        assert code == 2 and len(err) == 1, err
        lines.append(err[0])
    assert lines[0] == lines[1] and not (tmp_path / "runs").exists()
    return lines[0]


def cannot_start(choice: str, problem: str) -> str:
    return f"error: the sweep's launcher ({choice}) cannot start: {problem}; nothing ran"


@pytest.fixture
def ray_installed(monkeypatch):
    real = launchers._installed
    monkeypatch.setattr(launchers, "_installed", lambda module: module == "ray" or real(module))


def test_ray_not_installed_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    real = launchers._installed
    monkeypatch.setattr(launchers, "_installed", lambda module: module != "ray" and real(module))
    assert refused(capsys, tmp_path, "+launchers=ray") == cannot_start(
        "ray", "Hydra's Ray launcher needs the Python package 'ray', which is not installed here: "
        'pip install -e ".[ray]"')


def test_a_ray_address_where_no_head_runs(ray_installed, capsys, tmp_path):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, not listening: refused
        address = f"127.0.0.1:{unused.getsockname()[1]}"
        message = refused(capsys, tmp_path, "+launchers=ray", f"hydra.launcher.ray.init.address={address}")
    assert message == cannot_start("ray", f"no Ray cluster answers at {address} (Connection refused): {RAY_START}")


def test_ray_auto_with_no_cluster_on_this_machine(ray_installed, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where `ray start` would leave ray/ray_current_cluster
    assert refused(capsys, tmp_path, "+launchers=ray") == cannot_start(
        "ray", f"hydra.launcher.ray.init.address=auto: no Ray cluster is running on this machine: {RAY_START}")


def test_ray_settings_out_of_bounds(ray_installed, capsys, tmp_path):
    assert refused(capsys, tmp_path, "+launchers=ray", "hydra.launcher.ray.remote.num_cpus=0") == cannot_start(
        "ray", "hydra.launcher.ray.remote.num_cpus=0: expected null or a number of at least 1")


def test_slurm_without_its_commands(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert refused(capsys, tmp_path, "+launchers=slurm") == cannot_start(
        "submitit_slurm", f"Hydra's SLURM launcher (submitit) runs 'sbatch', which is not on PATH: {SLURM_HINT}")


def test_slurm_whose_controller_does_not_answer(monkeypatch, capsys, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in (("sbatch", "exit 0"), ("squeue", "echo 'squeue: error: Unable to contact slurm controller "
                                                          "(connect failure)' >&2; exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert refused(capsys, tmp_path, "+launchers=slurm") == cannot_start(
        "submitit_slurm", "SLURM does not answer (squeue: error: Unable to contact slurm controller (connect "
        f"failure)): start its controller (slurmctld) or set SLURM_CONF, or {SLURM_HINT}")


@pytest.mark.parametrize("args, message", [
    (["+launchers=joblib", "hydra.launcher.n_jobs=0"], cannot_start(
        "joblib", "hydra.launcher.n_jobs=0: joblib runs n_jobs points at a time: give a whole number, 1 or more "
        "(-1: one per CPU)")),
    (["+launchers=local", "hydra.launcher.cpus_per_task=0"], cannot_start(
        "submitit_local", "hydra.launcher.cpus_per_task=0: expected a number of at least 1")),
    (["+launchers=local", "hydra.launcher.timeout_min=-5"], cannot_start(
        "submitit_local", "hydra.launcher.timeout_min=-5: expected a number of at least 1")),
])
def test_settings_the_launchers_library_refuses(args, message, capsys, tmp_path):
    assert refused(capsys, tmp_path, *args) == message


def test_a_launcher_that_can_start_passes(capsys, tmp_path):
    assert main(["check", str(SWEEP), "-m", "+launchers=joblib", "hydra.launcher.n_jobs=-1"]) == 0
    assert main(["check", str(SWEEP), "-m", "+launchers=local"]) == 0
    assert launchers.launcher_problem("basic", {}) is None
    assert launchers.launcher_problem("some_other_plugin", {"n_jobs": 0}) is None  # Hydra found it; we know no more


def test_a_launcher_plugin_not_installed_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    from hydra.core.config_store import ConfigStore

    assert main(["check", str(SWEEP), "-m", "+launchers=local"]) == 0  # the plugins are scanned: their configs stored
    capsys.readouterr()
    monkeypatch.delitem(ConfigStore.instance().repo["hydra"]["launcher"], "submitit_slurm.yaml")  # as if not installed
    assert refused(capsys, tmp_path, "+launchers=slurm") == (
        "error: the sweep's launcher (submitit_slurm) cannot start: Hydra's SLURM launcher (submitit) is not installed "
        "here (Hydra has no hydra/launcher/submitit_slurm): pip install -e \".[slurm]\"; nothing ran")
