"""`mode: generate` with decoding strategies through the `run` command: side-by-side outputs, beam and
contrastive equal to the library, the decode plan printed and recorded, and combinations that are errors."""

import csv
import json

import pytest

from tests.conftest import tiny_manifest
from tests.test_cli import run_cli

PROMPTS = '["hello world", "The quick brown fox"]'
STRATEGIES = f"""      - id: compare
        mode: generate
        generate:
          prompts: {PROMPTS}
          max_new_tokens: 8
          eos_token_id: []
          strategies:
            greedy: {{temperature: 0}}
            beam: {{num_beams: 3, num_return_sequences: 2}}
            contrastive: {{penalty_alpha: 0.6, top_k: 4}}
            min_p: {{temperature: 0.8, min_p: 0.1}}
            window: {{temperature: 0, decode_plan: fixed, decode_q_chunk: 4, decode_local_window: 6}}
"""


@pytest.mark.e2e
def test_strategies_side_by_side(tmp_path, tiny_lm):
    done = run_cli(tiny_manifest(tmp_path, STRATEGIES), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    result = json.loads((folder / "tiny" / "compare" / "results.json").read_text())
    names = ["greedy", "beam", "contrastive", "min_p", "window"]
    assert [list(row["outputs"]) for row in result["prompts"]] == [names, names]
    with (folder / "tiny" / "compare" / "outputs.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["prompt", *names] and [r[0] for r in rows[1:]] == ["hello world", "The quick brown fox"]

    strategies = result["strategies"]
    tok, model = tiny_lm.tokenizer, tiny_lm.model
    for i, prompt in enumerate(["hello world", "The quick brown fox"]):
        ids = tok(prompt, return_tensors="pt").input_ids
        beams = model.generate(ids, max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False,
                               eos_token_id=None)
        record = strategies["beam"]["prompts"][i]
        assert record["token_ids"] == beams[0, ids.shape[1]:].tolist()
        assert record["alternatives"][0]["token_ids"] == beams[1, ids.shape[1]:].tolist()
        assert record["beam_score"] >= record["alternatives"][0]["beam_score"]
    assert strategies["contrastive"]["prompts"][0]["token_ids"] != strategies["greedy"]["prompts"][0]["token_ids"]
    # the window is never on silently: printed, recorded, flagged in the metrics
    assert "SLIDING WINDOW of 6 tokens + 4 sink tokens" in done.stderr
    assert strategies["window"]["decode_plans"][0]["local_window"] == 6
    assert result["metrics"]["window.sliding_window"] == 1.0 and "greedy.sliding_window" not in result["metrics"]


@pytest.mark.parametrize("generate, message", [
    ('{prompts: ["a"], num_beams: 2, stream: true}', "cannot stream"),
    ('{prompts: ["a", "b"], batch_size: 2, penalty_alpha: 0.5, top_k: 4}', "batch_size: 1"),
    ('{prompts: ["a"], strategies: {b: {num_beams: 2, temperature: 0.7}}}', "generate.strategies.b: beam search"),
    ('{prompts: ["a"], num_beams: 2, num_return_sequences: 3}', "num_return_sequences"),
    ('{prompts: ["a"], decode_plan: sometimes}', "'auto', 'fixed' or 'none'"),
])
@pytest.mark.e2e
def test_strategies_that_do_not_combine_are_manifest_errors(tmp_path, generate, message):
    path = tiny_manifest(tmp_path, f"""      - id: bad
        mode: generate
        generate: {generate}
""")
    done = run_cli("check", path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert message in done.stderr and "targets[0].runs[0].generate" in done.stderr and f"{path}:" in done.stderr


@pytest.mark.e2e
def test_unknown_strategy_key_names_the_closest(tmp_path):
    path = tiny_manifest(tmp_path, """      - id: bad
        mode: generate
        generate: {prompts: ["a"], strategies: {b: {num_beam: 2}}}
""")
    done = run_cli("check", path)
    assert done.returncode == 2 and "strategies.b.num_beam" in done.stderr
    assert "did you mean 'num_beams'?" in done.stderr


def test_a_compiled_step_reports_its_own_compiling_not_the_engines_running_total(tiny_lm, monkeypatch):
    """The engine outlives a step: a second step of a shape already compiled reports 0 s and 0 graphs (seen: every
    later step repeated the earlier steps' seconds and recompiles)."""
    from runner.infer.compiled import engine as compiled
    from runner.manifest.blocks import GenerateBlock
    from runner.report import no_progress
    from runner.steps.generate import _decode_all

    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, compiled.CompiledEngine(tiny_lm.model, compile=False))
    spec = GenerateBlock.model_validate({"prompts": ["hello world"], "max_new_tokens": 4, "temperature": 0,
                                        "engine": "compiled"})
    config = spec.strategy_configs(seed=0)[""]
    first, second = (_decode_all(spec, config, ["hello world"], tiny_lm, "t", no_progress) for _ in range(2))
    assert first["compile"]["seconds"] > 0 and first["metrics"]["compile_s"] == first["compile"]["seconds"]
    assert second["compile"] == {"seconds": 0.0, "compiles": 0, "recompiles": 0}
    assert second["metrics"]["compile_s"] == 0.0 and second["metrics"]["recompiles"] == 0.0
