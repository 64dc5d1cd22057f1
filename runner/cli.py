"""The `run` command: argv → compose → plan → execute. A RunnerError prints its message and exits 2.

    run MANIFEST.yaml [key=value ...]         run every step of the manifest
    run MANIFEST.yaml -m key=a,b other=x,y    a sweep (Hydra's multirun grammar); also a manifest's `sweep:`
    run MANIFEST.yaml ... --resume            go on with the latest unfinished run (or sweep) of this manifest
    run check MANIFEST.yaml [key=value ...]   validate only (no torch import); every sweep point
    run plan MANIFEST.yaml [key=value ...]    print the plan with each step's hash; per sweep point
    run schema                                print the manifest's JSON Schema
    run results [--experiment E] [--mode M]   a table of past runs from MLflow
    run compare A B                           two runs' metrics side by side, regressions flagged
    run serve MANIFEST.yaml [--run ID] [--host H] [--port P]   its serve run behind an OpenAI-compatible HTTP server
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from runner import __version__, report
from runner.errors import ManifestError, RunnerError

COMMANDS = ("check", "plan", "schema", "results", "compare", "serve")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    try:
        return _dispatch(command, argv)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted: status.json (sweep.json for a sweep) says what finished; go on with --resume",
              file=sys.stderr)
        sys.unraisablehook = _ignore  # a Ctrl-C inside a constructor (a progress bar's) makes its finalizer fail later
        return 130


def _dispatch(command: str, argv: list[str]) -> int:
    if command == "schema":
        _parse(_parser("schema", "Print the manifest's JSON Schema (for editor completion).", manifest=False), argv)
        from runner.manifest.schema import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    if command in ("results", "compare"):
        return _browse(command, argv)
    if command == "serve":
        return _serve(argv)
    descriptions = {
        "run": "Run a manifest: validate, plan, execute; results go to runs/ and MLflow.",
        "check": "Validate a manifest and its overrides; exits 2 with every problem listed.",
        "plan": "Print the plan: one line per step, with its content hash.",
    }
    args = _parse(_parser(command, descriptions[command]), argv, intermixed=True)
    from runner.execute.launchers import is_hydra_override, is_launcher_fragment, refuse_missing_plugin
    from runner.execute.sweep import split_sweep
    from runner.manifest.compose import load_manifest

    path = Path(args.manifest)
    hydra_args = [o for o in args.overrides if is_hydra_override(o)]
    overrides = [o for o in args.overrides if not is_hydra_override(o)]
    fixed, swept = split_sweep(overrides, str(path))
    try:
        manifest, resolved = load_manifest(path, fixed)
    except ManifestError as exc:  # a launcher fragment composed with the manifest: its plugin may be missing
        refuse_missing_plugin(str(exc))
        raise
    if args.multirun or manifest.sweep:  # a manifest with a sweep: block is a sweep without -m
        return _sweep(command, args, path, manifest, overrides, hydra_args)
    if swept:
        raise RunnerError(f"override '{swept[0]}' is a sweep: add -m (multirun) to run every value, "
                          f"or give one value")
    launcher = [o for o in overrides if is_launcher_fragment(o)]
    if launcher:
        raise RunnerError(f"override '{launcher[0]}' chooses Hydra's launcher, which runs sweeps only: add -m "
                          "(multirun), or leave it out to run here")
    if hydra_args:
        raise RunnerError(f"override '{hydra_args[0]}' configures Hydra's launcher: add -m (multirun)")
    return _single(command, args, path, manifest, resolved)


def _single(command: str, args, path: Path, manifest, resolved: dict) -> int:
    from runner.manifest.plan import make_plan

    plan = make_plan(manifest, path.parent)
    if command == "check":
        print(f"{path}: ok ({_count(len(plan.steps), 'step')})")
        return 0
    if command == "plan":
        print(plan.describe())
        return 0
    from runner.execute.tracking import RunFolder, require_server

    if manifest.tracking.mlflow:  # before torch is imported: a server that does not answer is said in seconds
        require_server(manifest.tracking.tracking_uri, "tracking.tracking_uri")
    from runner.execute.executor import execute

    previous = _resume_folder(args, manifest, "status.json")
    folder = RunFolder.at(previous) if previous else RunFolder.create(manifest.tracking.runs_dir, manifest.name)
    _catch_signals()
    outcome = execute(manifest, resolved, plan, path, folder, progress=Bar)
    print(f"[runner] results: {outcome.folder}", file=sys.stderr)
    if outcome.reused:
        print(f"[runner] resumed: {_count(len(outcome.reused), 'step')} finished earlier, "
              f"{len(plan.steps) - len(outcome.reused)} run now", file=sys.stderr)
    if outcome.failed:
        skipped = f"; skipped (on_failure: stop): {', '.join(outcome.skipped)}" if outcome.skipped else ""
        print(f"error: {len(outcome.failed)} of {len(plan.steps)} steps failed: {', '.join(outcome.failed)}{skipped}",
              file=sys.stderr)
        return RunnerError.exit_code
    return 0


def _browse(command: str, argv: list[str]) -> int:
    """`run results` and `run compare`: read-only views of the MLflow store."""
    from runner.execute import results

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
        parser.add_argument("--limit", type=_positive, default=50, help="most rows (default 50)")
        parser.add_argument("--all", action="store_true", help="also the parent runs (one per invocation)")
    else:
        parser = _parser("compare", "Two runs' metrics side by side; a change is flagged only when it is larger "
                         "than the runs' own recorded spread.", manifest=False)
        parser.add_argument("a", help="the baseline invocation: its MLflow run id (or a unique prefix) or run folder")
        parser.add_argument("b", help="the invocation to compare with it: run id, prefix or run folder")
        parser.add_argument("--all", action="store_true", help="every metric, not only those that differ")
        parser.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a regression is flagged")
    parser.add_argument("--runs-dir", default="runs", help="where run folders and mlflow.db are (default runs)")
    parser.add_argument("--tracking-uri", help="an MLflow tracking URI instead of <runs-dir>/mlflow.db")
    args = _parse(parser, argv)
    for condition in getattr(args, "where", ()):  # the options' form first, before any store is opened
        results.where_condition(condition)
    problem = results.mode_problem(args.mode) if getattr(args, "mode", None) else None
    if problem:
        raise RunnerError(problem)
    store = results.Store(args.tracking_uri, args.runs_dir)
    if command == "results":
        columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
        frame = results.results_table(store, args.experiment, args.name, args.mode, columns, args.limit, args.all,
                                      args.where)
        print(results.format_frame(frame, f"no runs in {store.uri} match"))
        return 0
    frame = results.compare_table(store, args.a, args.b)
    shown = frame if args.all else frame[(frame["delta"].fillna(1) != 0)]
    print(results.format_frame(shown, "the two runs have the same metrics"))
    regressions = int((frame["verdict"] == "REGRESSION").sum())
    print(f"\n{len(frame)} metrics, {regressions} regression{'s' if regressions != 1 else ''} beyond the runs' spread")
    return 1 if regressions and args.fail_on_regression else 0


def _serve(argv: list[str]) -> int:
    """`run serve`: the server until Ctrl-C (or SIGTERM); the first drains (new requests get 503, accepted ones
    finish), a second cancels what runs."""
    parser = _parser("serve", "Serve a manifest's mode: serve run (its model, scheduler limits, first cache kind and "
                     "engine) over an OpenAI-compatible HTTP API with Prometheus /metrics.", manifest=False)
    parser.add_argument("manifest", help="path to a manifest .yaml file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. targets.0.runs.0.serve.max_queue=8")
    parser.add_argument("--run", help="the serve run to serve (its id, or target/id) when the manifest has several")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                        "only; 0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: any free port)")
    args = _parse(parser, argv, intermixed=True)
    from runner.execute.http_serve import serve_target, start_server

    target = serve_target(Path(args.manifest), args.overrides, args.run)
    server = start_server(target, args.host, args.port)
    print(f"serving {target.model_name} at {server.url} (OpenAI API: {server.url}/v1, metrics: {server.url}/metrics)",
          flush=True)
    print("[runner] Ctrl-C drains (finishes what runs, accepts nothing new); a second Ctrl-C cancels what runs",
          file=sys.stderr, flush=True)
    signals: list[int] = []

    def interrupted(signum, frame) -> None:
        signals.append(signum)
        if len(signals) == 1:
            server.drain()
            print(f"\n[runner] draining: {server.engine.in_flight} requests in flight finish, new ones get 503 "
                  "(Ctrl-C again cancels them)", file=sys.stderr, flush=True)
        elif len(signals) == 2:
            server.cancel_running()
            print(f"[runner] cancelling the {server.engine.in_flight} requests in flight", file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    try:
        while not (signals and server.idle):
            time.sleep(0.05)
    finally:
        server.stop()
    print("[runner] stopped" + (": drained" if len(signals) == 1 else ": cancelled what ran"), file=sys.stderr)
    return 0


def _port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {text!r}")
    return int(text)


def _sweep(command: str, args, path: Path, manifest, overrides: list[str], hydra_args: list[str]) -> int:
    from runner.execute import launchers, sweep
    from runner.manifest.sources import read_sources

    launchers.refuse_unsweepable(overrides + hydra_args, manifest.sweep, path)
    arguments = sweep.sweep_arguments(manifest.sweep, overrides)
    where = "command line" if args.multirun and not manifest.sweep else read_sources(path).at(("sweep",))
    points = sweep.expand(arguments, str(path), list(manifest.sweep), manifest.sweep_max_points, where)
    sweep.validate_points(path, points, sweep.manifest_keys(manifest.sweep, overrides))
    launchers.validate_launcher(path, arguments, hydra_args)
    if command == "check":
        print(f"{path}: ok (sweep of {_count(len(points), 'point')}, each valid)")
        return 0
    if command == "plan":
        from runner.manifest.compose import load_manifest
        from runner.manifest.plan import make_plan

        for point in points:
            print(f"point {point.index}: {point.label}")
            print(make_plan(load_manifest(path, list(point.overrides))[0], path.parent).describe())
        return 0
    from runner.execute.tracking import require_server

    if manifest.tracking.mlflow:
        require_server(manifest.tracking.tracking_uri, "tracking.tracking_uri")
    previous = _resume_folder(args, manifest, "sweep.json")
    _catch_signals()
    outcome = sweep.run_sweep(path, manifest, arguments, points, hydra_args, resume=previous, progress=Bar)
    print(sweep.describe(outcome, points), file=sys.stderr)
    if outcome.failed:
        print(f"error: {len(outcome.failed)} of {len(points)} points failed: "
              f"{', '.join(str(i) for i in outcome.failed)}", file=sys.stderr)
        return RunnerError.exit_code
    return 0


def _resume_folder(args, manifest, record: str) -> Path | None:
    """--resume-from FOLDER, or --resume: the newest unfinished folder of this manifest's name."""
    from runner.execute.tracking import latest_unfinished

    if args.resume_from:
        folder = Path(args.resume_from)
        if not (folder / record).is_file():
            what = "sweep folder (sweep.json)" if record == "sweep.json" else "run folder (status.json)"
            raise RunnerError(f"--resume-from {folder}: not a {what}")
        return folder
    if not args.resume:
        return None
    unfinished = latest_unfinished(manifest.tracking.runs_dir, manifest.name, record)
    if unfinished is None:
        kind = "sweep" if record == "sweep.json" else "run"
        raise RunnerError(f"--resume: no unfinished {kind} of '{manifest.name}' under "
                          f"{Path(manifest.tracking.runs_dir).resolve()}; run without --resume")
    print(f"[runner] resuming {unfinished}", file=sys.stderr, flush=True)
    return unfinished


def _catch_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background, where SIGINT is ignored
        signal.signal(sig, _interrupt)


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _ignore(unraisable) -> None:
    pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _parser(command: str, description: str, manifest: bool = True) -> argparse.ArgumentParser:
    prog = "run" if command == "run" else f"run {command}"
    parser = _Parser(prog=prog, description=description,
                     epilog="Commands: run MANIFEST | run check MANIFEST | run plan MANIFEST | run schema | "
                            "run results | run compare A B | run serve MANIFEST")
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-v", "--verbose", action="store_true", help="also debug messages, with their module")
    loudness.add_argument("-q", "--quiet", action="store_true", help="only warnings, errors and results")
    if manifest:
        parser.add_argument("manifest", help="path to a manifest .yaml file")
        parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seed=1 "
                            "targets.0.runs.0.generate.temperature=0.7; with -m, sweeps: key=a,b key=range(1,4) "
                            "and Hydra's launcher: hydra/launcher=joblib hydra.launcher.n_jobs=2")
        parser.add_argument("-m", "--multirun", action="store_true", help=(
            "run every combination of the sweep overrides (and the manifest's sweep:) through Hydra's launcher"))
        parser.add_argument("--resume", action="store_true", help=(
            "go on with the newest unfinished run (or sweep) of this manifest: finished steps are skipped by hash"))
        parser.add_argument("--resume-from", metavar="FOLDER", help="go on with this run (or sweep) folder")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str], intermixed: bool = False) -> argparse.Namespace:
    """Parse, then set up the library's logging once, as -v / -q say."""
    args = parser.parse_intermixed_args(argv) if intermixed else parser.parse_args(argv)
    report.configure(1 if args.verbose else -1 if args.quiet else 0)
    return args


class Bar(report.Progress):
    """Progress drawn as a tqdm bar on stderr (silent with -q)."""

    def __init__(self, description: str, total: int, unit: str):
        super().__init__(description, total, unit)
        from tqdm import tqdm

        quiet = not logging.getLogger("runner").isEnabledFor(logging.INFO)
        self.bar = tqdm(total=total, desc=description, unit=unit, file=sys.stderr, disable=quiet)

    def update(self, n: int = 1, note: str = "") -> None:
        super().update(n, note)
        if note:
            self.bar.set_postfix_str(note, refresh=False)
        self.bar.update(n)

    def set_total(self, total: int) -> None:
        super().set_total(total)
        self.bar.total = total
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its message but say where to look."""

    def error(self, message: str):
        message = message.replace("manifest, overrides", "manifest")  # argparse lists the optional overrides too
        self.print_usage(sys.stderr)
        print(f"error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)
