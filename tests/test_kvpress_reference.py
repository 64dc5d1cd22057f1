"""benchmarks/kvpress_reference.py: kvpress, in its own site folder and a subprocess, checked against a hand
computation in this process (runner's transformers), so the plumbing that makes kvpress the reference is proven."""

import importlib.util
import re
from pathlib import Path

import pytest

from runner.errors import ModelError
from runner.infer.loading.peers import KVPRESS_PINS, KVPRESS_WHEELS

ROOT = Path(__file__).resolve().parents[1]


def reference_module():
    spec = importlib.util.spec_from_file_location("kvpress_reference", ROOT / "benchmarks" / "kvpress_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_pin_has_its_wheel_hash():
    """Each `name==version` pin names exactly one pinned wheel file, and each wheel a pin."""
    wheel_pins = {re.match(r"([^-]+)-([^-]+)-", name).groups() for name in KVPRESS_WHEELS}  # type: ignore[union-attr]
    pins = {(p.split("==")[0].replace("-", "_"), p.split("==")[1]) for p in KVPRESS_PINS}
    assert wheel_pins == pins
    assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in KVPRESS_WHEELS.values())


@pytest.mark.slow
def test_knorm_keeps_the_smallest_norm_keys(tmp_path):
    """kvpress's KnormPress at ratio 0.5 on a tiny random Llama keeps, in every layer and KV head, exactly the half
    of the context positions whose keys (after RoPE, as the cache holds them) have the smallest L2 norms."""
    from runner.infer.loading.peers import kvpress_site

    try:
        kvpress_site()
    except ModelError as exc:  # PyPI not reachable: nothing to compare with
        pytest.skip(f"the kvpress site cannot be made here: {exc}")

    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    context = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    out = reference_module().run_kvpress(tmp_path, [context], "knorm", 0.5, max_new_tokens=3, timeout_s=600)

    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([context]), cache=cache, use_cache=True)
    result = out["results"][0]
    assert out["versions"]["kvpress"] == "0.5.5" and out["versions"]["transformers"] == "5.2.0"
    assert result["context_tokens"] == 40 and len(result["answer_ids"]) == 3
    assert len(result["kept"]) == config.num_hidden_layers
    for layer, heads in enumerate(result["kept"]):
        norms = cache.layers[layer].keys[0].norm(dim=-1)  # (KV heads, positions)
        assert len(heads) == config.num_key_value_heads
        for head, kept in enumerate(heads):
            expected = sorted(norms[head].argsort()[:20].tolist())
            assert kept == expected, f"layer {layer} head {head}"
