"""The `run` command: argv → compose → plan → execute. A RunnerError prints its message and exits 2.

    run MANIFEST.yaml [key=value ...]         run every step of the manifest
    run check MANIFEST.yaml [key=value ...]   validate only (no torch import)
    run plan MANIFEST.yaml [key=value ...]    print the plan with each step's hash
    run schema                                print the manifest's JSON Schema
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from runner import __version__
from runner.errors import RunnerError

COMMANDS = ("check", "plan", "schema")


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


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _parser(command: str, description: str, manifest: bool = True) -> argparse.ArgumentParser:
    prog = "run" if command == "run" else f"run {command}"
    parser = _Parser(prog=prog, description=description,
                     epilog="Commands: run MANIFEST | run check MANIFEST | run plan MANIFEST | run schema")
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
