"""`run schema`'s JSON Schema agrees with the validator: it accepts every example manifest (composed, as Hydra
composes its `defaults:`), every valid spelling the validator takes, and refuses representative bad inputs.

The `jsonschema` package is not a dependency; the schema pydantic emits uses a handful of keywords, so a small
validator for exactly those (below) checks it, and `test_the_small_validator_knows_every_keyword_used` fails the day
the schema uses one it does not know, so nothing is silently skipped. Where jsonschema is installed it is asked too.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.manifest.compose import _compose
from runner.manifest.schema import Manifest
from runner.manifest.sources import read_sources

ROOT = Path(__file__).parents[2]
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
BAD = ROOT / "tests" / "bad_inputs"
CHECKED = {"$ref", "additionalProperties", "anyOf", "const", "enum", "exclusiveMinimum", "items", "maxLength",
           "maximum", "minItems", "minLength", "minProperties", "minimum", "pattern", "patternProperties",
           "properties", "propertyNames", "required", "type"}
ANNOTATIONS = {"$defs", "default", "description", "title", "input_file"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


@pytest.fixture(scope="module")
def schema() -> dict:
    done = subprocess.run([sys.executable, "-m", "runner", "schema"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def errors(value, node: dict, root: dict, where: str = "") -> list[str]:
    """Why `value` does not match `node` (JSON Schema 2020-12, the keywords in CHECKED); [] when it does."""
    if "$ref" in node:
        return errors(value, root["$defs"][node["$ref"].rsplit("/", 1)[1]], root, where)
    if "anyOf" in node and all(errors(value, option, root, where) for option in node["anyOf"]):
        return [f"{where}: {value!r} matches no choice"]
    if "type" in node and not _is_type(value, node["type"]):
        return [f"{where}: {value!r} is not {node['type']}"]
    out = []
    if "const" in node and value != node["const"] or "enum" in node and value not in node["enum"]:
        out.append(f"{where}: {value!r} not allowed")
    if isinstance(value, str):
        if len(value) < node.get("minLength", 0) or len(value) > node.get("maxLength", math.inf):
            out.append(f"{where}: length")
        if "pattern" in node and not re.search(node["pattern"], value):
            out.append(f"{where}: pattern")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < node.get("minimum", -math.inf) or value > node.get("maximum", math.inf) or \
                value <= node.get("exclusiveMinimum", -math.inf):
            out.append(f"{where}: {value} out of range")
    if isinstance(value, list):
        if len(value) < node.get("minItems", 0):
            out.append(f"{where}: too few items")
        for i, item in enumerate(value):
            out += errors(item, node.get("items", {}), root, f"{where}[{i}]")
    if isinstance(value, dict):
        if len(value) < node.get("minProperties", 0):
            out.append(f"{where}: too few keys")
        out += [f"{where}.{key}: required" for key in node.get("required", []) if key not in value]
        for key, item in value.items():
            out += errors(key, node.get("propertyNames", {}), root, f"{where}.{key} (name)")
            if key in node.get("properties", {}):
                out += errors(item, node["properties"][key], root, f"{where}.{key}")
                continue
            matched = [s for p, s in node.get("patternProperties", {}).items() if re.search(p, key)]
            for sub in matched:
                out += errors(item, sub, root, f"{where}.{key}")
            extra = node.get("additionalProperties", True)
            if not matched and extra is False:
                out.append(f"{where}.{key}: unknown key")
            elif not matched and isinstance(extra, dict):
                out += errors(item, extra, root, f"{where}.{key}")
    return out


def _is_type(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[kind])


def check(value: dict, schema: dict) -> list[str]:
    found = errors(value, schema, schema)
    try:
        import jsonschema
    except ImportError:
        return found
    assert bool(found) == (not jsonschema.Draft202012Validator(schema).is_valid(value)), found
    return found


def test_the_small_validator_knows_every_keyword_used(schema):
    used: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                used.add(key)
                for child in value.values() if key in ("properties", "$defs", "patternProperties") else [value]:
                    walk(child)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(schema)
    assert used <= CHECKED | ANNOTATIONS, f"teach errors() these keywords: {sorted(used - CHECKED - ANNOTATIONS)}"


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
           "empty_targets", "wrong_type_list", "bench_zero_batch", "bool_in_bench_list"]


@pytest.mark.parametrize("name", INVALID)
def test_the_schema_refuses_representative_bad_inputs(name, schema):
    data = yaml.safe_load((BAD / f"{name}.yaml").read_text(encoding="utf-8"))
    assert check(data, schema), f"{name}.yaml is accepted by the schema"
