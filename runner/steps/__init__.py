"""One module per mode: each turns a Step and a loaded model into a result dict with `metrics`.

A runner is called as `run(step, lm, base_dir, out_dir, progress)`: `base_dir` is the manifest's folder (relative
paths), `out_dir` the step's results folder for tables and plots, `progress` makes a runner.report.Progress for
long work. An optional `params` entry of the
result is logged to MLflow as parameters, and an optional `series` (name → list) as metric histories.
"""

from runner.steps.bench import run_bench
from runner.steps.cache_select import run_cache_select
from runner.steps.eval import run_eval
from runner.steps.generate import run_generate
from runner.steps.serve import run_serve
from runner.steps.speculative import run_speculative

STEP_RUNNERS = {"generate": run_generate, "auto-cache-select": run_cache_select, "speculative": run_speculative,
                "bench": run_bench, "serve": run_serve, "eval": run_eval}
