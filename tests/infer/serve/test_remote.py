"""RemoteServer against a real server on loopback (ours, in this process on a free port): the same requests give the
same greedy tokens over HTTP as on the scheduler in-process, exact output lengths, prompt tokens counted by the
server, refusals of a full queue, and `launched` reporting a server that dies before it answers."""

import socket
import sys
import time

import pytest

from runner.errors import StepError
from runner.infer.config.decoding import GenerateConfig
from runner.infer.serve.driver import drive, load_clock
from runner.infer.serve.live import SchedulerConfig
from runner.infer.serve.remote import Endpoint, RemoteServer, launched
from runner.infer.serve.requests import Request
from runner.infer.serve.scheduler import Scheduler
from runner.infer.server.lifecycle import serving
from tests.infer.serve.clocks import FakeClock

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = SchedulerConfig(block_size=4, num_blocks=200, max_running=4,
                         sampling=GenerateConfig(temperature=0.0, max_seq_len=256))


def _requests(tiny_lm, count: int, output: int, gap_s: float) -> list[Request]:
    """`count` prompts of distinct lengths from one text, each asking for exactly `output` tokens."""
    ids = tiny_lm.tokenizer("the quick brown fox jumps over the lazy dog " * 8)["input_ids"]
    return [Request(i, i * gap_s, tuple(ids[: 6 + 3 * i]), output, min_new_tokens=output) for i in range(count)]


def test_token_ids_over_http_give_the_in_process_tokens_and_counts(tiny_lm):
    requests = _requests(tiny_lm, 6, 8, 0.01)
    clock = FakeClock()
    expected = drive(Scheduler(tiny_lm.model, CONFIG, clock=clock), requests, clock, clock.sleep)
    with serving(tiny_lm.model, tiny_lm.tokenizer, CONFIG, model_name="tiny") as server:
        remote = RemoteServer(Endpoint("ours-http", server.url, "tiny", prompt_format="token_ids"), tiny_lm.tokenizer)
        try:
            records = drive(remote, requests, load_clock(), time.sleep)
        finally:
            remote.close()
    assert [r.finish for r in records] == ["length"] * 6, [r.error for r in records]
    assert [len(r.token_s) for r in records] == [8] * 6  # exact lengths: ignore_eos reached the server
    assert remote.server_prompt_tokens == {r.id: len(r.prompt_ids) for r in requests}
    # the server returned its token ids (return_token_ids): the very ids of the in-process scheduler
    assert [r.output_ids for r in records] == [r.output_ids for r in expected]
    assert all(r.token_s == sorted(r.token_s) and r.token_s[0] >= r.arrival_s for r in records)


def test_chat_api_and_text_prompts_are_counted_by_the_server(tiny_lm):
    requests = _requests(tiny_lm, 3, 4, 0.0)
    with serving(tiny_lm.model, tiny_lm.tokenizer, CONFIG, model_name="tiny") as server:
        remote = RemoteServer(Endpoint("chat", server.url + "/v1", "tiny", api="chat"), tiny_lm.tokenizer)
        try:
            records = drive(remote, requests, load_clock(), time.sleep)
        finally:
            remote.close()
    assert all(r.ok and len(r.token_s) == 4 for r in records), [r.error for r in records]
    # a chat template (or plain join) wraps the prompt: the server counts more tokens than the bare prompt's
    assert all(remote.server_prompt_tokens[r.id] > r.prompt_tokens for r in records)


def test_a_full_queue_is_a_refusal_and_a_wrong_model_an_error(tiny_lm):
    config = SchedulerConfig(block_size=4, num_blocks=200, max_running=1, max_queue=1,
                             sampling=GenerateConfig(temperature=0.0, max_seq_len=256))
    requests = _requests(tiny_lm, 6, 200, 0.0)  # all at once: one runs (long enough for the others to arrive under
    # a busy CPU), one waits, the rest find the queue full
    with serving(tiny_lm.model, tiny_lm.tokenizer, config, model_name="tiny") as server:
        remote = RemoteServer(Endpoint("ours-http", server.url, "tiny"), tiny_lm.tokenizer)
        wrong = RemoteServer(Endpoint("wrong", server.url, "no-such-model"), tiny_lm.tokenizer)
        try:
            records = drive(remote, requests, load_clock(), time.sleep)
            errors = drive(wrong, requests[:1], load_clock(), time.sleep)
        finally:
            remote.close()
            wrong.close()
    finishes = [r.finish for r in records]
    assert finishes.count("refused") >= 1 and finishes.count("length") >= 2, finishes
    assert all("HTTP 429" in r.error or "HTTP 503" in r.error for r in records if r.finish == "refused")
    assert errors[0].finish == "error" and "404" in errors[0].error and "no-such-model" in errors[0].error


def test_launched_server_that_exits_is_a_step_error_quoting_its_log(tmp_path):
    command = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)"]
    with pytest.raises(StepError, match=r"exited \(3\)[\s\S]*cannot load the model"):
        with launched(command, Endpoint("x", "http://127.0.0.1:9", "m"), tmp_path / "x.log", timeout_s=30):
            pass


def test_launched_program_that_does_not_exist_is_a_step_error(tmp_path):
    with pytest.raises(StepError, match="cannot start 'no-such-server-program'"):
        with launched(["no-such-server-program"], Endpoint("x", "http://127.0.0.1:9", "m"), tmp_path / "a" / "x.log",
                      timeout_s=5):
            pass


@pytest.mark.slow
def test_llama_cpp_server_on_the_zoo_gguf_takes_the_load_with_exact_lengths(smollm, tmp_path):
    """llama-cpp-python's own server (`make setup-llamacpp`) as an endpoint: it honours neither min_tokens nor
    ignore_eos, so suppress_eos keeps every output at its asked length; it sends no usage in its stream, so the
    prompts are counted by its /extras/tokenize after the load, and equal what the load asked."""
    pytest.importorskip("llama_cpp.server.app", reason="llama.cpp's server is not installed: make setup-llamacpp")
    from runner.infer.loading.zoo import fetch_gguf, zoo_entry

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = Endpoint("llama.cpp", f"http://127.0.0.1:{port}", "smollm2", suppress_eos=True)
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(fetch_gguf(zoo_entry("zoo:smollm2-135m"))),
               "--model_alias", "smollm2", "--port", str(port), "--n_threads", "1", "--n_ctx", "512",
               "--interrupt_requests", "False"]
    ids = smollm.tokenizer("The history of the city begins with a small market by the river, where")["input_ids"]
    requests = [Request(i, 0.05 * i, tuple(ids[: 8 + 2 * i]), 12, min_new_tokens=12) for i in range(3)]
    with launched(command, endpoint, tmp_path / "llama.log", timeout_s=120):
        remote = RemoteServer(endpoint, smollm.tokenizer)
        try:
            records = drive(remote, requests, load_clock(), time.sleep)
        finally:
            remote.close()
        remote.count_prompt_tokens()
    assert [r.finish for r in records] == ["length"] * 3, [r.error for r in records]
    assert [len(r.token_s) for r in records] == [12] * 3
    assert remote.server_prompt_tokens == {r.id: len(r.prompt_ids) for r in requests}
