"""The plan is pure, ordered, and each step's hash changes exactly when its inputs do."""

from runner.manifest.compose import load_manifest
from runner.manifest.plan import make_plan
from tests.conftest import tiny_manifest

RUNS = """      - id: a
        mode: generate
        generate: {prompts: [x], max_new_tokens: 3, temperature: 0}
      - id: b
        mode: generate
        generate: {prompts: [y], max_new_tokens: 3, seed: 5}
"""


def test_steps_follow_manifest_order_with_their_own_seed(tmp_path):
    manifest, _ = load_manifest(tiny_manifest(tmp_path, RUNS))
    plan = make_plan(manifest)
    assert [s.key for s in plan.steps] == ["tiny/a", "tiny/b"]
    assert [s.seed for s in plan.steps] == [0, 5]
    assert "tiny/a" in plan.describe() and plan.steps[0].hash[:12] in plan.describe()


def test_hash_is_stable_and_changes_with_any_input(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    base = make_plan(load_manifest(path)[0])
    again = make_plan(load_manifest(path)[0])
    assert [s.hash for s in base.steps] == [s.hash for s in again.steps]
    changed = make_plan(load_manifest(path, ["targets.0.runs.0.generate.max_new_tokens=4"])[0])
    assert changed.steps[0].hash != base.steps[0].hash and changed.steps[1].hash == base.steps[1].hash
    run_seed = make_plan(load_manifest(path, ["targets.0.runs.1.generate.seed=6"])[0])
    assert run_seed.steps[0].hash == base.steps[0].hash and run_seed.steps[1].hash != base.steps[1].hash
    reseeded = make_plan(load_manifest(path, ["seed=1"])[0])  # also reseeds the config model's weights
    assert all(a.hash != b.hash for a, b in zip(reseeded.steps, base.steps))
    assert reseeded.steps[1].seed == 5 and reseeded.steps[1].model_seed == 1
    other_dtype = make_plan(load_manifest(path, ["targets.0.model.dtype=bfloat16"])[0])
    assert all(a.hash != b.hash for a, b in zip(other_dtype.steps, base.steps))


def test_hash_covers_the_prompts_files_content_and_the_environment(tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    path = tiny_manifest(tmp_path, RUNS.replace("prompts: [x]", "prompts_file: p.txt"))
    base = make_plan(load_manifest(path)[0], tmp_path)
    (tmp_path / "p.txt").write_text("hello there\n")
    edited = make_plan(load_manifest(path)[0], tmp_path)
    assert edited.steps[0].hash != base.steps[0].hash and edited.steps[1].hash == base.steps[1].hash
    env = base.to_json()["environment"]
    assert {"runner", "code", "python", "torch", "transformers", "system"} <= set(env) and env["torch"]


def test_hash_changes_with_the_code(tmp_path, monkeypatch):
    import runner.manifest.plan as plan_module

    path = tiny_manifest(tmp_path, RUNS)
    base = make_plan(load_manifest(path)[0])
    other = {**plan_module.environment_fingerprint(), "code": "0" * 16}
    monkeypatch.setattr(plan_module, "environment_fingerprint", lambda: other)
    changed = make_plan(load_manifest(path)[0])
    assert all(a.hash != b.hash for a, b in zip(base.steps, changed.steps))


def test_plan_json_keeps_its_keys(tmp_path):
    """plan.json is read by people and by earlier run folders' tools: a step's mode block stays under "spec"."""
    plan = make_plan(load_manifest(tiny_manifest(tmp_path, RUNS))[0]).to_json()
    assert list(plan) == ["name", "runner_version", "environment", "steps"]
    step = plan["steps"][0]
    assert list(step) == ["index", "target", "run_id", "mode", "model", "spec", "seed", "model_seed", "hash"]
    assert step["spec"]["prompts"] == ["x"] and step["spec"] == make_plan(load_manifest(
        tiny_manifest(tmp_path, RUNS))[0]).steps[0].block
