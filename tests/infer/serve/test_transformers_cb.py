"""transformers' continuous batching as a baseline: greedy output equal to our solo greedy decode (arrivals
interleaved, chunked prefill, soft resets), exact lengths and min_new_tokens around EOS, arrivals on a fake clock,
a Load's follow-ups, and the reasons it cannot run."""

import random

import pytest
import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.generation.generator import Generator
from runner.infer.loading.models import byte_tokenizer
from runner.infer.serve.load import Lengths, LoadSpec, build_load
from runner.infer.serve.requests import Request
from runner.infer.serve.transformers_cb import kv_blocks_for_budget, serve_with_transformers, transformers_cb_reason
from tests.infer.serve.clocks import FakeClock

pytestmark = pytest.mark.usefixtures("one_thread")


def solo(model, prompt, max_new_tokens) -> list[int]:
    generator = Generator(model, GenerateConfig(temperature=0.0, max_new_tokens=max_new_tokens, eos_token_id=[]))
    return generator.generate(torch.tensor([prompt]))[0, len(prompt):].tolist()


def mixed_requests(gap_s: float) -> list[Request]:
    rng = random.Random(0)
    return [Request(i, gap_s * i, tuple(rng.randrange(3, 250) for _ in range(rng.randint(3, 40))), n, n)
            for i, n in enumerate([12, 5, 9, 20, 7, 16])]


@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy", "soft-resets"])
def test_greedy_output_equals_the_solo_greedy_decode(tiny_lm, num_blocks):
    requests = mixed_requests(gap_s=0.005)
    records = serve_with_transformers(tiny_lm.model, requests, max_batch_size=4, block_size=8,
                                      num_blocks=num_blocks, max_batch_tokens=16)  # prompts up to 40: chunked
    assert sorted(r.id for r in records) == list(range(len(requests)))
    for record in records:
        request = requests[record.id]
        assert record.output_ids == solo(tiny_lm.model, request.prompt_ids, request.max_new_tokens), record.id
        assert record.finish == "length" and len(record.token_s) == request.max_new_tokens
        assert record.scheduled_s is not None and request.arrival_s <= record.scheduled_s <= record.token_s[0]
        assert record.token_s == sorted(record.token_s)
    if num_blocks == 9:  # 6 requests of up to 60 tokens in 72 tokens of KV: some must give their blocks back
        assert sum(r.preemptions for r in records) >= 1


def test_lengths_are_exact_and_min_new_tokens_ignores_eos_until_reached(tiny_lm):
    prompt = (7, 8, 9)
    free = solo(tiny_lm.model, prompt, 10)
    eos = max(set(free[1:]), key=free.count)  # a token the greedy output repeats
    cases = [(10, 10), (0, 10), (1, 10), (3, 10), (9, 10)]
    requests = [Request(i, 0.0, prompt, max_new, min_new) for i, (min_new, max_new) in enumerate(cases)]
    records = {r.id: r for r in serve_with_transformers(tiny_lm.model, requests, max_batch_size=8, block_size=8,
                                                          num_blocks=32, eos_token_id=eos)}
    for request in requests:
        stop = next((i for i, t in enumerate(free) if t == eos and i >= request.min_new_tokens - 1), None)
        if request.min_new_tokens >= request.max_new_tokens or stop is None:
            expected, finish = free, "length"
        else:
            expected, finish = free[:stop + 1], "eos"
        record = records[request.id]
        assert (record.output_ids, record.finish) == (expected, finish), request
        assert len(record.token_s) == len(record.output_ids)
    assert {r.finish for r in records.values()} == {"eos", "length"}


def test_requests_are_released_at_their_arrivals_on_the_injected_clock(tiny_lm):
    clock = FakeClock(tick=0.001)
    requests = [Request(i, arrival, (5, 6, 7, 8), 3, 3) for i, arrival in enumerate([0.0, 5.0, 5.0, 20.0])]
    records = serve_with_transformers(tiny_lm.model, requests, max_batch_size=4, block_size=8, num_blocks=16,
                                      clock=clock, sleep=clock.sleep)
    assert sorted(r.id for r in records) == [0, 1, 2, 3]
    for record in records:
        assert record.arrival_s <= record.token_s[0] < record.arrival_s + 1.0  # released on time, not before
        assert record.scheduled_s is None, "transformers' own stamps are not on a fake clock"
    assert sum(clock.slept_s) > 19.0, "idle until the next arrival: slept on the injected clock"


def test_a_load_is_served_with_its_follow_ups(tiny_lm):
    text = "".join(chr(ord("a") + i % 26) for i in range(4000))
    spec = LoadSpec(arrival="concurrency", concurrency=2, num_requests=3, turns=2, prompt_tokens=Lengths("fixed", 6),
                    output_tokens=Lengths("uniform", min=2, max=4))
    load = build_load(spec, byte_tokenizer(), text)
    clock = FakeClock(tick=0.001)
    records = {r.id: r for r in serve_with_transformers(tiny_lm.model, load, max_batch_size=2, block_size=8,
                                                          num_blocks=32, clock=clock, sleep=clock.sleep)}
    assert sorted(records) == list(range(6)), "3 conversations of 2 turns"
    for conversation in range(3):
        first, second = records[2 * conversation], records[2 * conversation + 1]
        assert second.arrival_s >= first.token_s[-1], "the next turn is sent when the last one finished"
        assert second.prompt_tokens > first.prompt_tokens + len(first.output_ids)
    assert records[4].arrival_s >= min(records[1].token_s[-1], records[3].token_s[-1]), "a user's next conversation"


def test_a_request_larger_than_the_whole_cache_is_an_error_and_the_rest_are_served(tiny_lm):
    requests = [Request(0, 0.0, tuple(range(3, 40)), 8, 8), Request(1, 0.0, (5, 6), 4, 4)]
    records = {r.id: r for r in serve_with_transformers(tiny_lm.model, requests, max_batch_size=2, block_size=8,
                                                          num_blocks=4)}
    assert records[0].finish == "error" and "needs 6 KV blocks" in records[0].error
    assert records[1].finish == "length" and len(records[1].output_ids) == 4


def test_why_it_cannot_run(tiny_lm):
    assert transformers_cb_reason(tiny_lm.model, "fp32") == ""
    assert transformers_cb_reason(tiny_lm, None) == "", "runner's LoadedModel is unwrapped"
    assert "quantized" in transformers_cb_reason(tiny_lm.model, "q8")
    assert "quantized" in transformers_cb_reason(tiny_lm.model, "kivi4")
    assert "float32" in transformers_cb_reason(tiny_lm.model, "fp16")
    assert "not a transformers model" in transformers_cb_reason(torch.nn.Linear(2, 2), "fp32")


def test_a_kv_budget_is_whole_blocks_of_k_and_v_of_every_layer(tiny_lm):
    # 2 layers × 2 KV heads × head_dim 16 × (K, V) × 4 bytes = 512 bytes a token; 8 tokens a block
    assert kv_blocks_for_budget(tiny_lm.model, 1.0, 8) == 2**20 // (512 * 8)
    with pytest.raises(ValueError, match="num_blocks or kv_budget_mb"):
        serve_with_transformers(tiny_lm.model, [], max_batch_size=1)
