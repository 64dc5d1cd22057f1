"""The server under a bounded loopback load: requests in flight together (streamed and whole, completions and chat),
an overload that gets 429s with Retry-After, clients that disconnect mid-stream or mid-wait, malformed JSON,
oversized prompts, an unknown model. No request is lost (each got one answer, and the server counted each once),
nothing leaks (the scheduler's running, waiting, blocks and records return to zero), and /metrics parses as
Prometheus text with counts equal to the client's."""

import asyncio
import json
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner.infer.config.decoding import GenerateConfig
from runner.infer.serve.live import SchedulerConfig
from runner.infer.server.lifecycle import serving

pytestmark = pytest.mark.usefixtures("one_thread")


async def _ask(http: httpx.AsyncClient, i: int) -> str:
    """One well-formed request (kind by i) → 'ok' or 'refused'; checks the answer's shape."""
    body = {"model": "tiny", "max_tokens": 6 + i % 5, "temperature": 0, "ignore_eos": True,
            "stream": i % 2 == 0}
    path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
    body |= {"messages": [{"role": "user", "content": f"request {i}"}]} if i % 3 == 0 else {"prompt": [5 + i] * 12}
    if body["stream"]:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return _refusal(response.status_code, response.headers, json.loads(await response.aread()))
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        return "ok"
    response = await http.post(path, json=body)
    if response.status_code != 200:
        return _refusal(response.status_code, response.headers, response.json())
    assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]
    return "ok"


def _refusal(status: int, headers, body: dict) -> str:
    assert status == 429 and headers["retry-after"] == "1" and body["error"]["code"] == "queue_full", body
    return "refused"


async def _leave_mid_stream(http: httpx.AsyncClient) -> str:
    body = {"model": "tiny", "prompt": [7] * 10, "max_tokens": 900, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the client goes
    return "cancelled"


async def _leave_mid_wait(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post("/v1/completions", json={"model": "tiny", "prompt": [9] * 10, "max_tokens": 900,
                                                          "ignore_eos": True})
    return "cancelled"


async def _bad(http: httpx.AsyncClient) -> list[str]:
    out = []
    for content, status, outcome in [
        (b'{"model": "tiny", "prompt": [1, 2', 400, "invalid"),
        (json.dumps({"model": "tiny", "prompt": [3] * 2100}).encode(), 400, "invalid"),  # past the context
        (json.dumps({"model": "tiny", "prompt": [3] * 600, "max_tokens": 600}).encode(), 400, "invalid"),  # > 1024 KV
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "unknown_model"),
    ]:
        response = await http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert response.status_code == status and "error" in response.json()
        out.append(outcome)
    return out


async def _load(url: str) -> Counter:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        flood = await asyncio.gather(*(_ask(http, i) for i in range(36)))  # 4 run, 6 wait, the rest are refused
        leaving = await asyncio.gather(*(_leave_mid_stream(http) for _ in range(3)), _leave_mid_wait(url))
        calm = await asyncio.gather(*(_ask(http, i) for i in range(6)))  # the queue alone holds them: none refused
        bad = await _bad(http)
    assert "refused" in flood and "ok" in flood and set(calm) == {"ok"}
    return Counter([*flood, *leaving, *calm, *bad])


def test_a_bounded_load_loses_no_request_and_leaks_no_slot(tiny_lm):
    config = SchedulerConfig(block_size=16, num_blocks=64, max_running=4, max_queue=6,
                             sampling=GenerateConfig(temperature=0.0, max_seq_len=2048))
    with serving(tiny_lm.model, tiny_lm.tokenizer, config, model_name="tiny") as server:
        client = asyncio.run(_load(server.url))
        assert server.wait_idle(10)
        scheduler = server.engine.scheduler
        for _ in range(100):  # the engine frees a cancelled request's slot on its next turn
            if not scheduler.busy:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert scheduler.running == [] and len(scheduler.waiting) == 0
        assert scheduler.pool.used == 0 and scheduler.pool.held == {} and scheduler.records == {}
        text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    outcomes = {s.labels["outcome"]: s.value for s in families["runner_requests"].samples
                if s.name == "runner_requests_total"}
    assert outcomes.pop("length") == client["ok"]
    assert outcomes.pop("refused") == client["refused"]
    assert outcomes.pop("cancelled") == client["cancelled"]
    assert outcomes.pop("invalid") == client["invalid"] and outcomes.pop("error") == client["error"]
    assert outcomes.pop("unknown_model") == client["unknown_model"]
    assert set(outcomes.values()) == {0}  # eos, stop, draining: none
    ttft = {s.name: s.value for s in families["runner_time_to_first_token_seconds"].samples}
    assert ttft["runner_time_to_first_token_seconds_count"] == client["ok"]
    gauges = {f: families[f].samples[0].value for f in ("runner_requests_running", "runner_requests_waiting",
                                                          "runner_kv_blocks_used", "runner_kv_blocks_total")}
    assert gauges == {"runner_requests_running": 0, "runner_requests_waiting": 0, "runner_kv_blocks_used": 0,
                      "runner_kv_blocks_total": 64}
    pool_bytes = families["runner_kv_bytes"].samples[0].value  # the pool's storage stays allocated, within budget
    assert pool_bytes == scheduler.kv_bytes() and 0 < pool_bytes <= 64 * scheduler.pool.spec.block_bytes
    generated = families["runner_generation_tokens"].samples[0].value
    assert generated >= sum(6 + i % 5 for i in range(6))


def test_prefix_cache_hits_and_queries_are_counted_in_tokens(tiny_lm):
    """A second request sharing the first one's two full blocks (32 of 40 tokens) after it finished: /metrics counts
    every admitted prompt token as a query and the 32 tokens not prefilled as hits (vLLM's prefix_cache_* pair)."""
    config = SchedulerConfig(block_size=16, prefix_caching=True,
                             sampling=GenerateConfig(temperature=0.0, max_seq_len=2048))
    first, second = list(range(10, 50)), [*range(10, 42), 7, 8, 9]
    with serving(tiny_lm.model, tiny_lm.tokenizer, config, model_name="tiny") as server:
        for prompt in (first, second):
            response = httpx.post(server.url + "/v1/completions", timeout=60,
                                  json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True})
            assert response.status_code == 200
        assert server.wait_idle(10)
        text = httpx.get(server.url + "/metrics").text
    counters = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert counters["runner_prefix_cache_queries_total"] == len(first) + len(second)
    assert counters["runner_prefix_cache_hits_total"] == 32
