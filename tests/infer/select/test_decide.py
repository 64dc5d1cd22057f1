"""decide_cache_kind: a named kind passes through untouched; `auto` is selected once and becomes the chosen kind."""

from runner.infer.config.decoding import GenerateConfig
from runner.infer.select import decide
from runner.infer.select.decide import decide_cache_kind


def test_a_named_kind_is_decided_already():
    config = GenerateConfig(cache_kind="q8_0")
    assert decide_cache_kind(None, None, config, batch_size=2) == (config, None)


def test_auto_becomes_the_selected_kind(monkeypatch):
    calls = []

    class Chosen:
        kind = "nf4"

    def select(model, tokenizer, config, *, batch_size, **_):
        calls.append(batch_size)
        return Chosen()

    monkeypatch.setattr(decide, "select_cache_kind", select)
    config = GenerateConfig(cache_kind="auto", max_new_tokens=5)
    decided, selection = decide_cache_kind(None, None, config, batch_size=3)
    assert calls == [3] and selection is not None and selection.kind == "nf4"
    assert decided.cache_kind == "nf4" and decided.max_new_tokens == 5 and config.cache_kind == "auto"
