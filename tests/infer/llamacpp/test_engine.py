"""llama.cpp on a real GGUF: the tiny random llama written as f32 (fast), and the zoo's SmolLM2 Q4_1 (slow).

Where the arithmetic allows, llama.cpp's greedy tokens equal our eager engine's: the same f32 weights, K/V kept in
f32, so the two differ only in the order of float sums (logits agree to ~1e-5 and the top token with them). Where
it does not: the zoo's Q4_1 weights run their matmuls on q8_1-quantized activations in llama.cpp (we dequantize to
f32 and multiply exactly), so there only most tokens agree."""

import numpy as np
import pytest
import torch

from runner.errors import ModelError
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.llamacpp import LlamaCppOptions
from runner.infer.generation.generator import Generator
from runner.infer.llamacpp.engine import LlamaCppEngine
from runner.infer.llamacpp.gguf_file import model_gguf, written_gguf
from runner.infer.loading.models import load_model
from tests.conftest import LLAMA_32, NEEDS_LLAMACPP, tiny_qwen2

pytest.importorskip("llama_cpp", reason=NEEDS_LLAMACPP)

PROMPT = [5, 77, 120, 33, 200, 9, 64, 101]


@pytest.fixture(scope="module")
def tiny_lm():
    """A tiny random llama whose head size (32) llama.cpp's block K/V types divide."""
    return load_model(config=LLAMA_32, device="cpu", seed=0)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_lm, tmp_path_factory):
    import os

    old = os.environ.get("RUNNER_CACHE")
    os.environ["RUNNER_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield written_gguf(tiny_lm.model, tiny_lm.tokenizer)
    finally:
        if old is None:
            os.environ.pop("RUNNER_CACHE")
        else:
            os.environ["RUNNER_CACHE"] = old


def _ours(lm, prompt: list[int], steps: int, kind: str | None = None) -> list[int]:
    config = GenerateConfig(max_new_tokens=steps, temperature=0.0, cache_kind=kind, eos_token_id=[])
    generator = Generator(lm.model, config=config, tokenizer=lm.tokenizer)
    out = generator.generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_f32_gguf_logits_match_our_eager_forward(tiny_lm, tiny_gguf):
    engine = LlamaCppEngine(tiny_gguf, kind="fp32", n_ctx=64, options=LlamaCppOptions(threads=1), logits_all=True)
    theirs = engine.logits(PROMPT)
    with torch.inference_mode():
        ours = tiny_lm.model(torch.tensor([PROMPT])).logits[0].float().numpy()
    assert theirs.shape == ours.shape
    assert np.abs(theirs - ours).max() < 1e-3


def test_greedy_tokens_equal_ours_on_the_same_f32_weights(tiny_lm, tiny_gguf):
    engine = LlamaCppEngine(tiny_gguf, kind="fp32", n_ctx=128, options=LlamaCppOptions(threads=1))
    assert engine.greedy(PROMPT, 24) == _ours(tiny_lm, PROMPT, 24)
    assert engine.greedy(PROMPT, 24) == engine.greedy(PROMPT, 24)  # reset between runs: the cache starts empty


@pytest.mark.parametrize("kind", ["fp16", "q8_0", "q4_0", "q4_1", "bf16"])
def test_every_kv_type_decodes_and_quantized_v_turns_flash_attention_on(tiny_gguf, kind):
    engine = LlamaCppEngine(tiny_gguf, kind=kind, n_ctx=64, options=LlamaCppOptions(threads=1))
    assert engine.flash_attn == (kind in ("q8_0", "q4_0", "q4_1"))
    tokens = engine.greedy(PROMPT, 8)
    assert len(tokens) == 8 and all(0 <= t < engine.n_vocab for t in tokens)
    assert engine.kv_bytes(32) < LlamaCppEngine(tiny_gguf, kind="fp32", n_ctx=64).kv_bytes(32)


def test_generate_stops_at_eos_and_reports_timings(tiny_gguf):
    engine = LlamaCppEngine(tiny_gguf, kind="fp32", n_ctx=128, options=LlamaCppOptions(threads=1))
    free = engine.greedy(PROMPT, 12)
    config = GenerateConfig(engine="llama.cpp", max_new_tokens=12, temperature=0.0)
    stats = engine.generate(PROMPT, config, eos=frozenset({free[3]}))
    assert stats.tokens == free[:free.index(free[3]) + 1] and stats.stop_reason == "eos"
    stats = engine.generate(PROMPT, config)
    assert stats.tokens == free and stats.stop_reason == "max_new_tokens"
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.decode_tokens_per_s > 0


def test_sampling_through_llamacpps_sampler_is_seeded(tiny_gguf):
    engine = LlamaCppEngine(tiny_gguf, kind="fp16", n_ctx=128, options=LlamaCppOptions(threads=1))
    config = GenerateConfig(engine="llama.cpp", max_new_tokens=16, temperature=1.5, top_k=50, seed=3)
    first = engine.generate(PROMPT, config).tokens
    assert engine.generate(PROMPT, config).tokens == first
    others = [engine.generate(PROMPT, config.model_copy(update={"seed": s})).tokens for s in (4, 5, 6)]
    assert any(o != first for o in others)  # the seed matters: random weights give a flat distribution


def test_a_written_qwen2_gives_llamacpp_our_logits_biases_and_all(tmp_path, monkeypatch):
    """qwen2 (q, k, v biases; NEOX rotary, so its rows unpermuted) written as f32: llama.cpp's logits are ours."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    lm = tiny_qwen2()
    engine = LlamaCppEngine(written_gguf(lm.model, lm.tokenizer), kind="fp32", n_ctx=64,
                            options=LlamaCppOptions(threads=1), logits_all=True)
    with torch.inference_mode():
        ours = lm.model(torch.tensor([PROMPT])).logits[0].float().numpy()
    assert np.abs(engine.logits(PROMPT) - ours).max() < 1e-3


def test_a_head_size_a_block_type_cannot_divide_is_an_error_that_says_so(tmp_path, monkeypatch):
    from tests.conftest import TINY_LLAMA

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    lm = load_model(config=TINY_LLAMA, device="cpu")  # head size 16
    with pytest.raises(ModelError, match="head size"):
        LlamaCppEngine(written_gguf(lm.model, lm.tokenizer), kind="q8_0", n_ctx=32)


def test_a_refused_kind_and_a_context_overflow_are_errors(tiny_gguf):
    with pytest.raises(ModelError, match="no KIVI"):
        LlamaCppEngine(tiny_gguf, kind="kivi4")
    engine = LlamaCppEngine(tiny_gguf, kind="fp32", n_ctx=16)
    with pytest.raises(ModelError, match="exceed its context"):
        engine.greedy(PROMPT, 12)


@pytest.mark.slow
def test_the_zoo_gguf_at_its_own_quantization_mostly_agrees_with_ours(smollm):
    """SmolLM2's Q4_1 GGUF: llama.cpp multiplies Q4_1 weights by q8_1 activations, we multiply the dequantized f32
    weights exactly; the greedy paths agree on a prefix, then may part."""
    gguf = model_gguf("zoo:smollm2-135m", smollm.model, smollm.tokenizer)
    prompt = smollm.tokenizer("The capital of France is").input_ids
    engine = LlamaCppEngine(gguf, kind="fp32", n_ctx=256, options=LlamaCppOptions(threads=2))
    theirs, ours = engine.greedy(prompt, 16), _ours(smollm, prompt, 16)
    assert theirs[:3] == ours[:3]
    assert smollm.tokenizer.decode(theirs).strip().startswith("Paris")
