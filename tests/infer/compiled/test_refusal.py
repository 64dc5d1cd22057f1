"""Issue 33: a model the compiled engine cannot serve (a sliding window) is refused by one decision
(architecture.compiled_refusal): `run check` on a manifest's config (tests/bad_inputs/compiled_sliding_window_*), the
engine on a loaded model, before anything is built. And a model that cannot be built fails its step alone."""

import json

import pytest
import torch

from runner.cli import main
from runner.errors import InferenceError
from runner.infer.compiled import engine as engine_module
from runner.infer.config.architecture import compiled_refusal, sliding_window
from runner.infer.config.decoding import GenerateConfig
from runner.infer.generation.generator import Generator
from runner.infer.loading.models import load_model
from tests.conftest import TINY_LLAMA

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}
WINDOWED = {  # configs whose loaded model attends through a sliding window somewhere
    "mistral, window given": {"model_type": "mistral", **SIZES, "sliding_window": 16},
    "mistral, default window": {"model_type": "mistral", **SIZES},  # 4096 by default: not visible in the values
    "qwen2, upper layers": {"model_type": "qwen2", **SIZES, "use_sliding_window": True, "sliding_window": 16,
                            "max_window_layers": 1},
}
FULL = {
    "llama": TINY_LLAMA,
    "qwen2, window off": {"model_type": "qwen2", **SIZES, "use_sliding_window": False, "sliding_window": 16},
    "qwen2, every layer below max_window_layers": {"model_type": "qwen2", **SIZES, "use_sliding_window": True,
                                                   "sliding_window": 16, "max_window_layers": 2},
}


@pytest.fixture
def no_build(monkeypatch):
    """Building an engine (its kernels, its timings) fails the test: a refusal must come first."""
    built = []
    monkeypatch.setattr(engine_module, "CompiledEngine", lambda model, *a, **k: built.append(model) or "engine")
    return built


@pytest.mark.parametrize("name", WINDOWED)
def test_a_sliding_window_model_is_refused_before_the_engine_is_built(name, no_build):
    lm = load_model(config=WINDOWED[name], device="cpu", seed=0)
    with pytest.raises(InferenceError, match="attends through a sliding window .*: use engine: eager"):
        engine_module.engine_for(lm.model)
    ids = lm.tokenizer(["hello"], return_tensors="pt").input_ids
    with pytest.raises(InferenceError, match="sliding window"):
        Generator(lm.model, config=GenerateConfig(engine="compiled", max_new_tokens=2)).generate(ids)
    assert no_build == [] and lm.model not in engine_module.ENGINES_BY_MODEL


@pytest.mark.parametrize("name", FULL)
def test_a_full_attention_model_gets_its_engine(name, no_build):
    lm = load_model(config=FULL[name], device="cpu", seed=0)
    assert engine_module.engine_for(lm.model) == "engine" and no_build == [lm.model]
    del engine_module.ENGINES_BY_MODEL[lm.model]


@pytest.mark.parametrize("name", [*WINDOWED, *FULL])
def test_the_values_and_the_loaded_config_get_the_same_answer_where_the_values_say(name):
    """One decision on both: what `run check` reads (the values) and what the engine reads (the loaded config);
    a default the values do not show (Mistral's 4096) is known only once loaded."""
    values = {**WINDOWED, **FULL}[name]
    loaded = load_model(config=values, device="cpu", seed=0).model.config
    assert (compiled_refusal(loaded) is None) == (name in FULL)
    if name != "mistral, default window":
        assert (sliding_window(values) is None) == (sliding_window(loaded) is None)


RUNS = """      - id: first
        mode: generate
        generate: {prompts: ["hi"], max_new_tokens: 2}
"""


def _two_targets(tmp_path, bad_model: str, bad_runs: str):
    path = tmp_path / "m.yaml"
    path.write_text(f"""name: t
tracking: {{mlflow: false, runs_dir: {tmp_path / 'runs'}}}
targets:
  - name: bad
    model: {bad_model}
    runs:
{bad_runs}  - name: good
    model: {{config: {TINY_LLAMA}, device: cpu}}
    runs:
{RUNS}""")
    return path


@pytest.mark.parametrize("bad_model, bad_runs, reason", [
    ("{config: {model_type: llama, hidden_size: 64, num_attention_heads: 4, num_hidden_layers: 2, "
     "hidden_act: no-such-activation}, device: cpu}", RUNS,
     "model config (model_type 'llama') cannot be built: KeyError: 'no-such-activation'"),
    (f"{{config: {WINDOWED['mistral, default window']}, device: cpu}}",
     RUNS.replace("max_new_tokens: 2", "max_new_tokens: 2, engine: compiled"),
     "mistral: engine: compiled attends to every cached position, and this model attends through a sliding window "
     "(sliding_window is 4096): use engine: eager")])
def test_a_model_that_cannot_serve_fails_its_step_and_the_others_run(tmp_path, capsys, bad_model, bad_runs, reason):
    """Nothing `run check` can see: the step fails at load (or at its engine) with the reason, the next target runs."""
    torch.manual_seed(0)
    assert main(["check", str(_two_targets(tmp_path, bad_model, bad_runs))]) == 0
    assert main([str(tmp_path / "m.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"step bad/first failed: {reason}" in err
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    steps = json.loads((folder / "status.json").read_text())["steps"]
    assert steps["bad/first"] == {**steps["bad/first"], "state": "failed", "error": reason}
    assert steps["good/first"]["state"] == "finished"


def test_no_cxx_compiler_is_said_before_the_engine_is_built(tmp_path, monkeypatch, no_build):
    """inductor builds CPU kernels with a C++ compiler; without one torch says so inside the first compiled step."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++ (inductor finds compilers through PATH)
    from torch._inductor import cpp_builder

    lm = load_model(config=TINY_LLAMA, device="cpu", seed=0)
    cpp_builder.cpp_compiler_search.cache_clear()  # torch remembers the compiler it found, once per process
    try:
        with pytest.raises(InferenceError, match=r"needs a working C\+\+ compiler on CPU .* or use engine: eager$"):
            engine_module.engine_for(lm.model)
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()
    assert no_build == []
