import pytest

from runner.infer.loading.zoo import zoo_cached
from runner.infer.tasks.evaluate import (
    answer,
    answer_kinds,
    check_length,
    ends_an_answer_line,
    evaluate,
    evaluate_tasks,
    question_start,
)
from runner.infer.tasks.ruler import make_sample, make_samples


def test_evaluate_on_a_tiny_model_returns_predictions_scores_bytes_and_seconds(tiny_lm, one_thread, words):
    tok = tiny_lm.tokenizer
    samples = make_samples("niah_single_1", tok, 700, 2, words=words) + make_samples("fwe", tok, 700, 1, words=words)
    seen = []

    def bar(description, total, unit):
        from runner.report import Progress

        class Recording(Progress):
            def update(self, n=1, note=""):
                seen.append(note)
        return Recording(description, total, unit)

    ev = evaluate(tiny_lm.model, tok, samples, "q8_0", q_chunk=128, progress=bar)
    assert len(ev.results) == 3 and len(seen) == 3
    for r in ev.results:
        assert r.prompt_tokens == r.sample.tokens <= 700 and 0 <= r.score <= 1 and r.cache_bytes > 0
        assert r.prefill_s > 0 and r.decode_s >= 0 and r.stop in {"eos", "max_tokens", "newline", "answered"}
        assert r.new_tokens <= r.sample.max_new_tokens
    assert set(ev.scores) == {("niah_single_1", 700), ("fwe", 700)}
    assert ev.scores[("niah_single_1", 700)].n == 2
    rows = ev.rows()
    assert {row["task"] for row in rows} == {"niah_single_1", "fwe"}
    assert all(row["cache_kind"] == "q8_0" for row in rows)
    fp = evaluate(tiny_lm.model, tok, samples[:1], None, q_chunk=None)
    assert fp.results[0].cache_bytes > ev.results[0].cache_bytes  # q8_0 stores less than fp32


def test_compressing_the_context_alone_presses_the_haystack_and_stores_the_question_as_fed(tiny_lm, one_thread,
                                                                                            words):
    """kvpress's pipeline: an evicting kind keeps ceil(c·(1 − r)) of the c haystack columns, then every question
    token; pressing the prompt keeps ceil(T·(1 − r)) of all T. A kind without eviction feeds the same either way."""
    tok = tiny_lm.tokenizer
    sample = make_sample("niah_single_1", tok, 500, words=words)
    cut, total = question_start(tok, sample), sample.tokens
    assert 0 < cut < total and tok.decode(tok(sample.prompt)["input_ids"][cut:]).startswith("\nWhat is the")
    column = answer(tiny_lm.model, tok, sample, "fp16", q_chunk=None).cache_bytes / total  # bytes a kept column
    for compress, kept in (("prompt", -(-total // 2)), ("context", -(-cut // 2) + total - cut)):
        result = answer(tiny_lm.model, tok, sample, "fp16+knorm:0.5", compress=compress)
        assert result.cache_bytes == kept * column, compress
    plain = [answer(tiny_lm.model, tok, sample, "fp16", q_chunk=None, compress=c) for c in ("prompt", "context")]
    assert plain[0].prediction == plain[1].prediction and plain[0].cache_bytes == plain[1].cache_bytes
    with pytest.raises(ValueError, match="compress must be one of prompt, context"):
        answer(tiny_lm.model, tok, sample, "fp16", compress="question")


@pytest.mark.parametrize("compress", ["prompt", "context"])
def test_evicting_kinds_sharing_one_prompt_forward_answer_as_each_alone(tiny_lm, one_thread, words, compress):
    """answer_kinds = answer per kind, field by field (a random model's answer is a fingerprint of every logit it
    read): evicting kinds of every method, quantized or not, with a decode schedule, replayed from one forward; a
    kind that would keep the whole prompt (500 tokens at 0.001) and the kinds without eviction on their own."""
    tok = tiny_lm.tokenizer
    sample = make_sample("niah_single_1", tok, 500, words=words)
    kinds = ["fp16+knorm:0.5", "q4_0+snapkv:0.5", None, "kivi2+tova:0.75", "fp16+h2o:0.5", "q8_0+expected:0.5",
             "q8_0+snapkv:0.5:e4", "fp16+streaming:0.001", "q8_0", "fp16+tova:0.875"]
    prompt_forwards = []
    hook = tiny_lm.model.register_forward_pre_hook(
        lambda module, args, kwargs: prompt_forwards.append(kwargs["input_ids"].shape[1] > 1), with_kwargs=True)
    try:
        together = answer_kinds(tiny_lm.model, tok, sample, kinds, q_chunk=128, compress=compress)
    finally:
        hook.remove()
    assert sum(prompt_forwards) == 4 + 4 + 1 + 1  # None and q8_0 in chunks of 128, streaming:0.001, one shared
    alone = [answer(tiny_lm.model, tok, sample, kind, q_chunk=128, compress=compress) for kind in kinds]
    for kind, got, want in zip(kinds, together, alone):
        assert (got.prediction, got.new_tokens, got.stop, got.cache_bytes) == (
            want.prediction, want.new_tokens, want.stop, want.cache_bytes), kind
        assert got.prefill_s > 0
    assert len({r.cache_bytes for r in together}) >= 6  # the kinds really stored differently
    assert len({r.prediction for r in together}) >= 2  # and the answers tell them apart


def test_kinds_sharing_a_forward_score_once_per_method_and_layer(tiny_lm, one_thread, words, monkeypatch):
    """H2O's scores (the whole prompt's attention) depend on neither ratio nor storage: three H2O kinds sharing a
    forward score each layer once, two SnapKV kinds once, and each answers as it does alone."""
    from runner.infer.cache import eviction

    calls = {"h2o": 0, "snapkv": 0}
    for method in calls:
        real = getattr(eviction, f"score_{method}")

        def counted(*args, _method=method, _real=real, **kwargs):
            calls[_method] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(eviction, f"score_{method}", counted)
    tok = tiny_lm.tokenizer
    sample = make_sample("niah_single_1", tok, 500, words=words)
    kinds = ["fp16+h2o:0.5", "q8_0+h2o:0.75", "kivi4+h2o:0.875", "fp16+snapkv:0.5", "q4_0+snapkv:0.75"]
    together = answer_kinds(tiny_lm.model, tok, sample, kinds, q_chunk=None)
    layers = tiny_lm.model.config.num_hidden_layers
    assert calls == {"h2o": layers, "snapkv": layers}
    alone = [answer(tiny_lm.model, tok, sample, kind, q_chunk=None) for kind in kinds]
    assert calls == {"h2o": 4 * layers, "snapkv": 3 * layers}
    for kind, got, want in zip(kinds, together, alone):
        assert (got.prediction, got.cache_bytes) == (want.prediction, want.cache_bytes), kind


def test_a_length_without_room_for_the_answer_and_an_unknown_task_are_value_errors(tiny_lm):
    """A prompt of the model's whole context could generate nothing (RULER counts tokens_to_generate in the length):
    the niah tasks need 128 tokens of room, vt 30."""
    limit = tiny_lm.model.config.max_position_embeddings
    check_length(tiny_lm.model, limit - 128, ["niah_single_1", "vt"])
    check_length(tiny_lm.model, limit - 30, ["vt"])
    for length, tasks in ((limit - 127, ["vt", "niah_single_1"]), (limit - 29, ["vt"]), (limit + 1, ["vt"])):
        room = 128 if "niah_single_1" in tasks else 30
        with pytest.raises(ValueError, match=f"model's context of {limit} tokens \\(prompt \\+ up to {room} "
                                             f"generated\\): use lengths up to {limit - room}"):
            check_length(tiny_lm.model, length, tasks)
    with pytest.raises(ValueError, match="did you mean 'cwe'"):
        evaluate_tasks(tiny_lm.model, tiny_lm.tokenizer, ["cwf"], [256], 1)


@pytest.mark.slow
def test_smollm2_finds_the_needle_over_noise_at_1024(one_thread):
    if not zoo_cached("zoo:smollm2-135m"):
        pytest.skip("zoo:smollm2-135m is not converted in runner's cache (load it once to fetch it)")
    from runner.infer.loading.models import load_model

    lm = load_model("zoo:smollm2-135m", device="cpu")
    ev = evaluate_tasks(lm.model, lm.tokenizer, ["niah_single_1"], [1024], 3, cache_kinds=["fp16"])[0]
    result = ev.scores[("niah_single_1", 1024)]
    assert result.n == 3 and result.score >= 66  # seen: 100 (3 of 3) on fp16, and on the fp32 cache


@pytest.mark.parametrize("text, single, listed", [
    (" 1234567.\n", True, False),  # an answer's line, then a break: a one-reference answer is over; a list is not
    (":\n", False, False),  # a preamble (Qwen2.5-Coder writes ":" and a break before a list)
    (" The special magic number is:\n", False, False),
    ("\n\n", False, False),
    (" 1234567", False, False),  # no break yet
    (":\n1. 1234567\n", True, False),
])
def test_a_line_break_ends_only_a_one_reference_answer_after_a_line_that_could_hold_it(tok, words, text, single,
                                                                                         listed):
    one = make_sample("niah_single_1", tok, 600, words=words)
    four = make_sample("niah_multivalue", tok, 600, words=words)
    assert len(one.answers) == 1 and len(four.answers) == 4
    assert ends_an_answer_line(text, one) is single and ends_an_answer_line(text, four) is listed
