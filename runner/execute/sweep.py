"""Sweeps: one manifest × a grid of values, each combination (a point) run through Hydra's multirun.

The grid comes from `run m.yaml -m key=a,b other=range(1,4)` and from the manifest's `sweep:` block,
in Hydra's grammar (lists, range(), choice()); Hydra's BasicSweeper expands it. Every point is
composed and validated before anything runs: a bad point stops the sweep naming the point. Hydra's
launcher then runs the points (basic: one after another in this process; joblib: parallel processes;
submitit: SLURM jobs; ray: a Ray cluster). Each point is one call of `run_point` into its own run
folder `<sweep folder>/<N>/` and its own MLflow run, nested under the sweep's and tagged
`sweep.<key>=<value>`. Nothing here schedules jobs. With compose.py and launchers.py, the only importers of hydra.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from runner.errors import ManifestError, Problem, RunnerError
from runner.execute.launchers import HYDRA_SETTINGS
from runner.execute.tracking import RunFolder, new_folder, tracker_for, utc_now
from runner.files import atomic_write_json
from runner.manifest.compose import hydra_override, hydra_reason, load_points, override_problem, override_value, shown
from runner.manifest.schema import Manifest
from runner.report import ProgressFactory, no_progress

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Point:
    index: int
    overrides: tuple[str, ...]  # as Hydra passes them to the job, e.g. ("++seed=1", "++a.b=0.7")
    values: dict  # swept key → value as text

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items()) or "(no swept keys)"


@dataclass
class SweepOutcome:
    folder: Path
    states: dict[int, str] = field(default_factory=dict)  # point index → finished / failed / skipped / ...
    failed: dict[int, str] = field(default_factory=dict)  # point index → what failed


def split_sweep(overrides: list[str], file: str) -> tuple[list[str], list[str]]:
    """(fixed, swept): `key=a,b`, `key=range(1,4)`, `key=choice(a,b)` are sweeps in Hydra's grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, parsed, problems = OverridesParser.create(), [], []
    for override in overrides:
        try:
            parsed.append(parser.parse_override(hydra_override(override)))
        except HydraException:
            problems.append(Problem("", override_problem(override, None) or "cannot be read",
                                    f"override '{shown(override)}'"))
    if problems:
        raise ManifestError(problems, file)
    swept = [o.is_sweep_override() for o in parsed]
    return ([o for o, s in zip(overrides, swept) if not s], [o for o, s in zip(overrides, swept) if s])


def sweep_arguments(manifest_sweep: dict, overrides: list[str]) -> list[str]:
    """The manifest's `sweep:` entries as Hydra overrides, then the command line's (which win per key)."""
    given = {_key(o) for o in overrides}
    from_manifest = [f"++{key}={_grammar(values)}" for key, values in manifest_sweep.items() if key not in given]
    return from_manifest + [hydra_override(o) for o in overrides]


def expand(arguments: list[str], file: str, from_manifest: list[str] | None = None,
           max_points: int = 1000, where: str = "") -> list[Point]:
    """Hydra's own expansion (BasicSweeper.split_arguments), in the order its launcher numbers the jobs.

    `from_manifest`: the keys of the manifest's sweep:, recorded as swept even with a single value.
    More than `max_points` points (counted before anything is expanded) is an error at `where`.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(arguments)
        _check_count(parsed, max_points, file, where)
        (combinations,) = BasicSweeper.split_arguments(parsed, None)
    except (HydraException, ValueError) as exc:
        raise ManifestError([Problem("sweep", hydra_reason(exc), where or file)], file) from None
    swept = [_key(argument) for argument, o in zip(arguments, parsed)  # each override's input line, in order
             if o.is_sweep_override()] + list(from_manifest or ())
    points = []
    for index, combination in enumerate(combinations):
        values = {_key(o): _text(override_value(o)[0]) for o in combination if _key(o) in swept}
        points.append(Point(index, tuple(combination), values))
    return points


def _text(value) -> str:
    """A swept value as tags and labels show it: unquoted, YAML spelling for null and booleans."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _check_count(parsed: list, max_points: int, file: str, where: str) -> None:
    from hydra.core.override_parser.types import ChoiceSweep, Glob, RangeSweep

    sizes = {}
    for override in parsed:
        value, key = override.value(), _key(override.input_line)
        if isinstance(value, RangeSweep):
            assert value.start is not None and value.stop is not None  # a parsed range() has both (as Hydra asserts)
            if not value.step:
                raise ManifestError([Problem("sweep", f"{key}: a range's step cannot be 0", where or file)], file)
            sizes[key] = max(0, math.ceil((value.stop - value.start) / value.step))
        elif isinstance(value, ChoiceSweep):
            sizes[key] = len(value.list)
        elif override.is_sweep_override() or isinstance(value, Glob):
            raise ManifestError([Problem("sweep", f"{key}: only lists of values (a,b,c), range() and choice() are "
                                         "swept here; list the values", where or file)], file)
    total = math.prod(sizes.values())
    if total == 0:
        empty = ", ".join(k for k, n in sizes.items() if n == 0)
        raise ManifestError([Problem("sweep", f"the sweep has no points: {empty} has no values (an empty range?)",
                                     where or file)], file)
    if total > max_points:
        counts = " × ".join(f"{k}: {n:,}" for k, n in sizes.items())
        raise ManifestError([Problem("sweep", f"the sweep has {total:,} points ({counts}); the most is "
                                     f"sweep_max_points = {max_points:,}: sweep fewer values, or raise it "
                                     f"(sweep_max_points={total} on the command line or in the manifest)",
                                     where or file)], file)


def manifest_keys(manifest_sweep: dict, overrides: list[str]) -> list[str]:
    """The keys swept by the manifest's sweep: (the command line's win per key)."""
    given = {_key(o) for o in overrides}
    return [key for key in manifest_sweep if key not in given]


def validate_points(path: Path, points: list[Point], from_manifest: Sequence[str] = ()) -> None:
    """Compose and validate every point; all bad points are reported at once, each named. A value that came
    from the manifest's sweep: is located at its entry there, not at the override it became."""
    from runner.manifest.sources import read_sources

    sources = read_sources(path) if from_manifest else None
    located = {f"override '{shown(o)}'": sources.at(("sweep", _key(o)))
               for p in points for o in p.overrides if _key(o) in from_manifest} if sources else {}
    problems = []
    for point, error in zip(points, load_points(path, [p.overrides for p in points])):
        if error is not None:
            problems += [Problem(p.path, p.message, f"point {point.index} ({point.label}): "
                                 f"{located.get(p.source, p.source)}", p.hint) for p in error.problems]
    if problems:
        raise ManifestError(problems, f"{path} (sweep of {len(points)} points; nothing ran)")


def run_sweep(path: Path, manifest: Manifest, arguments: list[str], points: list[Point], hydra_args: list[str],
              resume: Path | None = None, progress: ProgressFactory = no_progress) -> SweepOutcome:
    """Launch every point through Hydra into one sweep folder; `resume`: an interrupted sweep's folder.

    `arguments` are the ones `points` were expanded from: Hydra expands them again, to the same points.
    """
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.execute.executor import LoadedModels

    record = _resumable(resume, points) if resume else None
    folder = resume or new_folder(manifest.tracking.runs_dir, manifest.name)
    tracker = tracker_for(manifest.tracking, manifest.name)
    tags = {"runner.sweep_folder": str(folder.resolve()), "runner.sweep_id": folder.name,
            "runner.manifest": str(path)}
    tracker.end_stale("runner.sweep_folder", tags["runner.sweep_folder"])
    with tracker.run(f"{manifest.name} (sweep)", {**tags, "runner.sweep": "parent"},
                     resume=(record or {}).get("mlflow_run_id")) as sweep_run:
        record = {"name": manifest.name, "manifest": str(path), "state": "running",
                  "started": (record or {}).get("started") or utc_now(), "on_failure": manifest.on_failure,
                  "hydra_args": hydra_args, "mlflow_run_id": sweep_run.id,
                  "points": [{"index": p.index, "overrides": list(p.overrides), "values": p.values,
                              "folder": str(p.index)} for p in points]}
        atomic_write_json(folder / "sweep.json", record)
        (folder / "STOP").unlink(missing_ok=True)
        log.info("sweep of %d points: %s", len(points), folder)
        task = partial(run_point, {"manifest": str(path.resolve()), "name": path.stem, "points": points,
                                   "sweep_run": sweep_run.id, "tags": tags, "on_failure": manifest.on_failure,
                                   "stop_file": str((folder / "STOP").resolve()), "models": LoadedModels(),
                                   "progress": progress})
        overrides = [f"hydra.sweep.dir={folder.resolve()}", *HYDRA_SETTINGS, *hydra_args, *arguments]
        outcome, state = SweepOutcome(folder), "interrupted"
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None, job_name=path.stem):
                hydra = GlobalHydra.instance().hydra
                assert hydra is not None  # set by initialize_config_dir
                hydra.multirun(config_name=path.stem, task_function=task, overrides=overrides)
            state = "finished"
        except (HydraException, OmegaConfBaseException) as exc:
            state = "failed"
            raise RunnerError(f"the sweep could not be launched: {hydra_reason(exc)}") from None
        except Exception as exc:
            if not _job_died(exc):
                raise
            state = "failed"  # every other point has ended (manifests/launchers/' launchers wait for all)
            raise RunnerError(f"a point's job died on the cluster ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0][:300]}); --resume runs what did not finish") from None
        finally:
            GlobalHydra.instance().clear()
            _collect(outcome, points)
            if state == "finished" and outcome.failed:
                state, sweep_run.state = "failed", "FAILED"
            record.update(state=state, ended=utc_now())
            for entry in record["points"]:
                entry["state"] = outcome.states.get(entry["index"], "not started")
                if entry["state"] == "running":  # its worker was stopped before it could say so
                    entry["state"] = outcome.states[entry["index"]] = "interrupted"
            atomic_write_json(folder / "sweep.json", record)
            if state != "finished":  # workers stopped mid-step (interrupted, killed, cancelled) cannot end their runs
                tracker.end_stale("runner.sweep_folder", tags["runner.sweep_folder"])
            sweep_run.log(params={"manifest": manifest.name, "sweep.points": len(points),
                                  "sweep.keys": sorted(points[0].values)})
    return outcome


def run_point(context: dict, cfg) -> dict:
    """Hydra's task function: one point, composed by Hydra (here, or on a cluster node), into its folder."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from runner.execute.executor import ParentRun, execute
    from runner.manifest.plan import make_plan

    hydra = HydraConfig.get()
    point: Point = context["points"][hydra.job.num]
    if tuple(hydra.overrides.task) != point.overrides:
        raise RuntimeError(f"Hydra's job {hydra.job.num} has overrides {list(hydra.overrides.task)}, "
                           f"expected {list(point.overrides)}")
    folder = RunFolder.at(Path(hydra.runtime.output_dir))
    if Path(context["stop_file"]).exists():
        folder.set(name=context["name"], reason="on_failure: stop, after another point failed")
        folder.finish("skipped")
        return {"index": point.index, "state": "skipped"}
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)  # Hydra composed it from the manifest, a mapping
    raw.setdefault("name", context["name"])
    raw.pop("sweep", None)  # the point's resolved manifest runs just this point again
    manifest_path = Path(context["manifest"])
    log.info("point %d: %s", point.index, point.label)
    tags = {**context["tags"], "runner.sweep_point": point.index, **{f"sweep.{k}": v for k, v in point.values.items()}}
    try:
        manifest = Manifest.model_validate(raw)  # validated before the launch; again where the job runs
        parent = ParentRun(context["sweep_run"], tags, f"{manifest.name}[{point.index}] {point.label}")
        outcome = execute(manifest, raw, make_plan(manifest, manifest_path.parent), manifest_path, folder, parent,
                          models=context["models"], progress=context["progress"])
        failed = bool(outcome.failed)
    except (RunnerError, ValueError) as exc:  # a point that cannot start fails alone; the others go on
        log.error("point %d failed: %s", point.index, exc)
        folder.set(name=context["name"], error=str(exc))
        folder.finish("failed")
        failed = True
    if failed and context["on_failure"] == "stop":
        Path(context["stop_file"]).touch()
    return {"index": point.index, "state": "failed" if failed else "finished"}


def _job_died(exc: Exception) -> bool:
    """Ray or submitit saying a point's worker or job died under it (killed, cancelled): not a bug in the point."""
    return type(exc).__module__.split(".")[0] in ("ray", "submitit") and type(exc).__name__ in (
        "WorkerCrashedError", "NodeDiedError", "OwnerDiedError", "TaskCancelledError", "UncompletedJobError")


def _resumable(folder: Path, points: list[Point]) -> dict:
    try:
        record = json.loads((folder / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise RunnerError(f"{folder} is not a sweep folder (no readable sweep.json)") from None
    if [tuple(p["overrides"]) for p in record["points"]] != [p.overrides for p in points]:
        raise RunnerError(f"cannot resume {folder}: its points differ from this sweep's "
                          f"({len(record['points'])} recorded, {len(points)} now); run without --resume")
    return record


def _collect(outcome: SweepOutcome, points: list[Point]) -> None:
    """Each point's state from its own status.json: right even when a worker process was killed."""
    for point in points:
        try:
            status = json.loads((outcome.folder / str(point.index) / "status.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        outcome.states[point.index] = status.get("state", "unknown")
        failed = [k for k, v in status.get("steps", {}).items() if v.get("state") in ("failed", "crashed")]
        if failed or status.get("state") == "failed":
            outcome.failed[point.index] = ", ".join(failed) or "failed"


def describe(outcome: SweepOutcome, points: list[Point]) -> str:
    lines = [f"sweep: {len(points)} points in {outcome.folder}"]
    for point in points:
        lines.append(f"  [{point.index}] {outcome.states.get(point.index, 'not started'):<11} {point.label}"
                     + (f"  (failed: {outcome.failed[point.index]})" if point.index in outcome.failed else ""))
    return "\n".join(lines)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _grammar(values) -> str:
    """A manifest sweep entry in Hydra's grammar: a list → `a,b,c`; a string is already grammar."""
    if isinstance(values, str):
        return values
    return ",".join(_hydra_value(v) for v in values)


def _hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"

