"""Check, on the MLflow tracking server, that a sweep's every point finished with all it should have.

    python cluster/check_server.py --uri http://127.0.0.1:5000 --sweep RUNS/<stamp>-cluster [--killed 1]

Reads the sweep folder's sweep.json (the points and their swept values), then asks the server, not the
folder: one parent run for the sweep, FINISHED; exactly one point run per point (no duplicates after a
resume), FINISHED, tagged sweep.<key>=<value> and runner.sweep_point; under each point exactly one
FINISHED run per step with params, metrics and artifacts (results.json; a bench step's PNG, downloaded
through the server's artifact proxy and checked to be a PNG). `--killed N`: point N was killed once and
resumed, so its killed attempt's step run may stand beside the finished one, ended KILLED; anywhere
else a run that is not FINISHED fails the check. Prints one line per point; exits 1 naming every problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path


def check(uri: str, folder: Path, killed: set[int], steps: list[str], experiment: str) -> list[str]:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    record = json.loads((folder / "sweep.json").read_text(encoding="utf-8"))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return [f"no experiment '{experiment}' on {uri}"]
    problems = []
    if not found.artifact_location.startswith("mlflow-artifacts:"):
        problems.append(f"experiment artifact location {found.artifact_location}: not the server's proxy")
    runs = client.search_runs([found.experiment_id], f"tags.`runner.sweep_id` = '{folder.name}'",
                              max_results=10_000)
    by_parent: dict[str, list] = {}
    for run in runs:
        by_parent.setdefault(run.data.tags.get("mlflow.parentRunId"), []).append(run)
    parents = [r for r in runs if r.data.tags.get("runner.sweep") == "parent"]
    if len(parents) != 1:
        return problems + [f"{len(parents)} sweep parent runs for {folder.name} (expected 1)"]
    parent = parents[0]
    if parent.info.status != "FINISHED":
        problems.append(f"sweep run {parent.info.run_id}: {parent.info.status}")
    if "sweep.points" not in parent.data.params:
        problems.append("sweep run: no sweep.points param")
    points = by_parent.get(parent.info.run_id, [])
    count = Counter(r.data.tags.get("runner.sweep_point") for r in points)
    for entry in record["points"]:
        index = entry["index"]
        mine = [r for r in points if r.data.tags.get("runner.sweep_point") == str(index)]
        where = f"point {index}"
        if len(mine) != 1:
            problems.append(f"{where}: {len(mine)} point runs on the server (expected 1)")
            continue
        run = mine[0]
        if run.info.status != "FINISHED":
            problems.append(f"{where}: point run {run.info.status}")
        for key, value in entry["values"].items():
            if run.data.tags.get(f"sweep.{key}") != value:
                problems.append(f"{where}: tag sweep.{key}={run.data.tags.get(f'sweep.{key}')!r}, expected {value!r}")
        children = by_parent.get(run.info.run_id, [])
        line = []
        for step in steps:
            attempts = [r for r in children if r.info.run_name == step]
            done = [r for r in attempts if r.info.status == "FINISHED"]
            others = sorted(r.info.status for r in attempts if r.info.status != "FINISHED")
            if len(done) != 1:
                problems.append(f"{where}: {len(done)} FINISHED runs of step {step} (expected 1)")
                continue
            if others and (index not in killed or set(others) != {"KILLED"}):
                problems.append(f"{where}: step {step} also has runs {others}")
            problems += [f"{where} step {step}: {p}" for p in _step_problems(client, done[0], entry["values"])]
            line.append(f"{step} FINISHED" + (f" (+{len(others)} {'/'.join(others)} attempt)" if others else ""))
        print(f"[check] point {index} {run.info.status}: {', '.join(line)}  "
              f"{' '.join(f'{k.split(chr(46))[-1]}={v}' for k, v in entry['values'].items())}", flush=True)
    extra = [k for k in count if k not in {str(p["index"]) for p in record["points"]}]
    if extra:
        problems.append(f"point runs for points not in the sweep: {extra}")
    return problems


def _step_problems(client, run, values: dict) -> list[str]:
    problems = []
    if not run.data.metrics:
        problems.append("no metrics")
    if "mode" not in run.data.params:
        problems.append("no params (mode missing)")
    for key, value in values.items():
        if run.data.tags.get(f"sweep.{key}") != value:
            problems.append(f"tag sweep.{key} missing or wrong")
    names = [a.path for a in client.list_artifacts(run.info.run_id)]
    if "results.json" not in names:
        problems.append(f"no results.json artifact (has {names})")
    if run.data.params.get("mode") == "bench":
        pngs = [n for n in names if n.endswith(".png")]
        if not pngs:
            problems.append(f"bench step without a PNG artifact (has {names})")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(client.download_artifacts(run.info.run_id, pngs[0], tmp))
                if local.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
                    problems.append(f"{pngs[0]} downloaded from the server is not a PNG")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", required=True)
    parser.add_argument("--sweep", required=True, type=Path, help="the sweep folder (holds sweep.json)")
    parser.add_argument("--experiment", default="cluster")
    parser.add_argument("--steps", default="tiny/sample,tiny/bench", help="step keys every point has")
    parser.add_argument("--killed", type=int, action="append", default=[], help="a point killed once, then resumed")
    args = parser.parse_args()
    problems = check(args.uri, args.sweep, set(args.killed), args.steps.split(","), args.experiment)
    if problems:
        print(f"[check] {args.sweep.name} on {args.uri}: {len(problems)} problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"[check] {args.sweep.name}: every point FINISHED on {args.uri} with tags, params, metrics, artifacts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
