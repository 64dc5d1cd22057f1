"""`run serve m.yaml`: the manifest's serve run behind the HTTP server. Which run it serves, or the located exit-2
error; a port in use is a clear exit-2 error; as a subprocess, Ctrl-C drains (new requests 503, the running one
finishes) and a second Ctrl-C cancels what runs, each said on stderr, exit 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from runner.cli import main
from tests.conftest import tiny_manifest

SERVE_RUN = """      - id: {id}
        mode: serve
        serve: {{rate: 1, max_batch_size: 4, kv_blocks: 400, block_size: 16, max_queue: 8}}
"""


def _manifest(tmp_path, *ids: str):
    return tiny_manifest(tmp_path, "".join(SERVE_RUN.format(id=i) for i in ids))


def test_which_run_is_served_or_a_clear_exit_2(tmp_path, capsys):
    two = _manifest(tmp_path, "a", "b")
    assert main(["serve", str(two)]) == 2
    assert "has 2 serve runs (tiny/a, tiny/b): choose one with --run" in capsys.readouterr().err
    assert main(["serve", str(two), "--run", "c"]) == 2
    assert "--run c: no serve run" in capsys.readouterr().err
    none = tiny_manifest(tmp_path, "      - id: g\n        mode: generate\n        generate: {prompts: [hi]}\n")
    assert main(["serve", str(none)]) == 2
    assert "has no run with mode: serve" in capsys.readouterr().err
    assert main(["serve", str(two), "targets.0.runs.0.serve.max_queue=0", "--run", "a"]) == 2
    assert "max_queue" in capsys.readouterr().err  # the manifest's own located error


def test_a_port_in_use_is_a_clear_exit_2(tmp_path, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        code = main(["serve", str(_manifest(tmp_path, "a")), "--port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert code == 2 and "is already in use" in err and "Traceback" not in err


def _stream(url: str, max_tokens: int, out: dict) -> None:
    """A streamed completion; `out` gets the finish reason of its last chunk, and `started` once a token came."""
    body = {"model": "tiny", "prompt": [5] * 10, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                out.setdefault("started", threading.Event()).set()
                out["finish"] = json.loads(line[6:])["choices"][0]["finish_reason"] or out.get("finish")


@pytest.mark.e2e
def test_ctrl_c_drains_then_a_second_cancels(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "runner", "serve", str(_manifest(tmp_path, "a")), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving tiny at http://127.0.0.1:"), line + process.stderr.read()
        url = line.split()[3]
        short, long = {"started": threading.Event()}, {"started": threading.Event()}
        threads = [threading.Thread(target=_stream, args=(url, n, out)) for n, out in ((200, short), (2000, long))]
        for thread in threads:
            thread.start()
        assert short["started"].wait(60) and long["started"].wait(60)
        process.send_signal(signal.SIGINT)
        refused = None
        for _ in range(100):  # the signal lands in the main thread between its naps
            refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
            if refused.status_code == 503:
                break
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        threads[0].join(60)
        assert short["finish"] == "length"  # drained: it ran to its end
        assert long.get("finish") is None  # still running
        process.send_signal(signal.SIGINT)
        threads[1].join(60)
        assert long["finish"] == "cancelled"
        assert process.wait(60) == 0
        err = process.stderr.read()
        assert "draining" in err and "cancelling" in err and "Traceback" not in err
    finally:
        if process.poll() is None:
            process.kill()


def test_a_draft_model_speculates_behind_the_server(tmp_path):
    """speculative: [draft] first: `run serve` loads the draft and the scheduler drafts with it; the twin of the
    target is always accepted and the completion is the plain server's."""
    from runner.execute.http_serve import serve_target, start_server
    from tests.conftest import TINY_LLAMA

    block = ("{rate: 1, max_batch_size: 4, kv_blocks: 400, speculative: [draft, none], spec_k: 3, "
             f"draft: {{config: {TINY_LLAMA}, device: cpu}}}}")
    path = tiny_manifest(tmp_path, f"      - id: a\n        mode: serve\n        serve: {block}\n")
    body = {"model": "tiny", "prompt": [5, 9, 14] * 4, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    completions, schedulers = [], []
    for overrides in ([], ["targets.0.runs.0.serve.speculative=[none]", "targets.0.runs.0.serve.draft=null"]):
        server = start_server(serve_target(path, overrides), port=0)
        try:
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            completions.append(answer["choices"][0]["text"])
            schedulers.append(server.engine.scheduler)
        finally:
            server.stop()
    assert completions[0] == completions[1]
    drafting, plain = schedulers
    assert drafting.drafter is not None and drafting.accepted == drafting.drafted > 0
    assert plain.drafter is None and plain.drafted == 0
