"""The `run` command: argv → compose → plan → execute. A RunnerError prints its message and exits 2.

    run MANIFEST.yaml [key=value ...]         run every step of the manifest
    run check MANIFEST.yaml [key=value ...]   validate only (no torch import)
    run plan MANIFEST.yaml [key=value ...]    print the plan with each step's hash
    run schema                                print the manifest's JSON Schema
    run results [--experiment E] [--mode M]   a table of past runs from MLflow
    run compare A B                           two runs' metrics side by side, regressions flagged
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from runner import __version__
from runner.errors import RunnerError

COMMANDS = ("check", "plan", "schema", "results", "compare")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    try:
        return _dispatch(command, argv)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted: the run folder's status.json says what finished", file=sys.stderr)
        return 130


def _dispatch(command: str, argv: list[str]) -> int:
    if command == "schema":
        _parser("schema", "Print the manifest's JSON Schema (for editor completion).", manifest=False).parse_args(argv)
        from runner.manifest import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    if command in ("results", "compare"):
        return _browse(command, argv)
    descriptions = {
        "run": "Run a manifest: validate, plan, execute; results go to runs/ and MLflow.",
        "check": "Validate a manifest and its overrides; exits 2 with every problem listed.",
        "plan": "Print the plan: one line per step, with its content hash.",
    }
    args = _parser(command, descriptions[command]).parse_args(argv)
    from runner.compose import load_manifest
    from runner.plan import make_plan

    manifest, resolved = load_manifest(args.manifest, args.overrides)
    plan = make_plan(manifest)
    if command == "check":
        print(f"{args.manifest}: ok ({len(plan.steps)} step{'s' if len(plan.steps) != 1 else ''})")
        return 0
    if command == "plan":
        print(plan.describe())
        return 0
    from runner.engine import execute

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background, where SIGINT is ignored
        signal.signal(sig, _interrupt)
    outcome = execute(manifest, resolved, plan, Path(args.manifest))
    print(f"[runner] results: {outcome.folder}", file=sys.stderr)
    if outcome.failed:
        print(f"error: {len(outcome.failed)} of {len(plan.steps)} steps failed: {', '.join(outcome.failed)}",
              file=sys.stderr)
        return RunnerError.exit_code
    return 0


def _browse(command: str, argv: list[str]) -> int:
    """`run results` and `run compare`: read-only views of the MLflow store."""
    from runner import results

    if command == "results":
        parser = _parser("results", "A table of past runs (steps) from MLflow, newest first.", manifest=False)
        parser.add_argument("--experiment", help="only this MLflow experiment (default: all)")
        parser.add_argument("--name", help="only runs whose name contains this")
        parser.add_argument("--mode", help="only steps of this mode (generate, bench, ...)")
        parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                            help="only runs whose metric, param or tag KEY equals VALUE (repeatable), "
                            "e.g. --where sweep.temperature=0.7")
        parser.add_argument("--columns", help="comma-separated metrics, params or tags to show "
                            "(e.g. tokens_per_s,params.generate.temperature)")
        parser.add_argument("--limit", type=int, default=50, help="most rows (default 50)")
        parser.add_argument("--all", action="store_true", help="also the parent runs (one per invocation)")
    else:
        parser = _parser("compare", "Two runs' metrics side by side; a change is flagged only when it is larger "
                         "than the runs' own recorded spread.", manifest=False)
        parser.add_argument("a", help="MLflow run id (or a unique prefix) of the baseline")
        parser.add_argument("b", help="MLflow run id (or a unique prefix) to compare with it")
        parser.add_argument("--all", action="store_true", help="every metric, not only those that differ")
        parser.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a regression is flagged")
    parser.add_argument("--runs-dir", default="runs", help="where run folders and mlflow.db are (default runs)")
    parser.add_argument("--tracking-uri", help="an MLflow tracking URI instead of <runs-dir>/mlflow.db")
    args = parser.parse_args(argv)
    store = results.Store(args.tracking_uri, args.runs_dir)
    if command == "results":
        columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
        frame = results.results_table(store, args.experiment, args.name, args.mode, columns, args.limit, args.all,
                                      args.where)
        results.print_frame(frame, f"no runs in {store.uri} match")
        return 0
    frame = results.compare_table(store, args.a, args.b)
    shown = frame if args.all else frame[(frame["delta"].fillna(1) != 0)]
    results.print_frame(shown, "the two runs have the same metrics")
    regressions = int((frame["verdict"] == "REGRESSION").sum())
    print(f"\n{len(frame)} metrics, {regressions} regression{'s' if regressions != 1 else ''} beyond the runs' spread")
    return 1 if regressions and args.fail_on_regression else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _parser(command: str, description: str, manifest: bool = True) -> argparse.ArgumentParser:
    prog = "run" if command == "run" else f"run {command}"
    parser = _Parser(prog=prog, description=description,
                     epilog="Commands: run MANIFEST | run check MANIFEST | run plan MANIFEST | run schema | "
                            "run results | run compare A B")
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    if manifest:
        parser.add_argument("manifest", help="path to a manifest .yaml file")
        parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seed=1 "
                            "targets.0.runs.0.generate.temperature=0.7")
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its message but say where to look."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        print(f"error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)
