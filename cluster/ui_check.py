"""The MLflow UI of a sweep, checked in a real browser (Debian's chromium, driven by Playwright).

    python cluster/ui_check.py --uri http://127.0.0.1:5000 --sweep RUNS/<stamp>-cluster --out DIR

What a person would do, asserted, with a screenshot of each in DIR:
  1. runs.png      the experiment's runs filtered to this sweep (tags.`runner.sweep_id`): its parent run,
                   expanded to its point runs, expanded to their step runs (every name the server has)
  2. filtered.png  the same, also filtered on a sweep tag (tags.`sweep.<key>` = '<value>'): the matching
                   point runs are listed, the others are not
  3. point.png     a point run's page: its sweep.* tags and values are shown
  4. artifact.png  a bench step's PNG artifact opened in the artifact browser: the image loaded (its
                   natural width > 0), served through the tracking server
Exits 1 naming the first thing not found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

EXPAND = 'button[data-component-id$="runnamecellrenderer.tsx_46"]'  # the +/- beside a parent run's name
PLUS = "V4.5h1.5v2.75"  # a fragment of the "+" icon's path: the row is collapsed
TAG_SHOWN = """([key, value]) => [...document.querySelectorAll('*')].some(
    e => e.children.length < 4 && e.textContent.replace(/\\s+/g, ' ').trim() === `${key}: ${value}`)"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", required=True)
    parser.add_argument("--sweep", required=True, type=Path)
    parser.add_argument("--experiment", default="cluster")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import sync_playwright

    client = MlflowClient(tracking_uri=args.uri)
    experiment = client.get_experiment_by_name(args.experiment)
    record = json.loads((args.sweep / "sweep.json").read_text(encoding="utf-8"))
    runs = client.search_runs([experiment.experiment_id], f"tags.`runner.sweep_id` = '{args.sweep.name}'")
    (parent,) = [r for r in runs if r.data.tags.get("runner.sweep") == "parent"]
    points = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    steps = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in {p.info.run_id for p in points}]
    key, value = next(iter(record["points"][0]["values"].items()))
    this_sweep = f"tags.`runner.sweep_id` = '{args.sweep.name}'"  # the experiment may hold other sweeps
    tag_filter = f"{this_sweep} and tags.`sweep.{key}` = '{value}'"
    expected_matches = len(client.search_runs([experiment.experiment_id], tag_filter))
    bench = next(r for r in steps if r.data.params.get("mode") == "bench" and r.info.status == "FINISHED")
    png = next(a.path for a in client.list_artifacts(bench.info.run_id) if a.path.endswith(".png"))
    base = f"{args.uri}/#/experiments/{experiment.experiment_id}"
    with tempfile.TemporaryDirectory() as tmp:  # the PNG's own width, from its IHDR chunk
        local = Path(client.download_artifacts(bench.info.run_id, png, tmp))
        png_width = int.from_bytes(local.read_bytes()[16:20], "big")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            _check(page, base, args.out, parent, points, steps, key, value, this_sweep, tag_filter, expected_matches,
                   bench, png, png_width)
        except Exception:
            page.screenshot(path=str(args.out / "failure.png"))
            print(f"[ui] failed on {page.url}; the page as it was: {args.out / 'failure.png'}", file=sys.stderr)
            raise
        finally:
            browser.close()
    print(f"[ui] screenshots: {args.out}")
    return 0


def _expand_collapsed(page, passes: int) -> None:
    """Expand every collapsed parent row (the sweep, its points), one per pass: rows move as others open, so a button
    found before a click may be gone after it (CI once timed out on one)."""
    for _ in range(passes):
        collapsed = [b for b in page.locator(EXPAND).all() if PLUS in b.inner_html()]
        if not collapsed:
            return
        collapsed[0].click()
        page.wait_for_timeout(300)


def _check(page, base, out, parent, points, steps, key, value, this_sweep, tag_filter, expected_matches, bench,
           png, png_width) -> None:
    # 1. the runs, the sweep's tree expanded
    page.goto(f"{base}/runs")
    search = page.get_by_placeholder("metrics.rmse", exact=False).first
    search.fill(this_sweep)
    search.press("Enter")
    page.get_by_text(parent.info.run_name).first.wait_for()
    close = page.get_by_role("button", name="Close")
    if close.count():
        close.first.click()  # the assistant's side panel
    want = {name: sum(r.info.run_name == name for r in steps) for name in sorted({r.info.run_name for r in steps})}
    for _ in range(20):  # until every step run is listed: a point's row can render after the pass looked for it
        _expand_collapsed(page, 2 * (1 + len(points)))
        for run in [parent, *points]:
            page.get_by_text(run.info.run_name, exact=True).first.wait_for()
        shown = {name: page.get_by_text(name, exact=True).count() for name in want}
        if all(shown[name] >= want[name] for name in want):
            break
        page.wait_for_timeout(500)
    for name, count in want.items():
        _require(shown[name] >= count, f"step runs '{name}': {shown[name]} on the page, {count} on the server")
    page.screenshot(path=str(out / "runs.png"))
    print(f"[ui] runs: '{parent.info.run_name}' with {len(points)} point runs and {len(steps)} step runs listed")

    # 2. filtered on a sweep tag
    search.fill(tag_filter)
    search.press("Enter")
    matching = [r for r in points if r.data.tags.get(f"sweep.{key}") == value]
    page.get_by_text(matching[0].info.run_name, exact=True).first.wait_for()
    page.wait_for_function("t => !document.body.innerText.includes(t)", arg=next(
        r.info.run_name for r in points if r not in matching))  # the other points are filtered out
    for run in points:
        shown = page.get_by_text(run.info.run_name, exact=True).count()
        _require(shown == (run in matching), f"filter {tag_filter}: '{run.info.run_name}' shown {shown} times")
    page.screenshot(path=str(out / "filtered.png"))
    print(f"[ui] filter {tag_filter}: the {len(matching)} matching point runs (of {len(points)}) and their steps "
          f"({expected_matches} runs on the server) listed, no other point")

    # 3. a point run's page: its sweep tags
    point = next(r for r in points if r.data.tags.get(f"sweep.{key}") == value)
    page.goto(f"{base}/runs/{point.info.run_id}")
    page.get_by_text(point.info.run_name).first.wait_for()
    page.get_by_role("link", name=steps[0].info.run_name).first.wait_for()  # its child runs, listed
    for tag, tag_value in point.data.tags.items():
        if tag.startswith("sweep."):  # shown as "key: value" in the Tags box (the key cut short on screen only)
            page.wait_for_function(TAG_SHOWN, arg=[tag, tag_value])
    page.screenshot(path=str(out / "point.png"), full_page=True)
    print(f"[ui] point run '{point.info.run_name}': its sweep.* tags shown")

    # 4. the bench step's PNG, rendered
    page.goto(f"{base}/runs/{bench.info.run_id}/artifacts/{png}")
    page.get_by_text(f"{png}", exact=True).first.wait_for()  # the preview's title (the image is a blob: URL)
    page.wait_for_function(  # an image in the page, loaded, as wide as the PNG itself: fetched through the server
        "w => [...document.images].some(i => i.complete && i.naturalWidth === w)", arg=png_width)
    page.screenshot(path=str(out / "artifact.png"))
    print(f"[ui] bench artifact {png} of '{bench.info.run_name}' rendered ({png_width} px wide, as the file)")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"[ui] {message}")


if __name__ == "__main__":
    sys.exit(main())
