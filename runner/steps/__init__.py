"""One module per mode: each turns a Step and a loaded model into a result dict with `metrics`."""

from runner.steps.generate import run_generate

STEP_RUNNERS = {"generate": run_generate}
