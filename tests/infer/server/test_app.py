"""The OpenAI-compatible server on a real uvicorn on 127.0.0.1 over the tiny random model: the official openai client
(completions and chat, streamed and whole), greedy output over HTTP equal to the scheduler's in-process output,
per-request sampling and stop strings, and every refusal in OpenAI's error shape with the field named."""

import httpx
import openai
import pytest

from runner.infer.config.decoding import GenerateConfig
from runner.infer.serve.driver import drive
from runner.infer.serve.live import SchedulerConfig
from runner.infer.serve.requests import Request
from runner.infer.serve.scheduler import Scheduler
from runner.infer.server.lifecycle import serving
from runner.infer.server.protocol import plain_chat
from tests.infer.serve.clocks import FakeClock

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_lm, one_thread):
    config = SchedulerConfig(block_size=4, num_blocks=40, max_running=4, max_queue=16,
                             sampling=GenerateConfig(temperature=0.0, max_seq_len=256))
    with serving(tiny_lm.model, tiny_lm.tokenizer, config, model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _in_process(tiny_lm, ids: list[int], max_tokens: int) -> list[int]:
    """The same prompt on a scheduler in this process, no HTTP: its greedy output ids."""
    clock = FakeClock()
    scheduler = Scheduler(tiny_lm.model, SchedulerConfig(block_size=4), clock=clock)
    return drive(scheduler, [Request(0, 0.0, tuple(ids), max_tokens)], clock, clock.sleep)[0].output_ids


def _ids(tiny_lm, text: str) -> list[int]:
    return tiny_lm.tokenizer(text, add_special_tokens=True)["input_ids"]


def test_completions_whole_and_streamed_equal_the_in_process_scheduler(tiny_lm, client):
    expected_ids = _in_process(tiny_lm, _ids(tiny_lm, PROMPT), 12)
    expected = tiny_lm.tokenizer.decode(expected_ids, skip_special_tokens=True)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(_ids(tiny_lm, PROMPT))
    assert whole.usage.completion_tokens == len(expected_ids)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected_ids)
    assert len(chunks) > 3  # tokens came as they were made, not in one piece


def test_a_prompt_of_token_ids_is_used_as_it_is(tiny_lm, client):
    ids = list(range(40, 70))
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body={
        "ignore_eos": True})
    assert out.usage.prompt_tokens == 30 and out.usage.completion_tokens == 10  # exact, EOS ignored
    assert out.choices[0].finish_reason == "length"
    expected = _in_process(tiny_lm, ids, 10)
    if len(expected) == 10:  # no EOS on the way: the same tokens
        assert out.choices[0].text == tiny_lm.tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_whole_and_streamed_through_the_plain_join(tiny_lm, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = _ids(tiny_lm, plain_chat([("system", "Be brief."), ("user", "Hi there")]))
    expected = tiny_lm.tokenizer.decode(_in_process(tiny_lm, prompt, 9), skip_special_tokens=True)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(prompt)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason in ("stop", "length")


def test_seed_and_stop_strings_per_request(tiny_lm, client):
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11,
                                         extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same tokens, whatever the request's id
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = next(ch for ch in greedy[3:] if ch.isprintable() and ch != "\ufffd" and greedy.find(ch) >= 3)
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == greedy[:greedy.find(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_health_and_refusals_in_openais_shape(tiny_lm, server, client):
    http = httpx.Client(base_url=server.url, timeout=30)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 160  # 40 KV blocks of 4, below the context
    unbounded = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert unbounded.usage.prompt_tokens + unbounded.usage.completion_tokens <= 160  # max_tokens: what fits
    assert http.get("/health").json() == {"status": "ok"}
    cases = [  # (body, status, param)
        ({"model": "tiny", "prompt": "x", "temperature": 7}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "tiny", "prompt": [1, 2, 999_999]}, 400, "prompt"),
        ({"model": "tiny", "prompt": list(range(3, 260))}, 400, "prompt"),  # longer than the 256-token context
        ({"model": "tiny", "prompt": "x", "max_tokens": 256}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": list(range(3, 200)), "max_tokens": 50}, 400, "prompt"),  # past 40 KV blocks of 4
        ({"model": "other", "prompt": "x"}, 404, "model"),
    ]
    for body, status, param in cases:
        response = http.post("/v1/completions", json=body)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (status, param), (body, error)
        assert error["message"] and error["type"]
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}).json()["error"]["param"] == \
        "messages"
    malformed = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                          headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    tolerated = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u",
                                                   "made_up_field": 1})
    assert tolerated.status_code == 200 and tolerated.json()["usage"]["completion_tokens"] >= 1


def test_a_chat_template_is_used_when_the_tokenizer_has_one(tiny_lm, server):
    from runner.infer.server.protocol import chat_prompt_ids

    tokenizer = tiny_lm.tokenizer
    saved = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system "
                               "role') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    http = httpx.Client(base_url=server.url, timeout=30)
    try:
        ids = chat_prompt_ids(tokenizer, [("user", "Hi")])
        out = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        refused = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}]})
    finally:
        tokenizer.chat_template = saved
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<user>Hi<assistant>"
    assert out.json()["usage"]["prompt_tokens"] == len(ids)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert "no system role" in refused.json()["error"]["message"]


def test_the_compiled_slots_behind_the_server(tiny_lm, monkeypatch):
    """engine compiled (its static step run uncompiled here): greedy output equals the eager scheduler's in-process,
    a request longer than a row is a 400, and once a client has left mid-response no row or block stays held."""
    from runner.infer.compiled import engine as compiled
    from runner.infer.compiled.engine import CompiledEngine

    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, CompiledEngine(tiny_lm.model, compile=False))
    ids = list(range(20, 44))
    config = SchedulerConfig(block_size=4, max_running=2, sampling=GenerateConfig(temperature=0.0, max_seq_len=256))
    with serving(tiny_lm.model, tiny_lm.tokenizer, config, engine="compiled", columns=64, model_name="tiny") as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        out = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 10, "temperature": 0})
        expected = _in_process(tiny_lm, ids, 10)
        assert out.json()["usage"]["completion_tokens"] == len(expected)
        assert out.json()["choices"][0]["text"] == tiny_lm.tokenizer.decode(expected, skip_special_tokens=True)
        too_long = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 50})
        assert too_long.status_code == 400 and "64" in too_long.json()["error"]["message"]
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 40, "ignore_eos": True},
                      timeout=0.05)
        assert server.wait_idle(10)
        slots = server.engine.scheduler
        assert slots.slot_of == {} and slots.pool.used == 0
