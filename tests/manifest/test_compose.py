"""Composition, validation and located errors: every problem at once, with file:line:col and a hint."""

import json
from pathlib import Path

import pytest

from runner.errors import ManifestError
from runner.manifest.compose import fields_at, load_manifest

MANIFESTS = sorted(Path(__file__).resolve().parents[2].joinpath("manifests").glob("*.yaml"))
GOOD = """\
name: t
targets:
  - name: a
    runs:
      - id: r
        mode: generate
        generate:
          prompts: [hi]
          max_new_tokens: 4
"""


def write(tmp_path, text, name="m.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(path, overrides=()):
    with pytest.raises(ManifestError) as info:
        load_manifest(path, overrides)
    return info.value


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_example_manifest_validates(path):
    manifest, _ = load_manifest(path)
    assert manifest.targets


def test_defaults_fragment_and_interpolation_compose():
    manifest, raw = load_manifest(Path(__file__).resolve().parents[2] / "manifests" / "tiny.yaml")
    assert manifest.targets[0].model.config["model_type"] == "llama"
    assert raw["targets"][0]["model"] == raw["models"]["tiny"]


def test_name_defaults_to_file_stem_and_model_to_the_embedded_default(tmp_path):
    manifest, _ = load_manifest(write(tmp_path, GOOD.replace("name: t\n", ""), "my-exp.yaml"))
    assert manifest.name == "my-exp"
    assert manifest.targets[0].model.id == "zoo:smollm2-135m"


def test_unknown_key_names_line_path_and_closest_key(tmp_path):
    err = errors_of(write(tmp_path, GOOD.replace("max_new_tokens", "max_new_token")))
    (problem,) = err.problems
    assert problem.path == "targets[0].runs[0].generate.max_new_token"
    assert problem.source == f"{tmp_path / 'm.yaml'}:9:11"
    assert "did you mean 'max_new_tokens'?" in str(err)


def test_every_problem_is_reported_at_once(tmp_path):
    text = GOOD.replace("max_new_tokens: 4", "max_new_tokens: -1\n          top_p: 2\n          colour: red")
    err = errors_of(write(tmp_path, text))
    paths = {p.path for p in err.problems}
    assert paths == {"targets[0].runs[0].generate.max_new_tokens", "targets[0].runs[0].generate.top_p",
                     "targets[0].runs[0].generate.colour"}
    assert "greater than or equal to 1" in str(err) and "(got -1)" in str(err)


def test_unknown_mode_lists_the_valid_ones(tmp_path):
    err = errors_of(write(tmp_path, GOOD.replace("mode: generate", "mode: train")))
    assert "'generate'" in str(err) and "train" in str(err) and ":6:" in str(err)


def test_duplicate_run_ids_and_missing_targets(tmp_path):
    dup = GOOD + GOOD.split("runs:\n")[1]
    assert "duplicate run id: r" in str(errors_of(write(tmp_path, dup)))
    assert "targets" in str(errors_of(write(tmp_path, "name: t\n")))


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    err = errors_of(write(tmp_path, "name: t\ntargets: [\n  - a: b\n"))
    assert "YAML syntax error" in str(err) and f"{tmp_path / 'm.yaml'}:3:" in str(err)


@pytest.mark.parametrize("text,message", [("", "empty"), ("- a\n- b\n", "mapping"), (b"\xff\xfe", "UTF-8")])
def test_empty_non_mapping_and_binary_files(tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert message in str(errors_of(path))


def test_missing_file_and_wrong_suffix(tmp_path):
    assert "file not found" in str(errors_of(tmp_path / "nope.yaml"))
    assert ".yaml" in str(errors_of(write(tmp_path, GOOD, "m.yml")))


def test_override_sets_adds_and_is_validated_like_the_file(tmp_path):
    path = write(tmp_path, GOOD)
    manifest, _ = load_manifest(path, ["seed=7", "targets.0.runs.0.generate.top_k=5"])
    assert manifest.seed == 7 and manifest.targets[0].runs[0].generate.top_k == 5
    err = errors_of(path, ["targets.0.runs.0.generate.temperatur=0.5"])
    (problem,) = err.problems
    assert problem.source == "override 'targets.0.runs.0.generate.temperatur=0.5'"
    assert "did you mean 'temperature'?" in problem.hint
    assert "override 'seed=x'" in str(errors_of(path, ["seed=x"]))


def test_malformed_override_is_a_manifest_error(tmp_path):
    assert "override" in str(errors_of(write(tmp_path, GOOD), ["seed=[1,"]))


def test_unknown_zoo_model_lists_the_zoo(tmp_path):
    text = GOOD.replace("  - name: a\n", "  - name: a\n    model: {id: 'zoo:nope'}\n")
    assert "zoo:smollm2-135m" in str(errors_of(write(tmp_path, text)))


def test_fields_at_walks_lists_and_dicts():
    assert "max_new_tokens" in fields_at(("targets", 0, "runs", 0, "generate"))
    assert "dtype" in fields_at(("models", "small"))
    assert fields_at(("nope",)) == []


def test_schema_is_json_and_describes_every_generate_field():
    from runner.manifest.schema import json_schema

    schema = json.loads(json.dumps(json_schema()))
    generate = schema["$defs"]["GenerateBlock"]["properties"]
    assert {"max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "eos_token_id", "max_seq_len",
            "cache_kind", "prompts", "batch_size", "stop_strings", "stream"} <= set(generate)
    assert all("description" in field for field in generate.values())


def test_stream_needs_batch_size_one(tmp_path):
    text = GOOD.replace("max_new_tokens: 4", "max_new_tokens: 4\n          stream: true\n          batch_size: 2")
    assert "set batch_size: 1" in str(errors_of(write(tmp_path, text)))
