"""engine llama.cpp through the `run` command on the tiny llama (its weights written as an f32 GGUF): generate gives
our eager engine's greedy tokens, bench has a row per engine with the ratios between them, auto-cache-select chooses
among llama.cpp's K/V types (the default candidates' KIVI and nf4 are rows that say why not)."""

import json

import pandas as pd
import pytest

from tests.conftest import LLAMA_32, NEEDS_LLAMACPP, TINY_LLAMA, tiny_manifest
from tests.test_cli import run_cli

pytest.importorskip("llama_cpp", reason=NEEDS_LLAMACPP)

RUNS = """      - id: ours
        mode: generate
        generate: {prompts: ["hello world"], max_new_tokens: 12, temperature: 0, cache_kind: fp32, eos_token_id: []}
      - id: theirs
        mode: generate
        generate: {prompts: ["hello world"], max_new_tokens: 12, temperature: 0, cache_kind: fp32, eos_token_id: [],
                   engine: llama.cpp, llamacpp: {threads: 1}}
      - id: sampled
        mode: generate
        generate: {prompts: ["hello world"], max_new_tokens: 8, temperature: 0.8, top_k: 20, engine: llama.cpp,
                   cache_kind: q8_0}
      - id: bench
        mode: bench
        bench: {engines: [eager, llama.cpp], cache_kinds: [fp32, q8_0], prompt_lens: 16, max_new_tokens: 4,
                repeats: 2, baseline: none, roofline: false}
      - id: pick
        mode: auto-cache-select
        generate: {engine: llama.cpp, max_seq_len: 256,
                   cache_quality_prompt_len: 12, cache_quality_decode_steps: 2, cache_quality_windows: 2,
                   cache_quality_ppl_len: 160, cache_auto_bench_steps: 2, cache_auto_bench_prompt_len: 8,
                   cache_auto_bench_repeats: 1, cache_quality_max_mean_kl: 10, cache_quality_max_delta_nll: 10,
                   cache_quality_max_ppl_ratio: 10, cache_plan_path: plans.json}
"""


@pytest.mark.e2e
def test_generate_bench_and_selection_on_llamacpp(tmp_path):
    path = tiny_manifest(tmp_path, RUNS)
    path.write_text(path.read_text().replace(str(TINY_LLAMA), str(LLAMA_32)))  # head size 32 for block K/V types
    done = run_cli(path, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p.name.endswith("-t")]
    result = {name: json.loads((folder / "tiny" / name / "results.json").read_text())
              for name in ("ours", "theirs", "sampled", "bench", "pick")}
    ours, theirs = result["ours"]["prompts"][0], result["theirs"]["prompts"][0]
    assert theirs["token_ids"] == ours["token_ids"] and len(ours["token_ids"]) == 12
    assert result["theirs"]["llama_cpp"]["type_k"] == "f32"
    assert result["sampled"]["llama_cpp"]["flash_attn"] is True
    table = pd.read_csv(folder / "tiny" / "bench" / "bench.csv")
    assert sorted(table["engine"]) == ["eager", "eager", "llama.cpp", "llama.cpp"]
    assert (table["status"] == "ok").all(), table["error"].tolist()
    llama = table[table["engine"] == "llama.cpp"].set_index("cache_kind")
    eager = table[table["engine"] == "eager"].set_index("cache_kind")
    for kind in ("fp32", "q8_0"):
        ratio = llama.loc[kind, "ours_tokens_per_s"] / eager.loc[kind, "ours_tokens_per_s"]
        assert llama.loc[kind, "ratio_eager_tokens_per_s"] == pytest.approx(ratio)
        assert eager.loc[kind, "ratio_llamacpp_tokens_per_s"] == pytest.approx(1 / ratio)
    pick = result["pick"]["selection"]
    assert pick["kind"] in {"fp16", "q8_0", "q4_0", "q4_1"}  # the default candidates
    assert "no KIVI" in next(r for r in pick["candidates"] if r["kind"].startswith("kivi4"))["verdict"]
