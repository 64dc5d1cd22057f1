"""runner::llama_step (compiled.native_step): the compiled engine's one-column step in C++ against the same static
step run eagerly through the model (CompiledEngine(compile=False)), step by step on the same tokens, for llama and
qwen2, float32 and bfloat16, GGUF weights, several rows with left padding; where it does not serve, the compiled
graph does. Nothing here compiles a graph (the native engine's prefill is eager, its steps are C++)."""

import pytest
import torch

from runner.infer.compiled import engine as compiled
from runner.infer.compiled import native_step
from runner.infer.compiled.engine import CompiledEngine
from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.sampling import greedy_tokens
from runner.infer.generation.generator import Generator
from runner.infer.loading.models import load_model
from runner.infer.quant.gguf_weights import keep_gguf_formats
from tests.conftest import TINY_LLAMA
from tests.infer.quant.test_gguf_weights import _written

TINY_QWEN2 = {**TINY_LLAMA, "model_type": "qwen2"}  # biases on q, k, v
PROMPTS = ["hello world, this is", "a", "The quick brown fox"]  # batch 3: bucket 4, one dummy row

pytestmark = pytest.mark.skipif(native_step.refusal(load_model(config=TINY_LLAMA, device="cpu").model) is not None,
                                reason="runner's kernels are not built here (no compiler): no native step")


def _lockstep(model, tokenizer, prompts: list[str], kind: str, steps: int = 12) -> list[tuple[torch.Tensor, ...]]:
    """(native logits, eager static logits) [b,1,V] of each step, both states fed the eager one's greedy tokens."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    native, reference = CompiledEngine(model), CompiledEngine(model, compile=False)
    assert native.native is not None
    states = [engine.state(kind, ids.shape[0], ids.shape[1] + steps, 2048) for engine in (native, reference)]
    pairs, live = [], torch.ones(ids.shape[0], dtype=torch.long)
    with torch.inference_mode():
        token = greedy_tokens(states[1].prefill(model, ids, mask)[0])
        states[0].prefill(model, ids, mask)
        for _ in range(steps):
            pair = tuple(state.feed(model, token, live).float() for state in states)
            pairs.append(pair)
            token = greedy_tokens(pair[1])
    assert native.stats.compiles == 0 and not native.steps  # no graph was made: every step ran in C++
    return pairs


def _worst(pairs) -> float:
    """The largest |native − eager| over every step, as a fraction of the largest |logit|."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["fp32", "fp16"])
def test_float32_steps_equal_the_eager_static_step_to_float_rounding(config, kind):
    """Float32: the same arithmetic in another order of sums, so within 1e-5 of the largest logit with fp32 K/V.
    With fp16 K/V a last-bit difference in float32 can round a stored element to its neighbouring fp16 value (2⁻¹¹
    of it), so 1e-4 there (1.03e-5 seen on a Zen 4 EPYC, where the Xeons gave less than 1e-5)."""
    lm = load_model(config=config, device="cpu", seed=0)
    assert _worst(_lockstep(lm.model, lm.tokenizer, PROMPTS, kind)) <= (1e-5 if kind == "fp32" else 1e-4)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_bfloat16_steps_equal_the_eager_static_step_to_bfloat16_rounding(kind):
    """bfloat16: elementwise work in float32 rounded where the model stores bfloat16 (inductor's
    emulate_precision_casts, not eager PyTorch's op-by-op rounding), so a few bfloat16 ulps (2⁻⁸) of the largest
    logit; fp16 K/V are read as stored, where the eager step rounds them to bfloat16 first."""
    lm = load_model(config=TINY_QWEN2, device="cpu", seed=0, dtype="bfloat16")
    assert _worst(_lockstep(lm.model, lm.tokenizer, PROMPTS, kind)) <= 4 * 2**-8


def test_sixteen_bfloat16_rows_run_natively_exactly_where_the_amx_path_takes_every_product():
    """16 rows (9 prompts: bucket 16) of a bfloat16 model whose shapes are whole AMX tiles: on a CPU whose AMX
    path linear_rows runs, the native step serves them, to bfloat16 rounding of the eager step; elsewhere it takes
    4 rows and leaves them to the compiled graph."""
    lm = load_model(config={**TINY_QWEN2, "vocab_size": 288}, device="cpu", seed=0, dtype="bfloat16")  # 9 tiles
    step = native_step.NativeStep(lm.model)
    if not torch.ops.runner.linear_rows_amx(64, 64):
        assert step.max_rows == 4
        assert not step.serves(CompiledEngine(lm.model, compile=False)._cache(("bf16", 16, 256, "")), 1)
        return
    assert step.max_rows == 16
    assert _worst(_lockstep(lm.model, lm.tokenizer, [*PROMPTS * 3][:9], "bf16")) <= 4 * 2**-8


def test_gguf_weights_take_the_same_block_products(tmp_path):
    """GGUF products quantize each row of x to 8 bits per block (Q4_1 here): inputs that differ by float
    rounding can round an activation to the next level, so the bound is that of one level, not of float32."""
    model, path = _written(tmp_path, "Q4_1")
    keep_gguf_formats(model, path)
    assert all(native_step._code(layer.mlp.up_proj) >= 0 for layer in model.model.layers)
    tokenizer = load_model(config=TINY_LLAMA, device="cpu").tokenizer
    assert _worst(_lockstep(model, tokenizer, PROMPTS, "fp16")) <= 2e-2


def test_the_generator_on_native_steps_gives_the_eager_engines_greedy_tokens(tiny_lm, monkeypatch):
    enc = tiny_lm.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    monkeypatch.setitem(compiled.ENGINES_BY_MODEL, tiny_lm.model, CompiledEngine(tiny_lm.model))
    out = {}
    for engine in ("eager", "compiled"):
        gen = Generator(tiny_lm.model, GenerateConfig(engine=engine, cache_kind="fp16", max_new_tokens=20,
                                                      temperature=0), tokenizer=tiny_lm.tokenizer)
        out[engine] = gen.generate(enc.input_ids, enc.attention_mask)
    assert torch.equal(out["compiled"], out["eager"])
    assert not compiled.ENGINES_BY_MODEL[tiny_lm.model].steps  # no graph: the steps were native


def test_what_it_does_not_serve_stays_with_the_compiled_graph(tiny_lm):
    engine = CompiledEngine(tiny_lm.model, compile=False)
    assert engine.native is None  # compile=False runs the graph's own code, never the native step
    step = native_step.NativeStep(tiny_lm.model)
    assert step.serves(engine._cache(("fp16", 8, 256, "")), 1)
    assert not step.serves(engine._cache(("fp16", 8, 256, "")), 2)  # several columns
    assert not step.serves(engine._cache(("fp16", 16, 256, "")), 1)  # more rows than linear_rows takes
    assert not step.serves(engine._cache(("q8_0", 1, 256, "")), 1)  # a quantized layout
    gpt2 = load_model(config={"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}, device="cpu")
    assert "gpt2 is not one of llama, qwen2" in native_step.refusal(gpt2.model)
    int8 = load_model(config=TINY_LLAMA, device="cpu", quantization="int8")
    assert "float Linear or GGUF only" in native_step.refusal(int8.model)


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bfloat16", 4 * 2**-8)])
def test_extra_tokens_in_a_step_give_each_prompt_its_own_forwards_logits_and_leave_the_rows_step_as_it_was(dtype,
                                                                                                            bound):
    """A mixed step (NativeStep's `extra`): two prompts written into rows 0 and 2 at columns [c + 1 − m, c + 1)
    (their last tokens the rows' own at c, the rest extra tokens, more rows than linear_rows takes: aten's products)
    while row 1 decodes: the prompts' logits are their plain forwards' last, row 1's those of the same step
    without extra tokens. Bounds as above for the dtype, of the largest |logit|."""
    lm = load_model(config=TINY_QWEN2, device="cpu", seed=0, dtype=dtype)
    model, engine = lm.model, CompiledEngine(lm.model)
    native, g = engine.native, torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (m,), generator=g) for m in (11, 6)]
    c = 12
    cache = engine._cache((None, 4, 64, ""))
    mask = torch.zeros(4, 64, dtype=torch.long)
    mask[1, 2:c] = 1  # row 1 holds 10 columns already: what the step without extra tokens gives it is the reference
    ids, positions = torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long)
    ids[1, 0], positions[1, 0] = 7, 10
    with torch.inference_mode():
        alone = native(cache, ids, positions, torch.tensor([c]), mask)  # [4,1,V]
        places, extra_ids, extra_positions = [], [], []
        for row, prompt in zip((0, 2), prompts):
            m = len(prompt)
            mask[row, c + 1 - m:c + 1] = 1
            ids[row, 0], positions[row, 0] = prompt[-1], m - 1
            places += [(row, c + 1 - m + j) for j in range(m - 1)]
            extra_ids.append(prompt[:-1])
            extra_positions.append(torch.arange(m - 1))
        extra = native_step.Extra(torch.cat(extra_ids), torch.cat(extra_positions), torch.tensor(places))
        assert len(places) > native.max_rows
        mixed = native(cache, ids, positions, torch.tensor([c]), mask, extra).float()
        for row, prompt in zip((0, 2), prompts):
            reference = model(prompt[None]).logits[0, -1].float()
            assert ((mixed[row, 0] - reference).abs().max() / reference.abs().max()).item() <= bound
    assert ((mixed[1] - alone[1].float()).abs().max() / alone[1].float().abs().max()).item() <= bound
