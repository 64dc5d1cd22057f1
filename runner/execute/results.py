"""`run results` and `run compare`: read past runs back from MLflow (tracking.py writes them).

    run results [--experiment E] [--name SUBSTRING] [--mode MODE] [--where KEY=VALUE] [--columns a,b] [--limit N]
    run compare A B [--all] [--fail-on-regression]

Runs are named by MLflow run id (a unique prefix is enough). A parent run (one invocation) stands for
its steps: their metrics are compared as `<step>/<metric>`. A difference is flagged as a regression
(or an improvement) only when it is larger than the spread the runs recorded themselves
(`<metric>_spread`, max − min over repeats); without a recorded spread nothing is flagged.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from runner.errors import RunnerError

DEFAULT_COLUMNS = ("tokens_per_s", "median_ratio_tokens_per_s", "speedup", "acceptance_rate", "cache_kind.chosen",
                   "max_output_tokens_per_s", "median_ratio_static_throughput")
HIGHER_IS_BETTER = ("tok_s", "tokens_per_s", "speedup", "acceptance", "bw_fraction", "bandwidth", "top1")
LOWER_IS_BETTER = ("_ms", "_s", "mib", "_mb", "bytes", "nll", "kl", "ppl", "failed")


class Store:
    """A read-only view of an MLflow store."""

    def __init__(self, tracking_uri: str | None, runs_dir: str = "runs"):
        from runner.execute.tracking import default_tracking_uri, http_timeouts, quiet_mlflow, require_server
        from runner.manifest.schema import tracking_uri_problem

        problem = tracking_uri_problem(tracking_uri) if tracking_uri is not None else None
        if problem:
            raise RunnerError(f"--tracking-uri: {problem}")
        local = _local_store(tracking_uri) if tracking_uri is not None else None
        if local is not None and not local.exists():  # MLflow would create an empty store and show nothing
            raise RunnerError(f"--tracking-uri: no MLflow store at {local.resolve()}")
        if tracking_uri is None:
            db = Path(runs_dir) / "mlflow.db"
            if not db.is_file():
                raise RunnerError(f"no MLflow store at {db.resolve()}: run a manifest first, or pass --runs-dir "
                                  "or --tracking-uri")
            tracking_uri = default_tracking_uri(runs_dir)
        require_server(tracking_uri, "--tracking-uri", "leave --tracking-uri out to read <runs-dir>/mlflow.db")
        quiet_mlflow()
        http_timeouts()  # a read-only view answers, or says why, fast
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri
        self.client = self._read(MlflowClient, tracking_uri=tracking_uri)

    def experiments(self, name: str | None) -> list:
        found = self._read(self.client.search_experiments)
        if name is None:
            return found
        chosen = [e for e in found if e.name == name]
        if not chosen:
            names = sorted(e.name for e in found)
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RunnerError(f"no experiment {name!r} in {self.uri}; {hint}there are: {', '.join(names) or 'none'}")
        return chosen

    def runs(self, experiment: str | None = None, filter_string: str = "", limit: int = 1000) -> list:
        experiments = self.experiments(experiment)
        if not experiments:
            return []
        return list(self._read(self.client.search_runs, [e.experiment_id for e in experiments], filter_string,
                               order_by=["attributes.start_time DESC"], max_results=limit))

    def _read(self, call, *args, **kwargs):
        """MLflow's answer; a store it cannot read (not an MLflow database, unreachable) is a RunnerError."""
        try:
            return call(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- MLflow raises its own, SQLAlchemy's and OS errors alike
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise RunnerError(f"cannot read the MLflow store {self.uri}: {first} (is it an MLflow store? "
                              "'run results' reads <runs-dir>/mlflow.db or --tracking-uri)") from None

    def run(self, prefix: str):
        """The one run whose id starts with `prefix`."""
        matches = [r for r in self.runs(limit=50_000) if r.info.run_id.startswith(prefix)]
        if len(matches) != 1:
            what = "no run" if not matches else f"{len(matches)} runs"
            raise RunnerError(f"{what} with an id starting {prefix!r} in {self.uri} (see 'run results')")
        return matches[0]

    def invocation(self, given: str, which: str):
        """The parent run (one invocation) that `given` names: its MLflow run id (or a unique prefix), or its run
        folder; a step's run or folder is refused, naming the invocation to pass instead."""
        folder = Path(given)
        if folder.is_dir():
            given = _folder_run_id(folder, which)
        run = self.run(given)
        parent = run.data.tags.get("mlflow.parentRunId")
        if "runner.mode" in run.data.tags:
            raise RunnerError(f"{which} {given!r} is the run of one step ({run.info.run_name}), not of an invocation: "
                              f"'run compare' compares invocations step by step; pass its parent run, {parent} "
                              "(see 'run results --all')")
        return run

    def children(self, run) -> list:
        return self.runs(filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'")


def results_table(store: Store, experiment: str | None = None, name: str | None = None, mode: str | None = None,
                  columns: list[str] | None = None, limit: int = 50, all_runs: bool = False,
                  where: Sequence[str] = ()) -> pd.DataFrame:
    """One row per run, newest first: steps only (runs with a mode) unless `all_runs`; `where` holds
    KEY=VALUE conditions on a metric, param or tag (e.g. sweep.temperature=0.7)."""
    clauses = []
    if mode:
        clauses.append(f"tags.`runner.mode` = '{_quoted(mode)}'")
    if name:
        clauses.append(f"attributes.run_name LIKE '%{_quoted(name)}%'")
    runs = store.runs(experiment, " and ".join(clauses), limit=10_000)
    if not all_runs:
        runs = [r for r in runs if "runner.mode" in r.data.tags]
    conditions = [where_condition(c) for c in where]
    known = _known_columns(runs)
    for column in columns or ():  # (a --where key no run has simply matches nothing)
        _check_column(column, known)
    for key, wanted in conditions:
        _check_comparable(key, wanted, runs)
        runs = [r for r in runs if _matches(_value(r, key), wanted)]
    runs = runs[:limit]
    names = {e.experiment_id: e.name for e in store.experiments(None)}
    rows = [{"run_id": r.info.run_id[:12], "experiment": names.get(r.info.experiment_id, r.info.experiment_id),
             "name": r.info.run_name, "mode": r.data.tags.get("runner.mode", ""), "status": r.info.status,
             "started": pd.Timestamp(r.info.start_time, unit="ms", tz="UTC").strftime("%Y-%m-%d %H:%M"),
             **{c: _value(r, c) for c in (columns or _default_columns(runs))}} for r in runs]
    return pd.DataFrame(rows)


def mode_problem(mode: str) -> str | None:
    """`--mode` names one of the manifest's modes (no run has any other)."""
    from runner.manifest.schema import MODES

    if mode in MODES:
        return None
    close = difflib.get_close_matches(mode, MODES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"--mode {mode!r}: no such mode: {hint}the modes are {', '.join(MODES)}"


def where_condition(condition: str) -> tuple[str, str]:
    """`KEY=VALUE` → (key, value); anything else is a RunnerError saying the form."""
    key, equals, wanted = condition.partition("=")
    if not equals or not key.strip():
        raise RunnerError(f"--where {condition!r}: expected KEY=VALUE (e.g. --where sweep.temperature=0.7)")
    return key.strip(), wanted.strip()


def _known_columns(runs: list) -> set[str]:
    known = set()
    for run in runs:
        for source in ("metrics", "params", "tags"):
            names = getattr(run.data, source)
            known |= set(names) | {f"{source}.{n}" for n in names}
    return known


def _check_column(name: str, known: set[str]) -> None:
    """A column no run has is a typo, not a column of blanks (with no runs at all, nothing can be said)."""
    if known and name not in known:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RunnerError(f"no run has a metric, param or tag {name!r}: {hint}(see 'run results --all' for runs, "
                          "'run compare A B --all' for a run's metrics)")


def _check_comparable(key: str, wanted: str, runs: list) -> None:
    """A column that is a number in every run that has it matches only a number: a text value is a mistake."""
    values = [v for v in (_value(r, key) for r in runs) if v is not None]
    if values and all(_is_number(v) for v in values) and not _is_number(wanted):
        raise RunnerError(f"--where {key}={wanted}: {key} holds numbers (e.g. {values[0]}), and {wanted!r} is not "
                          "one")


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _local_store(uri: str) -> Path | None:
    """The file or folder a local tracking URI names (sqlite:///db, file:///folder, a plain folder)."""
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///"))
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    return Path(uri) if "://" not in uri else None


def _default_columns(runs: list) -> list[str]:
    return [c for c in DEFAULT_COLUMNS if any(_value(r, c) is not None for r in runs)]


def _value(run, column: str):
    """A column by name: metrics first, then params, then tags (or prefixed: metrics.x, params.x, tags.x)."""
    for source in ("metrics", "params", "tags"):
        if column.startswith(source + "."):
            return getattr(run.data, source).get(column[len(source) + 1:])
    for source in (run.data.metrics, run.data.params, run.data.tags):
        if column in source:
            return source[column]
    return None


def _matches(value, wanted: str) -> bool:
    if value is None:
        return False
    try:
        return float(value) == float(wanted)  # 0.7 matches "0.7" and 0.70
    except ValueError:
        return str(value) == wanted


def _folder_run_id(folder: Path, which: str) -> str:
    """A run folder's MLflow run id (from its status.json); a step's folder or a sweep's is refused."""
    import json

    for record in ("status.json", "sweep.json"):
        try:
            data = json.loads((folder / record).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record == "sweep.json":
            raise RunnerError(f"{which} {str(folder)!r} is a sweep's folder: compare two of its points' folders "
                              f"({folder / '0'}, ...) or their runs (see 'run results --all')")
        if data.get("mlflow_run_id"):
            return data["mlflow_run_id"]
        raise RunnerError(f"{which} {str(folder)!r}: its status.json names no MLflow run (tracking.mlflow was false?)")
    run_folder = next((p for p in folder.resolve().parents if (p / "status.json").is_file()), None)
    if run_folder is not None:
        raise RunnerError(f"{which} {str(folder)!r} is a step's folder, not an invocation's: 'run compare' compares "
                          f"invocations step by step; pass the run folder {run_folder} (or its MLflow run id)")
    raise RunnerError(f"{which} {str(folder)!r} is a folder but not a run folder (no status.json): pass an MLflow "
                      "run id (see 'run results --all') or a run folder")


def compare_table(store: Store, a: str, b: str) -> pd.DataFrame:
    """Metrics of A and B side by side with delta, relative delta, the larger recorded spread and a verdict."""
    left, right = _metrics(store, store.invocation(a, "A")), _metrics(store, store.invocation(b, "B"))
    rows = []
    for name in sorted(set(left) | set(right)):
        if name.endswith("_spread"):
            continue
        va, vb = left.get(name), right.get(name)
        spreads = [s for s in (left.get(name + "_spread"), right.get(name + "_spread")) if s is not None]
        spread = max(spreads) if spreads else None
        delta = vb - va if va is not None and vb is not None else None
        rows.append({"metric": name, "A": va, "B": vb, "delta": delta,
                     "delta_%": 100 * delta / abs(va) if delta is not None and va else None,
                     "spread": spread, "verdict": verdict(name, delta, spread)})
    return pd.DataFrame(rows, columns=["metric", "A", "B", "delta", "delta_%", "spread", "verdict"])


def _metrics(store: Store, run) -> dict[str, float]:
    """The run's metrics; for a parent, its steps' metrics as `<step>/<metric>`."""
    children = store.children(run)
    if not children:
        return dict(run.data.metrics)
    return {f"{child.info.run_name}/{k}": v for child in children for k, v in child.data.metrics.items()}


def direction(metric: str) -> int:
    """+1 when bigger is better, −1 when smaller is better, 0 when the name does not say."""
    name = metric.rsplit("/", 1)[-1].lower()
    if any(word in name for word in HIGHER_IS_BETTER):
        return 1
    if any(name.endswith(word) or word in name for word in LOWER_IS_BETTER):
        return -1
    return 0


def verdict(metric: str, delta: float | None, spread: float | None) -> str:
    if delta is None:
        return "only in one run"
    if spread is None or math.isnan(spread):
        return ""  # no recorded spread: no way to tell noise from change
    if abs(delta) <= spread or direction(metric) == 0:
        return "within spread" if abs(delta) <= spread else "changed"
    return "improvement" if delta * direction(metric) > 0 else "REGRESSION"


def format_frame(frame: pd.DataFrame, empty: str) -> str:
    """The table as the CLI prints it (every row and column), or `empty` when there is none."""
    if frame.empty:
        return empty
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width",
                           max(os.get_terminal_size(0).columns if os.isatty(0) else 160, 80)):
        return frame.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.4g}")


def _quoted(text: str) -> str:
    return text.replace("'", "''")
