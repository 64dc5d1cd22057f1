"""`run schema`'s JSON Schema agrees with the validator: it accepts every example manifest (composed, as Hydra
composes its `defaults:`), every valid spelling the validator takes, and refuses representative bad inputs.
The schema is checked by `jsonschema` (Draft 2020-12, what pydantic emits), as an editor would check a manifest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from runner.manifest.compose import _compose
from runner.manifest.schema import Manifest
from runner.manifest.sources import read_sources

ROOT = Path(__file__).parents[2]
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
BAD = ROOT / "tests" / "bad_inputs"


@pytest.fixture(scope="module")
def schema() -> dict:
    done = subprocess.run([sys.executable, "-m", "runner", "schema"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check(value: dict, schema: dict) -> list[str]:
    """Why the schema refuses `value`, as an editor's JSON Schema validator says it; [] when it accepts it."""
    found = jsonschema.Draft202012Validator(schema).iter_errors(value)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_schema_accepts_every_example_manifest_as_composed(path, schema):
    raw = _compose(path, [], read_sources(path))  # `defaults:` fragments merged in, as the validator sees it
    assert check(raw, schema) == []


GOOD = {"targets": [{"name": "a", "runs": [{"id": "r", "mode": "generate", "generate": {"prompts": ["hi"]}}]}]}


def _run(**run) -> dict:
    return {"targets": [{"name": "a", "model": "zoo:smollm2-135m", "runs": [{"id": "r", **run}]}]}


VALID = {  # spellings the validator takes (and the docs name): one value where a list goes, shorthands, no name
    "no name (the file's stem)": GOOD,
    "model as a string": _run(mode="generate"),
    "one prompt": _run(mode="generate", generate={"prompts": "hi", "stop_strings": "\n"}),
    "one quantization": _run(mode="bench", bench={"quantizations": "none", "cache_kinds": "fp16", "dtypes": "float32",
                                                  "batch_sizes": 2, "prompt_lens": 16, "max_new_tokens": 4,
                                                  "engines": "compiled", "baseline": "none"}),
    "one candidate": _run(mode="auto-cache-select", generate={"cache_candidates": "q8_0", "weight_candidates": "int8"}),
    "draft as a string": _run(mode="speculative", speculative={"draft": "zoo:smollm2-135m"}),
    "engine alone": _run(mode="bench", bench={"engine": "compiled", "baseline": ["hf", "hf-compiled"]}),
    "serve counts alone": _run(mode="serve", serve={"rate": 2, "prompt_tokens": 64, "percentiles": 99,
                                                    "output_tokens": {"dist": "uniform", "min": 1, "max": 8},
                                                    "baselines": "none", "cache_kinds": "q8_0"}),
}


@pytest.mark.parametrize("name", VALID)
def test_the_schema_accepts_what_the_validator_accepts(name, schema):
    data = VALID[name]
    Manifest.model_validate({"name": "m", **data})
    assert check(data, schema) == []


def test_one_value_is_a_one_element_list():
    bench = Manifest.model_validate({"name": "m", **VALID["one quantization"]}).targets[0].runs[0].bench
    assert bench is not None
    assert (bench.quantizations, bench.cache_kinds, bench.dtypes, bench.batch_sizes) == (["none"], ["fp16"],
                                                                                        ["float32"], [2])
    assert bench.engines == ["compiled"] and bench.baseline == []


INVALID = ["unknown_generate_key", "bool_max_new_tokens", "max_new_tokens_1e30", "seed_beyond_2_63", "bad_dtype",
           "empty_targets", "wrong_type_list", "bench_zero_batch", "bool_in_bench_list", "serve_rate_zero",
           "serve_slo_negative", "serve_slo_not_a_number", "serve_unknown_key", "serve_distribution_unknown_key"]


@pytest.mark.parametrize("name", INVALID)
def test_the_schema_refuses_representative_bad_inputs(name, schema):
    data = yaml.safe_load((BAD / f"{name}.yaml").read_text(encoding="utf-8"))
    assert check(data, schema), f"{name}.yaml is accepted by the schema"
