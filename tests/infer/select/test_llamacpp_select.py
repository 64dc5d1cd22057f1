"""`cache_kind: auto` on engine llama.cpp, on the tiny llama written as an f32 GGUF: kinds llama.cpp lacks are rows
that say why, the gates come from llama.cpp's own logits against its f32 K/V, the survivors are timed on llama.cpp,
and the plan is persisted with the engine in its key, then reused."""

import pytest

from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.llamacpp import LlamaCppOptions
from runner.infer.llamacpp.engine import LlamaCppEngine
from runner.infer.llamacpp.gguf_file import written_gguf
from runner.infer.loading.models import load_model
from runner.infer.loading.texts import load_text
from runner.infer.measure.quality import build_probe, compare
from runner.infer.select.llamacpp import probe_llamacpp, select_llamacpp_kind
from tests.conftest import LLAMA_32, NEEDS_LLAMACPP

pytest.importorskip("llama_cpp", reason=NEEDS_LLAMACPP)


@pytest.fixture(scope="module")
def tiny_lm():
    """A tiny random llama whose head size (32) llama.cpp's block K/V types divide."""
    return load_model(config=LLAMA_32, device="cpu", seed=0)


def _config(plans, **over) -> GenerateConfig:
    settings = dict(engine="llama.cpp", cache_kind="auto", cache_candidates=["fp32", "fp16", "q8_0", "q4_0"],
                    max_seq_len=256, cache_quality_prompt_len=12, cache_quality_decode_steps=2,
                    cache_quality_windows=2, cache_quality_ppl_len=160, cache_auto_bench_steps=2,
                    cache_auto_bench_prompt_len=8, cache_auto_bench_repeats=1, cache_quality_max_mean_kl=10,
                    cache_quality_max_delta_nll=10, cache_quality_max_ppl_ratio=10, cache_plan_path=str(plans),
                    llamacpp=LlamaCppOptions(threads=1))
    return GenerateConfig(**(settings | over))


def test_the_reference_against_itself_costs_nothing_and_q4_costs_more_than_q8(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    gguf = written_gguf(tiny_lm.model, tiny_lm.tokenizer)
    text = load_text("pydoc")
    probe = build_probe(tiny_lm.tokenizer, text, 12, 3, 2, 160, tiny_lm.device)
    runs = {kind: probe_llamacpp(LlamaCppEngine(gguf, kind=kind, n_ctx=200, logits_all=True,
                                                options=LlamaCppOptions(threads=1)), probe)
            for kind in ("fp32", "q8_0", "q4_0")}
    same = compare(runs["fp32"], runs["fp32"])
    assert same["delta_nll"] == 0 and same["mean_kl"] == 0
    q8, q4 = compare(runs["fp32"], runs["q8_0"]), compare(runs["fp32"], runs["q4_0"])
    assert 0 < q8["mean_kl"] < q4["mean_kl"]
    assert q4["measured_bytes_per_token"] < q8["measured_bytes_per_token"] < same["measured_bytes_per_token"]


def test_selection_is_measured_on_llamacpp_persisted_and_reused(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    gguf = written_gguf(tiny_lm.model, tiny_lm.tokenizer)
    plans = tmp_path / "plans.json"
    settings = _config(plans).model_dump(exclude={"cache_candidates"}) | {"cache_budget_mb": 0.1}
    config = GenerateConfig(**settings)  # the default candidates: KIVI and nf4 among them
    selection = select_llamacpp_kind(gguf, tiny_lm.tokenizer, config, text=load_text("pydoc"))
    rows = {row["kind"]: row for row in selection.rows}
    kivi = [row for row in selection.rows if row["kind"].startswith("kivi")]
    assert len(kivi) == 4 and all("no KIVI" in row["verdict"] and not row["passed"] for row in kivi)
    assert "no nf4" in rows["nf4"]["verdict"]
    assert not rows["fp16"]["fits"]  # 2 layers × 2 KV heads × 32 × 2 sides × 2 bytes × 256 tokens = 0.125 MiB
    assert selection.kind in {"q8_0", "q4_0", "q4_1"} and selection.source == "measured" and not selection.reused
    assert all(rows[k]["timed_on"] == "llama.cpp" and rows[k]["tokens_per_s"] > 0 for k in ("q8_0", "q4_0"))
    assert selection.fields["engine"] == "llama.cpp" and selection.fields["model"]["sha256"]
    again = select_llamacpp_kind(gguf, tiny_lm.tokenizer, config, text=load_text("pydoc"))
    assert again.reused and again.kind == selection.kind and again.key == selection.key
    other = select_llamacpp_kind(gguf, tiny_lm.tokenizer, _config(plans, cache_candidates=["fp16", "q8_0"]),
                                 text=load_text("pydoc"))
    assert other.key != selection.key
