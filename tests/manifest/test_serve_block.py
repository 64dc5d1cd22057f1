"""The serve block: what it takes (shorthands, defaults, one LoadSpec per rate), what it refuses at the key that is
wrong, and `run` refusing mode serve at its mode key until the step exists."""

import pytest

from runner.errors import ManifestError
from runner.infer.serve.load import Lengths
from runner.manifest.compose import load_manifest

HEAD = """\
tracking: {mlflow: false}
targets:
  - name: smol
    runs:
      - id: s
        mode: serve
        serve:
"""


def manifest(tmp_path, serve: str):
    path = tmp_path / "m.yaml"
    path.write_text(HEAD + "".join(f"          {line}\n" for line in serve.strip().splitlines()))
    return path


def serve_block(tmp_path, serve: str):
    return load_manifest(manifest(tmp_path, serve))[0].targets[0].runs[0].serve


def problem(tmp_path, serve: str) -> str:
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest(tmp_path, serve))
    assert len(info.value.problems) == 1
    return str(info.value.problems[0])


def test_a_rate_sweep_is_one_load_per_rate_with_the_blocks_settings(tmp_path):
    block = serve_block(tmp_path, """
arrival: gamma
rate: [1, 4]
burstiness: 0.25
prompt_tokens: 256
output_tokens: {dist: normal, mean: 64, std: 16, max: 100}
turns: 2
arrival_seed: 3
data_seed: 4
""")
    specs = block.load_specs()
    assert [s.rate for s in specs] == [1.0, 4.0]
    spec = specs[1]
    assert (spec.arrival, spec.burstiness, spec.num_requests, spec.turns, spec.arrival_seed, spec.data_seed) == \
        ("gamma", 0.25, 100, 2, 3, 4)
    assert spec.prompt_tokens == Lengths("fixed", 256)
    assert spec.output_tokens == Lengths("normal", mean=64.0, std=16.0, max=100)
    assert block.baselines == ["static", "transformers"] and block.percentiles == [50, 90, 99]


def test_a_closed_loop_is_one_point_and_a_duration_replaces_the_count(tmp_path):
    specs = serve_block(tmp_path, "{arrival: concurrency, concurrency: 8, duration_s: 30, baselines: none}")
    assert specs.baselines == []
    (spec,) = specs.load_specs()
    assert (spec.arrival, spec.concurrency, spec.rate, spec.num_requests, spec.duration_s) == \
        ("concurrency", 8, None, None, 30.0)


@pytest.mark.parametrize("serve, expected", [
    ("{arrival: concurrency}", "serve.arrival: arrival concurrency needs concurrency: N (the users of the closed "
     "loop)"),
    ("{arrival: concurrency, concurrency: 4, rate: 2}", "serve.rate: arrival concurrency sends a request when one "
     "finishes: remove rate, or use an open-loop arrival (poisson, gamma, constant)"),
    ("{rate: 2, concurrency: 4}", "serve.concurrency: concurrency is the users of a closed loop: set arrival: "
     "concurrency, or remove it"),
    ("{rate: 2, burstiness: 0.5}", "serve.burstiness: burstiness shapes gamma arrivals: set arrival: gamma (got "
     "arrival poisson)"),
    ("{rate: 2, num_requests: 10, duration_s: 5}", "serve.duration_s: give num_requests or duration_s, not both"),
    ("{rate: 2, kv_budget_mib: 64, kv_blocks: 100}", "serve.kv_blocks: give kv_budget_mib or kv_blocks, not both"),
    ("{rate: 2, prefix_groups: 4}", "serve.prefix_tokens: prefix_groups and prefix_tokens go together: give both, "
     "or neither"),
    ("{rate: 2, prefix_groups: 2, prefix_tokens: 128}", "serve.prefix_tokens: prefix_tokens 128 must be below every "
     "prompt's length, but prompt_tokens may draw 128"),
    ("{rate: 2, output_tokens: {dist: normal, mean: 10}}", "serve.output_tokens: dist normal needs mean and std: std "
     "is missing"),
    ("{rate: 2, prompt_tokens: {dist: fixed, value: 8, min: 2}}", "serve.prompt_tokens: dist fixed takes value, not "
     "min"),
    ("{rate: 2, slo: {ttft_ms: .nan}}", "serve.slo.ttft_ms: expected a number (got nan)"),
    ("{rate: 2, percentiles: [50, 100.5]}", "serve.percentiles[1]: Input should be less than or equal to 100 (got "
     "100.5)"),
    ("{rate: 2, prompts_file: prompts.csv}", "serve.prompts_file: 'prompts_file' must end in .txt (one prompt per "
     "line) or .jsonl (got 'prompts.csv')"),
    ("{rate: 2, engines: [eager, eager]}", "serve.engines: each engine once (got ['eager', 'eager'])"),
    ("{rate: 2, engines: [compiled], speculative: [prompt-lookup]}", "serve.speculative: speculative: prompt-lookup "
     "runs on the eager engine: add eager to engines (got ['compiled'])"),
    ("{rate: 2, speculative: [none, none]}", "serve.speculative: each setting once (got ['none', 'none'])"),
    ("{rate: 2, speculative: [draft]}", "serve.speculative: speculative: draft needs the draft model: add draft: "
     "{id: zoo:NAME} (a model sharing the target's tokenizer)"),
    ("{rate: 2, draft: {id: zoo:smollm2-135m}}", "serve.draft: a draft model serves only with speculative: draft: "
     "add draft to speculative (got ['none']), or remove draft"),
    ("{rate: 2, speculative: [draft], draft: {id: zoo:nope}}", "serve.draft: unknown zoo model 'zoo:nope'; the zoo "
     "has: zoo:smollm2-135m, zoo:gemma3-270m, zoo:qwen2.5-coder-0.5b, zoo:qwen2.5-coder-1.5b"),
    ("{rate: 2, baselines: [static, none]}", "serve.baselines: none means no baseline: give it alone, or leave it "
     "out (got ['static', 'none'])"),
])
def test_a_bad_serve_block_is_refused_at_the_key_that_is_wrong(tmp_path, serve, expected):
    assert problem(tmp_path, serve).endswith(f"targets[0].runs[0].{expected}")


def test_an_unknown_cache_kind_and_a_block_of_another_mode_are_refused(tmp_path):
    assert "serve.cache_kinds" in problem(tmp_path, "{rate: 2, cache_kinds: [q9]}")
    path = tmp_path / "other.yaml"
    path.write_text(HEAD.replace("        serve:\n", "        serve: {rate: 1}\n        bench: {}\n"))
    with pytest.raises(ManifestError, match="mode serve reads the 'serve' block: remove 'bench'"):
        load_manifest(path)
    path.write_text(HEAD.replace("        serve:\n", ""))
    with pytest.raises(ManifestError, match="mode serve needs a 'serve' block"):
        load_manifest(path)


def test_a_prompts_file_long_enough_passes_check(tmp_path):
    (tmp_path / "p.txt").write_text("x" * 100 + "\n\n" + "y" * 66 + "\n")
    block = serve_block(tmp_path, "{rate: 1, prompts_file: p.txt, prompt_tokens: {dist: uniform, min: 8, max: 70}, "
                                  "prefix_groups: 2, prefix_tokens: 4}")
    assert block.prompts_file == "p.txt"  # 70 - 4 own tokens: both prompts have the bytes
    assert "line 3: the prompt is 66 bytes, too short for 76 tokens" in problem(
        tmp_path, "{rate: 1, prompts_file: p.txt, prompt_tokens: {dist: uniform, min: 8, max: 80}, "
                  "prefix_groups: 2, prefix_tokens: 4}")


def test_engines_are_an_axis_and_compiled_alone_with_only_kivi_sinks_is_refused(tmp_path):
    assert serve_block(tmp_path, "{rate: 2}").engines == ["eager"]
    assert serve_block(tmp_path, "{rate: 2, engines: [eager, compiled], cache_kinds: [q8_0, kivi4:s4]}").engines == \
        ["eager", "compiled"]  # the sinks points of the compiled engine are not run, with the reason
    assert serve_block(tmp_path, "{rate: 2, engines: [compiled], cache_kinds: [kivi4, kivi2]}").engines == ["compiled"]
    message = problem(tmp_path, "{rate: 2, engines: [compiled], cache_kinds: [kivi4:s4, kivi2:s2]}")
    assert ("serve.engines: engine compiled serves none of cache_kinds ['kivi4:s4', 'kivi2:s2']: KIVI with sinks "
            "(s4)") in message
    assert "serve.engines[0]" in problem(tmp_path, "{rate: 2, engines: [jit]}")
