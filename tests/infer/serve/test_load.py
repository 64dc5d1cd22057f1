"""The load generator: arrival statistics (bounds stated), exact token counts with real tokenizers, shared prefixes,
multi-turn and closed-loop follow-ups, and the same load byte for byte from the same seeds."""

import pickle
import random
import statistics

import pytest

from runner.errors import DataError
from runner.infer.loading.models import byte_tokenizer
from runner.infer.loading.texts import load_text
from runner.infer.serve.load import Lengths, LoadSpec, arrival_times_s, build_load
from runner.infer.serve.prompts import PromptFile, prompt_lines, short_prompt
from runner.infer.serve.requests import RequestRecord


@pytest.fixture(scope="module")
def text():
    return load_text("pydoc").text[:200_000]


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok(text):
    """A real BPE tokenizer with merges (tokens of several bytes), trained in-process on the text: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, initial_alphabet=
                                                         pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


# -- arrivals ---------------------------------------------------------------------------------------------------------

def test_poisson_gaps_average_one_over_the_rate():
    """20000 exponential gaps: the sample mean's standard error is 0.7 % of 1/rate, so 3 % is over 4 errors."""
    times = arrival_times_s("poisson", 4.0, count=20_001, seed=0)
    assert times[0] == 0.0
    assert statistics.fmean(gaps(times)) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps(times)) / statistics.fmean(gaps(times)) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_have_the_mean_and_spread_burstiness_asks(burstiness):
    """Shape b, scale 1/(rate b): mean 1/rate, coefficient of variation 1/sqrt(b). Over 20000 gaps the CV's relative
    error is at most ~1.3 % (b = 0.5, the heaviest tail), so 5 % holds with room; the mean within 3 %."""
    g = gaps(arrival_times_s("gamma", 2.0, count=20_001, burstiness=burstiness, seed=1))
    assert statistics.fmean(g) == pytest.approx(0.5, rel=0.03)
    assert statistics.stdev(g) / statistics.fmean(g) == pytest.approx(burstiness ** -0.5, rel=0.05)


def test_constant_arrivals_are_evenly_spaced_and_a_duration_bounds_any_process():
    assert arrival_times_s("constant", 4.0, count=5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert arrival_times_s("constant", 4.0, duration_s=1.0) == [0.0, 0.25, 0.5, 0.75]
    times = arrival_times_s("poisson", 50.0, duration_s=100.0, seed=3)
    assert max(times) < 100.0 and len(times) == pytest.approx(5000, rel=0.05)  # Poisson count: sd 71, 5 % is 3.5 sd


def test_arrivals_repeat_from_their_seed_and_change_with_it():
    assert arrival_times_s("gamma", 3.0, count=50, burstiness=0.3, seed=7) == \
        arrival_times_s("gamma", 3.0, count=50, burstiness=0.3, seed=7)
    assert arrival_times_s("poisson", 3.0, count=50, seed=7) != arrival_times_s("poisson", 3.0, count=50, seed=8)


# -- lengths ----------------------------------------------------------------------------------------------------------

def test_lengths_draw_within_their_bounds():
    rng = random.Random(0)
    assert {Lengths("uniform", min=3, max=5).sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [Lengths("normal", mean=50, std=40, min=20, max=90).sample(rng) for _ in range(2000)]
    assert min(normal) == 20 and max(normal) == 90 and 45 < statistics.fmean(normal) < 55
    assert Lengths("normal", mean=10, std=2).high == 18 and Lengths("normal", mean=10, std=2).low == 1
    assert Lengths("fixed", 7).sample(rng) == 7


@pytest.mark.parametrize("lengths, problem", [
    (Lengths("uniform", min=300, max=200), "min 300 is above max 200"),
    (Lengths("uniform", min=3), "dist uniform needs min and max: max is missing"),
    (Lengths("fixed", 3, mean=2.0), "dist fixed takes value, not mean"),
    (Lengths("zipf", 3), "unknown distribution 'zipf': one of fixed, uniform, normal"),
    (Lengths("normal", mean=10, std=1, min=5), None),
])
def test_lengths_say_what_is_wrong(lengths, problem):
    assert lengths.problem() == problem


# -- data -------------------------------------------------------------------------------------------------------------

SPEC = LoadSpec(arrival="gamma", rate=5.0, burstiness=0.5, num_requests=40,
                prompt_tokens=Lengths("uniform", min=20, max=120), output_tokens=Lengths("uniform", min=1, max=9),
                arrival_seed=1, data_seed=2)


@pytest.mark.parametrize("tok", ["byte_tok", "bpe_tok"])
def test_prompts_have_exactly_the_drawn_number_of_tokens(tok, text, request):
    """Each prompt's length is the one drawn from the conversation's stream, with a byte tokenizer and with BPE
    tokens of several bytes alike; outputs are exact too (min_new_tokens = max_new_tokens)."""
    tokenizer = request.getfixturevalue(tok)
    load = build_load(SPEC, tokenizer, text)
    for r in load.requests:
        rng = random.Random(f"{SPEC.data_seed}:conversation:{r.id}")
        want_prompt, want_output = rng.randint(20, 120), rng.randint(1, 9)
        assert (len(r.prompt_ids), r.max_new_tokens, r.min_new_tokens) == (want_prompt, want_output, want_output)
    assert len({r.prompt_ids[:10] for r in load.requests}) == len(load.requests), "prompts cut at different offsets"
    assert tokenizer.decode(list(load.requests[0].prompt_ids)) in text  # real text, tokens as the tokenizer cut it


def test_the_same_seeds_give_the_same_load_byte_for_byte(byte_tok, text):
    def dump(spec):
        return pickle.dumps(build_load(spec, byte_tok, text).requests)

    assert dump(SPEC) == dump(SPEC)
    other_arrivals = build_load(LoadSpec(**{**SPEC.__dict__, "arrival_seed": 9}), byte_tok, text).requests
    other_data = build_load(LoadSpec(**{**SPEC.__dict__, "data_seed": 9}), byte_tok, text).requests
    base = build_load(SPEC, byte_tok, text).requests
    assert [r.prompt_ids for r in other_arrivals] == [r.prompt_ids for r in base]
    assert [r.arrival_s for r in other_arrivals] != [r.arrival_s for r in base]
    assert [r.arrival_s for r in other_data] == [r.arrival_s for r in base]
    assert [r.prompt_ids for r in other_data] != [r.prompt_ids for r in base]


def test_a_longer_load_begins_with_the_shorter_and_warmup_is_its_own(byte_tok, text):
    short = build_load(SPEC, byte_tok, text).requests
    longer = build_load(LoadSpec(**{**SPEC.__dict__, "num_requests": 80}), byte_tok, text).requests
    assert longer[:40] == short
    warm_spec = LoadSpec(**{**SPEC.__dict__, "warmup_requests": 3})
    warm = build_load(warm_spec, byte_tok, text, warmup=True).requests
    assert len(warm) == 3 and [r.prompt_ids for r in warm] != [r.prompt_ids for r in short[:3]]
    assert build_load(warm_spec, byte_tok, text).requests == short, "warm-up leaves the measured load alone"


def test_requests_of_one_prefix_group_share_exactly_their_first_tokens(bpe_tok, text):
    spec = LoadSpec(arrival="poisson", rate=2.0, num_requests=12, prefix_groups=3, prefix_tokens=16,
                    prompt_tokens=Lengths("uniform", min=20, max=40))
    requests = build_load(spec, bpe_tok, text).requests
    assert [r.group for r in requests] == [0, 1, 2] * 4
    for r in requests:
        assert 20 <= len(r.prompt_ids) <= 40
        assert r.prompt_ids[:16] == requests[r.group].prompt_ids[:16]
    assert len({r.prompt_ids[:16] for r in requests}) == 3
    assert len({r.prompt_ids[16:] for r in requests}) == 12


def test_a_conversations_next_turn_holds_the_last_prompt_its_output_and_new_user_tokens(byte_tok, text):
    spec = LoadSpec(arrival="constant", rate=1.0, num_requests=2, turns=3, prompt_tokens=Lengths("fixed", 10),
                    output_tokens=Lengths("fixed", 4))
    load = build_load(spec, byte_tok, text)
    first = load.requests[0]
    assert [(r.id, r.turn, r.group) for r in load.requests] == [(0, 0, 0), (3, 0, 1)]
    done = RequestRecord(0, first.arrival_s, 10, token_s=[1.0, 1.1, 1.2, 1.3], output_ids=[5, 6, 7, 8],
                         finish="length")
    second = load.follow_up(done, now_s=1.3)
    assert second is not None and (second.id, second.turn, second.arrival_s, second.group) == (1, 1, 1.3, 0)
    assert second.prompt_ids[:14] == first.prompt_ids + (5, 6, 7, 8) and len(second.prompt_ids) == 24
    third = load.follow_up(RequestRecord(1, 1.3, 24, token_s=[2.0], output_ids=[9], finish="eos"), now_s=2.0)
    assert third is not None and third.turn == 2 and third.prompt_ids[:25] == second.prompt_ids + (9,)
    assert load.follow_up(RequestRecord(2, 2.0, 35, token_s=[3.0], output_ids=[1], finish="eos"), 3.0) is None
    refused = load.follow_up(RequestRecord(3, 1.0, 10, finish="refused"), now_s=1.0)
    assert refused is None, "a refused turn ends its conversation"


def test_a_closed_loop_user_sends_its_next_request_when_the_last_finished(byte_tok, text):
    spec = LoadSpec(arrival="concurrency", concurrency=3, num_requests=7, prompt_tokens=Lengths("fixed", 8))
    load = build_load(spec, byte_tok, text)
    assert [(r.id, r.arrival_s) for r in load.requests] == [(0, 0.0), (1, 0.0), (2, 0.0)]
    issued, now = [r.id for r in load.requests], 0.0
    queue = list(load.requests)
    while queue:
        now += 0.5
        r = queue.pop(0)
        nxt = load.follow_up(RequestRecord(r.id, r.arrival_s, 8, token_s=[now], output_ids=[1], finish="eos"), now)
        if nxt is not None:
            assert nxt.arrival_s == now and nxt.id == r.id + 3  # the same user's next conversation
            issued.append(nxt.id)
            queue.append(nxt)
    assert sorted(issued) == list(range(7))
    timed = build_load(LoadSpec(**{**spec.__dict__, "num_requests": None, "duration_s": 2.0}), byte_tok, text)
    record = RequestRecord(0, 0.0, 8, token_s=[1.0], output_ids=[1], finish="eos")
    assert timed.follow_up(record, 1.0) is not None
    assert timed.follow_up(RequestRecord(1, 0.0, 8, token_s=[2.5], output_ids=[1], finish="eos"), 2.5) is None


def test_a_prompts_file_gives_its_prompts_cut_to_the_drawn_length(bpe_tok, text):
    prompts = [text[i * 3000:(i + 1) * 3000] for i in range(5)]
    spec = LoadSpec(rate=1.0, num_requests=8, prompt_tokens=Lengths("uniform", min=50, max=60))
    requests = build_load(spec, bpe_tok, prompts=prompts).requests
    encoded = [tuple(bpe_tok.encode(p, add_special_tokens=False)) for p in prompts]
    for r in requests:
        assert 50 <= len(r.prompt_ids) <= 60 and r.prompt_ids == encoded[r.id % 5][:len(r.prompt_ids)]
    whole = build_load(LoadSpec(rate=1.0, num_requests=2), bpe_tok, prompts=prompts).requests
    assert whole[1].prompt_ids == encoded[1]
    with pytest.raises(DataError, match="prompt 1 has 3 tokens, fewer than the 50 asked"):
        PromptFile(bpe_tok, ["abc"]).take(0, 50)


def test_a_prompts_file_too_short_is_known_without_a_tokenizer():
    lines = prompt_lines('{"prompt": "a long enough prompt"}\n\n{"prompt": "short"}\n', jsonl=True)
    assert lines == [(1, "a long enough prompt"), (3, "short")]
    assert short_prompt(lines, 5) is None
    assert short_prompt(lines, 6) == ("line 3: the prompt is 5 bytes, too short for 6 tokens (a token is at least "
                                      "one byte): lower prompt_tokens, or use longer prompts")
    with pytest.raises(ValueError, match="line 1: expected a JSON object"):
        prompt_lines("[1, 2]\n", jsonl=True)
