"""A sweep's launcher: chosen on the command line only, never swept, and able to start before any point runs.

Able to start: its software installed, its service running (SLURM's controller, a Ray head), its settings in
the bounds its library keeps. Hydra finds out only when it launches (an ImportError from the plugin, joblib
refusing n_jobs=0, Ray's ConnectionError after its own retries, submitit failing on a missing `sbatch`):
after `run check` said ok, and after the sweep's folder and MLflow run were made. `validate_launcher` composes
the launcher's settings as the launch will and `launcher_problem` judges them, for `run check -m`,
`run plan -m` and `run -m` alike. With compose.py and sweep.py, the only importers of hydra.
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import ManifestError, Problem, RunnerError
from runner.manifest.compose import hydra_override, hydra_reason, shown

# Set by us for every sweep: the sweep folder is Hydra's sweep dir; Hydra writes no .hydra/ copies and
# leaves logging alone; points run in the caller's working directory (relative paths keep their meaning).
HYDRA_SETTINGS = ("hydra.sweep.subdir=${hydra.job.num}", "hydra.output_subdir=null", "hydra.job.chdir=false",
                  "hydra/job_logging=none", "hydra/hydra_logging=none")


@dataclass(frozen=True)
class Launcher:
    """What one of Hydra's launcher choices needs to start."""

    what: str  # as the user knows it
    modules: tuple[str, ...]  # Python packages it imports
    install: str  # how to get them
    programs: tuple[str, ...] = ()  # commands it runs
    programs_hint: str = ""
    bounds: dict[str, tuple[float, bool]] = field(default_factory=dict)  # setting → (minimum, may be null)


SUBMITIT_BOUNDS: dict[str, tuple[float, bool]] = {
    "timeout_min": (1, False), "nodes": (1, False), "tasks_per_node": (1, False), "cpus_per_task": (1, False),
    "gpus_per_node": (0, True), "mem_gb": (1, True)}
LAUNCHERS = {
    "basic": Launcher("Hydra's basic launcher", (), ""),
    "joblib": Launcher("Hydra's joblib launcher", ("hydra_plugins.hydra_joblib_launcher", "joblib"),
                       'pip install -e .  (hydra-joblib-launcher is a dependency of runner)'),
    "ray": Launcher("Hydra's Ray launcher", ("hydra_plugins.hydra_ray_launcher", "ray"), 'pip install -e ".[ray]"',
                    bounds={"ray.remote.num_cpus": (1, True), "ray.remote.num_gpus": (0, True)}),
    "submitit_slurm": Launcher("Hydra's SLURM launcher (submitit)", ("hydra_plugins.hydra_submitit_launcher",
                                                                     "submitit"), 'pip install -e ".[slurm]"',
                               ("sbatch", "squeue"),
                               "run the sweep where SLURM answers (a cluster's login node), or try it on this "
                               "machine first with +launchers=local",
                               {**SUBMITIT_BOUNDS, "array_parallelism": (1, False)}),
    "submitit_local": Launcher("submitit's local launcher", ("hydra_plugins.hydra_submitit_launcher", "submitit"),
                               'pip install -e ".[slurm]"', bounds=SUBMITIT_BOUNDS),
}


def is_hydra_override(override: str) -> bool:
    """`hydra/launcher=joblib`, `hydra.launcher.n_jobs=2`: for Hydra's launcher, not for the manifest."""
    return override.lstrip("+~").startswith("hydra")


def is_launcher_fragment(override: str) -> bool:
    """`+launchers=ray`: a fragment of manifests/launchers/, choosing Hydra's launcher (which runs sweeps only)."""
    return _key(override).partition("/")[0] == "launchers"


def refuse_unsweepable(overrides: list[str], manifest_sweep: dict, path: Path) -> None:
    """What decides how a sweep runs cannot itself be swept: its size guard, its launcher."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from runner.manifest.sources import read_sources

    parser, problems, swept = OverridesParser.create(), [], []
    for override in overrides:
        try:
            if parser.parse_override(hydra_override(override)).is_sweep_override():
                swept.append((override, f"override '{shown(override)}'"))
        except HydraException:
            continue  # its form is reported where it is read (split_sweep, validate_launcher)
    if manifest_sweep:
        sources = read_sources(path)
        swept += [(f"{key}=...", sources.at(("sweep", key))) for key in manifest_sweep]
    for override, where in swept:
        key = _key(override)
        if key == "sweep_max_points":
            problems.append(Problem("sweep_max_points", "a guard on the sweep's size is not swept: give one value "
                                    "(e.g. sweep_max_points=2000)", where))
        elif is_launcher_fragment(override) or is_hydra_override(override):
            problems.append(Problem("", f"{key}: a sweep runs through one launcher: give one (e.g. +launchers=ray), "
                                    "and run the sweep again for another", where))
    if problems:
        raise ManifestError(problems, str(path))


def validate_launcher(path: Path, arguments: list[str], hydra_args: list[str]) -> None:
    """Compose the multirun config as the launch will (launcher choice and settings), before anything runs; then
    whether that launcher can start (runner.execute.launchers: its software, its service, its settings)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None, job_name=path.stem):
            hydra = GlobalHydra.instance().hydra
            assert hydra is not None  # set by initialize_config_dir
            cfg = hydra.compose_config(path.stem, [*HYDRA_SETTINGS, *hydra_args, *arguments],
                                       run_mode=RunMode.MULTIRUN, with_log_configuration=False)
            choice = cfg.hydra.runtime.choices.get("hydra/launcher") or "basic"
            settings = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    except (HydraException, OmegaConfBaseException) as exc:
        refuse_missing_plugin(hydra_reason(exc))
        named = [o for o in hydra_args if o.split("=", 1)[0].lstrip("+~") in str(exc)]
        where = f"override '{named[0]}'" if named else "Hydra's launcher settings"
        raise ManifestError([Problem("hydra", hydra_reason(exc), where)], str(path)) from None
    finally:
        GlobalHydra.instance().clear()
    problem = launcher_problem(choice, settings if isinstance(settings, dict) else {})
    if problem:
        raise RunnerError(f"the sweep's launcher ({choice}) cannot start: {problem}; nothing ran")


def refuse_missing_plugin(reason: str) -> None:
    """Hydra's composition failing on a launcher we know (`Could not find 'hydra/launcher/ray'`): its plugin is not
    installed, so say how to install it. Called wherever `+launchers=` or `hydra/launcher=` is composed."""
    plugin = re.search(r"Could not (?:find|load) 'hydra/launcher/(\w+)'", reason)
    if plugin and plugin.group(1) in LAUNCHERS:
        known = LAUNCHERS[plugin.group(1)]
        raise RunnerError(f"the sweep's launcher ({plugin.group(1)}) cannot start: {known.what} is not installed here "
                          f"(Hydra has no hydra/launcher/{plugin.group(1)}): {known.install}; nothing ran")


def launcher_problem(choice: str, settings: dict) -> str | None:
    """Why the launcher `choice` (Hydra's hydra/launcher) with these composed settings cannot start; None if it can."""
    launcher = LAUNCHERS.get(choice)
    if launcher is None:  # another plugin: Hydra found it, we know nothing more of it
        return None
    for module in launcher.modules:
        if not _installed(module):
            return f"{launcher.what} needs the Python package '{module.split('.')[-1]}', which is not installed " \
                   f"here: {launcher.install}"
    for program in launcher.programs:
        if shutil.which(program) is None:
            return f"{launcher.what} runs '{program}', which is not on PATH: {launcher.programs_hint}"
    for key, (minimum, nullable) in launcher.bounds.items():
        problem = _bound_problem(key, _get(settings, key), minimum, nullable)
        if problem:
            return problem
    if choice == "joblib":
        n_jobs = settings.get("n_jobs")
        if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0:
            return (f"hydra.launcher.n_jobs={_shown(n_jobs)}: joblib runs n_jobs points at a time: give a whole "
                    "number, 1 or more (-1: one per CPU)")
    if choice == "ray":
        return _ray_cluster_problem(_get(settings, "ray.init.address"))
    if choice == "submitit_slurm":
        return _slurm_problem(launcher.programs_hint)
    return None


def _slurm_problem(hint: str) -> str | None:
    """SLURM's controller answering `squeue` (submitit would fail at the first sbatch, or wait on squeue forever)."""
    try:
        done = subprocess.run(["squeue", "-h", "-o", "%i", "-u", getpass.getuser()], capture_output=True, text=True,
                              timeout=15)
    except subprocess.TimeoutExpired:
        return f"SLURM does not answer (squeue: no answer within 15 s): {hint}"
    except OSError as exc:
        return f"SLURM cannot be asked (squeue: {exc.strerror or exc}): {hint}"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"SLURM does not answer ({said}): start its controller (slurmctld) or set SLURM_CONF, or {hint}"
    return None


def _bound_problem(key: str, value, minimum: float, nullable: bool) -> str | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        least = "null or " if nullable else ""
        return f"hydra.launcher.{key}={_shown(value)}: expected {least}a number of at least {minimum}"
    return None


def _ray_cluster_problem(address) -> str | None:
    """A Ray address where no head answers. null: the launcher starts a local Ray for the sweep."""
    if address is None:
        return None
    start = ("start one (ray start --head), pass its address (hydra.launcher.ray.init.address=HOST:6379), or "
             "hydra.launcher.ray.init.address=null to start a local Ray for the sweep")
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _current_cluster()
        if not address:
            return f"hydra.launcher.ray.init.address=auto: no Ray cluster is running on this machine: {start}"
    host, _, port = str(address).removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return f"hydra.launcher.ray.init.address={address}: expected HOST:PORT, ray://HOST:PORT, auto or null"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except OSError as exc:
        reason = "no answer within 3 s" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return f"no Ray cluster answers at {address} ({reason}): {start}"
    return None


def _current_cluster() -> str | None:
    """The address `ray start` leaves for `address: auto` in Ray's temporary folder."""
    folder = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"
    try:
        return (folder / "ray_current_cluster").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _get(settings: dict, key: str):
    node: object = settings
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _shown(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
