"""engine: llama.cpp's torch-free decisions: which kinds it stores, when flash attention must be on, whether the extra
is here (and the command that installs it), and the settings GenerateConfig refuses rather than ignores."""

import pytest
from pydantic import ValidationError

from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.llamacpp import (
    ABSENT_ENV,
    GGML_BYTES,
    GGML_TYPES,
    INSTALL_COMMAND,
    LlamaCppOptions,
    flash_attention,
    ggml_type,
    kind_refusal,
    missing,
    quantized_v_problem,
)


@pytest.mark.parametrize("kind, ggml", [("fp32", 0), ("fp16", 1), ("bf16", 30), ("q8_0", 8), ("q8", 8),
                                        ("q4_0", 2), ("q4", 2), ("q4_1", 3)])
def test_every_kind_llamacpp_stores_maps_to_its_ggml_type(kind, ggml):
    assert kind_refusal(kind) is None
    assert ggml_type(kind) == ggml


@pytest.mark.parametrize("kind, words", [("kivi4", "no KIVI"), ("kivi2:g64", "no KIVI"), ("nf4", "no nf4"),
                                         ("q8_0+snapkv:0.5", "no eviction"), ("fp16+streaming:0.5", "no eviction")])
def test_a_kind_llamacpp_lacks_is_refused_with_the_reason(kind, words):
    reason = kind_refusal(kind)
    assert reason is not None and words in reason and "engine: eager" in reason


def test_block_types_cost_their_bytes_per_block_of_32():
    assert GGML_BYTES["q8_0"] * 32 == 34 and GGML_BYTES["q4_0"] * 32 == 18 and GGML_BYTES["q4_1"] * 32 == 20
    assert set(GGML_BYTES) == set(GGML_TYPES)


def test_flash_attention_is_on_exactly_when_v_is_quantized_unless_asked():
    assert [flash_attention(k, None) for k in ("fp32", "fp16", "bf16", "q8_0", "q4_0", "q4_1")] == \
        [False, False, False, True, True, True]
    assert flash_attention("fp16", True) and not flash_attention("q8_0", False)
    assert quantized_v_problem("q8_0", LlamaCppOptions(flash_attn=False)) is not None
    assert quantized_v_problem("fp16", LlamaCppOptions(flash_attn=False)) is None
    assert quantized_v_problem("q8_0", None) is None


def test_missing_names_the_install_command_when_told_the_extra_is_absent(monkeypatch):
    monkeypatch.setenv(ABSENT_ENV, "1")
    reason = missing()
    assert reason is not None and INSTALL_COMMAND in reason and "llama-cpp-python" in reason


def test_generate_config_refuses_what_llamacpp_cannot_do():
    GenerateConfig(engine="llama.cpp", cache_kind="q4_1", temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                   typical_p=0.95, repetition_penalty=1.1, llamacpp=LlamaCppOptions(threads=2, batch=64))
    for settings, words in [({"num_beams": 2, "temperature": 0}, "num_beams"),
                            ({"penalty_alpha": 0.5, "top_k": 4, "temperature": 0}, "penalty_alpha"),
                            ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
                            ({"decode_plan": "auto"}, "decode_plan"),
                            ({"cache_kind": "nf4"}, "no nf4"),
                            ({"cache_kind": "auto", "cache_candidates": ["fp16", "kivi4"]}, "no KIVI"),
                            ({"prefill": "compiled"}, "prefill")]:
        with pytest.raises(ValidationError, match=words):
            GenerateConfig(engine="llama.cpp", **settings)
    with pytest.raises(ValidationError, match="engine: llama.cpp only"):
        GenerateConfig(engine="eager", llamacpp=LlamaCppOptions())
    # the default candidates (KIVI among them) are filtered at selection, not refused here
    assert GenerateConfig(engine="llama.cpp", cache_kind="auto").cache_kind == "auto"
