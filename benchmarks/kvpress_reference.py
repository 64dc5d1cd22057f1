"""kvpress (NVIDIA's KV-eviction library) as the reference for runner's own eviction presses, run in a subprocess.

    python benchmarks/kvpress_reference.py --smoke     # each press on one short prompt, zoo SmolLM2-135M if cached

kvpress 0.5.5 needs transformers<5.3; runner runs 5.24. `run_kvpress` (the parent side) makes the pinned site folder
once (runner/infer/loading/peers.py: kvpress 0.5.5 + transformers 5.2.0, ~15 s) and runs this file with `--worker`
in a subprocess of the same python with the site first on PYTHONPATH. The worker imports only torch, transformers
and kvpress — never runner — and does what kvpress's own pipeline does: prefill the context inside
`with press(model)`, then feed the question (uncompressed) at its true positions and decode greedily, stopping at
EOS. It also reports, per layer and KV head, which context positions the press kept: it wraps the press's
`compress` and finds each kept key row among the uncompressed keys it was handed, byte for byte.

Request (JSON on the worker's stdin): {"model_dir": str, "press": one of PRESSES, "compression_ratio": float,
"options": {press field: value} (e.g. n_sink, window_size, kernel_size, n_future_positions), "prompts":
[{"context": [ids], "question": [ids]}, ...] (a bare list of ids is a context with no question), "max_new_tokens":
int, "dtype": "float32" | "bfloat16" | "float16", "attn_implementation": null (sdpa; eager for
observed_attention, which needs the attention weights) | "eager" | "sdpa", "threads": int, "return_kept": bool}.
Response (JSON on stdout): {"versions": {...}, "press": repr of the press, "attn_implementation": str,
"results": [{"context_tokens": int, "answer_ids": [int], "kept": [[[int] per KV head] per layer] (sorted context
positions), "prefill_s": float, "decode_s": float, "peak_rss_added": bytes the process's peak RSS rose over its RSS
before the prompt (Linux; else null)}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# press name -> kvpress module and class (the presses runner implements too)
PRESSES = {
    "streaming_llm": ("streaming_llm_press", "StreamingLLMPress"),
    "snapkv": ("snapkv_press", "SnapKVPress"),
    "tova": ("tova_press", "TOVAPress"),
    "knorm": ("knorm_press", "KnormPress"),
    "observed_attention": ("observed_attention_press", "ObservedAttentionPress"),
    "expected_attention": ("expected_attention_press", "ExpectedAttentionPress"),
}
NEEDS_EAGER = {"observed_attention"}  # scores from the attention weights, which only eager attention returns


# ---- parent side (runner's venv, transformers 5.24) ----

def run_kvpress(model_dir: str | Path, prompts: list, press: str, compression_ratio: float, *,
                max_new_tokens: int = 16, dtype: str = "float32", attn_implementation: str | None = None,
                threads: int = 1, return_kept: bool = True, timeout_s: float | None = None, **options) -> dict:
    """Run kvpress's `press` at `compression_ratio` (press fields in `options`) on `prompts` (lists of token ids,
    or {"context": ids, "question": ids}) with the model in `model_dir`, in a subprocess; the worker's JSON."""
    from runner.infer.loading.peers import kvpress_env, kvpress_site

    if press not in PRESSES:
        raise ValueError(f"unknown press {press!r}; kvpress_reference knows {', '.join(PRESSES)}")
    request = {"model_dir": str(model_dir), "press": press, "compression_ratio": compression_ratio,
               "options": options, "prompts": prompts, "max_new_tokens": max_new_tokens, "dtype": dtype,
               "attn_implementation": attn_implementation, "threads": threads, "return_kept": return_kept}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], input=json.dumps(request),
                          capture_output=True, text=True, env=kvpress_env(kvpress_site()), timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"kvpress worker failed ({done.returncode}):\n{done.stderr.strip()[-4000:]}")
    return json.loads(done.stdout)


def smoke() -> None:
    """Each press on one short needle prompt with the zoo's SmolLM2-135M: kept counts and answers."""
    from transformers import AutoTokenizer

    from runner.infer.loading.zoo import zoo_cached, zoo_model_dir

    if not zoo_cached("zoo:smollm2-135m"):
        sys.exit("zoo:smollm2-135m is not converted in runner's cache; load it once with runner first")
    folder = zoo_model_dir("zoo:smollm2-135m")
    tok = AutoTokenizer.from_pretrained(folder)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    context = filler * 6 + "The special magic number is 7421. " + filler * 6
    prompt = {"context": tok(context)["input_ids"], "question": tok(" What is the special magic number? "
                                                                    "The special magic number is")["input_ids"]}
    print(f"SmolLM2-135M, context {len(prompt['context'])} tokens, ratio 0.5, 8 new tokens")
    for press in PRESSES:
        options = {"window_size": 16} if press == "snapkv" else {}
        start = time.perf_counter()
        out = run_kvpress(folder, [prompt], press, 0.5, max_new_tokens=8, **options)
        wall_s = time.perf_counter() - start
        result = out["results"][0]
        kept = [len(heads[0]) for heads in result["kept"]]
        print(f"{press:>20}: kept per layer {min(kept)}..{max(kept)} of {result['context_tokens']}, "
              f"layer 0 head 0 first {result['kept'][0][0][:8]}, answer {tok.decode(result['answer_ids'])!r} "
              f"({wall_s:.1f} s with start-up; {out['attn_implementation']})")


# ---- worker side (the kvpress site's transformers 5.2; never imports runner) ----

def import_kvpress_press(site_entry: str, module: str, cls: str):
    """kvpress's press class without running kvpress/__init__.py, which imports every press and with them
    `datasets` and `fire` (DuoAttention, the statistics script), which the site does not hold. Applies the
    attention patch kvpress's __init__ applies (head-wise masking; a no-op for the presses here)."""
    import importlib
    import importlib.util

    if "kvpress" not in sys.modules:
        folder = Path(site_entry) / "kvpress"
        spec = importlib.util.spec_from_file_location("kvpress", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        assert spec is not None
        sys.modules["kvpress"] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
        importlib.import_module("kvpress.attention_patch").patch_attention_functions()
    return getattr(importlib.import_module(f"kvpress.presses.{module}"), cls)


def capture_kept(press, kept_by_layer: dict) -> None:
    """Wrap `press.compress` to record, per layer and KV head, the positions of the keys it kept: each kept key row
    is looked up among the keys the press was given, byte for byte (a press that alters keys fails loudly)."""
    compress = press.compress

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        before, after = keys[0].float().cpu().numpy(), new_keys[0].float().cpu().numpy()
        heads = []
        for h in range(before.shape[0]):
            where = {row.tobytes(): i for i, row in enumerate(before[h])}
            found = [where.get(row.tobytes()) for row in after[h]]
            positions = sorted(i for i in found if i is not None)
            if len(positions) != len(found) or len(set(positions)) != len(positions):
                raise RuntimeError(f"layer {module.layer_idx} head {h}: the press returned keys that are not "
                                   "distinct rows of its inputs; kept positions cannot be read back")
            heads.append(positions)
        kept_by_layer[module.layer_idx] = heads
        return new_keys, new_values

    press.compress = recording


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_rss_peak() -> int | None:
    """Reset the process's peak RSS (VmHWM) to its current RSS; the current RSS in bytes (None: not Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return rss_kib("VmRSS") * 1024
    except (OSError, RuntimeError):
        return None


def worker(request: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(int(request.get("threads", 1)))
    name = request["press"]
    attn = request.get("attn_implementation") or ("eager" if name in NEEDS_EAGER else "sdpa")
    site_entry = next(p for p in sys.path if (Path(p or ".") / "kvpress" / "presses").is_dir())
    press_cls = import_kvpress_press(site_entry, *PRESSES[name])
    press = press_cls(compression_ratio=request["compression_ratio"], **request.get("options", {}))
    kept_by_layer: dict[int, list] = {}
    if request.get("return_kept", True):
        capture_kept(press, kept_by_layer)
    model = AutoModelForCausalLM.from_pretrained(request["model_dir"], dtype=getattr(torch, request["dtype"]),
                                                 attn_implementation=attn).eval()
    with torch.no_grad():  # page the weights in (a lazily mapped checkpoint), so no prompt's peak RSS counts them
        for p in model.parameters():
            p.sum()
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    results = []
    for prompt in request["prompts"]:
        context, question = (prompt, []) if isinstance(prompt, list) else (prompt["context"], prompt["question"])
        kept_by_layer.clear()
        base_rss = reset_rss_peak()
        with torch.inference_mode():
            start = time.perf_counter()
            cache = DynamicCache()  # `past_key_values`: the peer's transformers 5.2.0 (runner's 5.24+: `cache`)
            with press(model):
                out = model(input_ids=torch.tensor([context]), past_key_values=cache, logits_to_keep=1)
            prefill_s = time.perf_counter() - start
            position = len(context)  # the next token's true position, whatever the cache holds
            if question:
                out = model(input_ids=torch.tensor([question]), past_key_values=cache, logits_to_keep=1,
                            position_ids=torch.arange(position, position + len(question)).unsqueeze(0))
                position += len(question)
            answer = [int(out.logits[0, -1].argmax())]
            while len(answer) < request["max_new_tokens"] and answer[-1] not in stop:
                out = model(input_ids=torch.tensor([[answer[-1]]]), past_key_values=cache,
                            position_ids=torch.tensor([[position]]))
                position += 1
                answer.append(int(out.logits[0, -1].argmax()))
        results.append({"context_tokens": len(context), "answer_ids": answer,
                        "kept": [kept_by_layer[i] for i in sorted(kept_by_layer)],
                        "prefill_s": prefill_s, "decode_s": time.perf_counter() - start - prefill_s,
                        "peak_rss_added": rss_kib("VmHWM") * 1024 - base_rss if base_rss is not None else None})
    from importlib.metadata import version

    return {"versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "press": repr(press), "attn_implementation": attn, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="the subprocess side: a JSON request on stdin")
    parser.add_argument("--smoke", action="store_true", help="each press on one short prompt (zoo SmolLM2-135M)")
    args = parser.parse_args()
    if args.worker:
        request = json.load(sys.stdin)
        real_stdout, sys.stdout = sys.stdout, sys.stderr  # libraries' prints must not corrupt the JSON
        response = worker(request)
        real_stdout.write(json.dumps(response))
    elif args.smoke:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        smoke()
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
