"""model.quantization: gguf (quant.gguf_weights over quant.gguf_tensors): a GGUF file's tensors kept as stored, on
tiny llama models written as GGUF by runner's writer (the gguf package quantizes their matrices), the float
reference being the same file de-quantized by transformers. The zoo's real files are in the slow tests."""

import math

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from runner.errors import ModelError
from runner.infer.kernels import gguf_rows
from runner.infer.llamacpp.gguf_file import gguf_weight_bytes, write_gguf
from runner.infer.loading.models import load_model
from runner.infer.quant import gguf_weights
from runner.infer.quant.gguf_tensors import gguf_tensors, tensor_blocks
from runner.infer.quant.gguf_weights import GGUFEmbedding, GGUFLinear, keep_gguf_formats
from runner.infer.quant.weights import weight_bytes
from tests.conftest import LLAMA_32, tiny_qwen2

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0"]  # what the gguf package writes; K-quants: the slow tests' Qwen file


def _written(tmp_path, weight_type: str, tied: bool = True, seed: int = 0, model_type: str = "llama"):
    """A tiny llama (or qwen2, its biases random) written as GGUF in `weight_type`, and the model holding that
    file's de-quantized weights."""
    lm = (tiny_qwen2(seed, tie_word_embeddings=tied) if model_type == "qwen2"
          else load_model(config={**LLAMA_32, "tie_word_embeddings": tied}, device="cpu", seed=seed))
    path = tmp_path / f"tiny-{model_type}-{weight_type}-{tied}-{seed}.gguf"
    write_gguf(lm.model, lm.tokenizer, path, weight_type)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=lm.model)["tensors"]
    lm.model.load_state_dict(tensors, strict=False)  # a tied head has no tensor of its own
    return lm.model, path


def test_the_tensor_table_is_the_gguf_packages(tmp_path):
    _, path = _written(tmp_path, "Q4_1", tied=False)
    ours = gguf_tensors(path)
    theirs = gguf.GGUFReader(path).tensors
    assert list(ours) == [t.name for t in theirs]
    for tensor in theirs:
        mine = ours[tensor.name]
        assert (mine.ggml_type, mine.n_bytes, mine.offset) == (int(tensor.tensor_type), int(tensor.n_bytes),
                                                               int(tensor.data_offset))
        assert mine.shape == tuple(reversed([int(d) for d in tensor.shape]))
        assert np.array_equal(tensor_blocks(path, mine).reshape(-1), np.asarray(tensor.data).view(np.uint8).ravel())


@pytest.mark.parametrize("weight_type", ["BF16", *TYPES])
def test_the_writer_stores_matrices_in_the_type_asked_and_norms_in_f32(tmp_path, weight_type):
    lm = load_model(config=LLAMA_32, device="cpu", seed=0)
    write_gguf(lm.model, lm.tokenizer, tmp_path / "m.gguf", weight_type)
    types = {t.name: t.type_name for t in gguf_tensors(tmp_path / "m.gguf").values()}
    assert types["blk.0.ffn_up.weight"] == types["token_embd.weight"] == weight_type
    assert types["blk.0.attn_norm.weight"] == "F32"
    with pytest.raises(ModelError, match="cannot write GGUF weights as Q4_K"):
        write_gguf(lm.model, lm.tokenizer, tmp_path / "k.gguf", "Q4_K")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ModelError, match="not a GGUF v2/v3 file"):
        gguf_tensors(path)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
@pytest.mark.parametrize("weight_type", TYPES)
def test_kept_tensors_are_the_files_bytes_and_give_the_float_models_logits(tmp_path, weight_type, tied):
    """Every matrix swapped, its measured bytes the file's, and the logits those of the de-quantized model within
    what 8-bit activations can move them (llama.cpp's arithmetic: each activation block rounded to 1/254 of its
    largest value): 2 % of the largest logit, and the same top token at every position."""
    model, path = _written(tmp_path, weight_type, tied)
    ids = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 250]])
    with torch.no_grad():
        want = model(ids).logits
        kept = keep_gguf_formats(model, path)
        got = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [] and isinstance(model.get_input_embeddings(), GGUFEmbedding)
    assert kept == {weight_type: 2 * 7 + 1 + (0 if tied else 1)}  # 7 matrices a layer, the embedding, a head
    head = model.get_output_embeddings()
    assert isinstance(head, GGUFLinear) and (head.weight is model.get_input_embeddings().weight) == tied
    for module in model.modules():  # the kernels' 8-row layout wherever they have one, a tied head's blocks too
        if isinstance(module, (GGUFLinear, GGUFEmbedding)):
            assert module.interleaved == gguf_rows.interleavable(module.ggml_type, module.weight.shape[0])
    interleaved = gguf_rows.GGML_TYPES[weight_type] in gguf_rows.INTERLEAVED_TYPES
    assert any(m.interleaved for m in model.modules() if isinstance(m, GGUFLinear)) == interleaved
    assert weight_bytes(model) == gguf_weight_bytes(path)  # the norms are f32 in both
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q5_0"])
def test_a_written_qwen2_keeps_its_blocks_and_biases_and_gives_the_float_models_logits(tmp_path, weight_type):
    model, path = _written(tmp_path, weight_type, model_type="qwen2")
    ids = torch.tensor([[1, 5, 9, 200, 17, 3, 44, 250]])
    bias = model.model.layers[1].self_attn.v_proj.bias.detach().clone()
    with torch.no_grad():
        want = model(ids).logits
        assert keep_gguf_formats(model, path) == {weight_type: 2 * 7 + 1}
        got = model(ids).logits
    v = model.model.layers[1].self_attn.v_proj
    assert isinstance(v, GGUFLinear) and torch.equal(v.bias, bias) and bias.abs().sum() > 0
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_rows_of_q_and_k_follow_the_models_rotary_order(tmp_path):
    """llama.cpp stores q and k rows permuted (rotary pairs interleaved); the kept rows are in the model's order,
    checked here on the whole tensor, not only the rows keep_gguf_formats samples."""
    model, path = _written(tmp_path, "Q8_0")
    q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    keep_gguf_formats(model, path)
    blocks = model.model.layers[0].self_attn.q_proj.weight
    rows = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(torch.from_numpy(rows), q)


def test_a_file_the_model_was_not_loaded_from_is_an_error(tmp_path):
    model, _ = _written(tmp_path, "Q8_0", seed=0)
    _, other = _written(tmp_path, "Q8_0", seed=1)
    with pytest.raises(ModelError, match="do not give the model's weights"):
        keep_gguf_formats(model, other)


def test_an_all_float_file_keeps_nothing_and_says_so(tmp_path):
    model, path = _written(tmp_path, "F32")
    with pytest.raises(ModelError, match="no tensor in a format runner's kernels read"):
        keep_gguf_formats(model, path)


def test_the_swapped_modules_compute_in_float32_and_answer_in_the_inputs_dtype(tmp_path):
    model, path = _written(tmp_path, "Q4_0")
    keep_gguf_formats(model, path)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, 3, layer.in_features, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, layer.out_features)
    assert torch.allclose(y.float(), layer(x.float()), rtol=2**-7, atol=1e-3 * math.sqrt(layer.in_features))


@pytest.mark.parametrize("source", [None, "HuggingFaceTB/SmolLM2-135M"], ids=["config", "hub-id"])
def test_gguf_needs_a_gguf_source(source):
    with pytest.raises(ModelError, match="model.id must be a zoo: name or a .gguf file"):
        load_model(source, config=None if source else LLAMA_32, device="cpu", quantization="gguf")


@pytest.mark.compile
def test_the_compiled_engine_gives_the_eager_greedy_tokens_on_kept_blocks(tmp_path):
    """Both engines call the same block kernels, so the tokens are the same; the step is one graph (the ops are
    traced, not a break), for a Linear's product and the embedding's lookup alike. About a minute to compile. The
    graph is what is tested (the native C++ step off; its own test: tests/infer/compiled/test_native_step.py)."""
    from runner.infer.compiled import engine as compiled
    from runner.infer.config.decoding import GenerateConfig
    from runner.infer.generation.generator import Generator

    model, path = _written(tmp_path, "Q4_1", tied=False)
    keep_gguf_formats(model, path)
    compiled.ENGINES_BY_MODEL[model] = compiled.CompiledEngine(model, native=False)
    breaks = torch._dynamo.utils.counters["graph_break"].copy()
    ids = torch.tensor([[1, 5, 9, 200, 17], [3, 44, 250, 7, 8]])
    tokens = {engine: Generator(model, GenerateConfig(engine=engine, max_new_tokens=16, temperature=0)).generate(
        ids, torch.ones_like(ids)) for engine in ("eager", "compiled")}
    assert torch.equal(tokens["compiled"], tokens["eager"])
    assert compiled.engine_for(model).stats.recompiles == 0
    assert torch._dynamo.utils.counters["graph_break"] == breaks


@pytest.mark.skipif(not gguf_rows.load(), reason="interleaving is runner's C++ kernels' (not built here: no compiler)")
@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1"])
def test_an_interleaved_embedding_gives_the_rows_of_the_plain_one(weight_type):
    """An embedding whose blocks a tied head reads 8 rows at a time gathers each id's row from its span: the same
    floats as the embedding over the file's plain rows, for ids in every position of a span."""
    number = gguf_rows.GGML_TYPES[weight_type]
    weights = np.random.default_rng(3).standard_normal((24, 64)).astype(np.float32)
    plain = torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[weight_type]))
    spans = torch.ops.runner.gguf_interleave(plain, number)
    assert not torch.equal(spans, plain)
    ids = torch.tensor([[0, 7, 8, 13], [23, 16, 5, 5]])
    want = GGUFEmbedding(torch.nn.Parameter(plain, requires_grad=False), number, 64, torch.float32)(ids)
    got = GGUFEmbedding(torch.nn.Parameter(spans, requires_grad=False), number, 64, torch.float32,
                        interleaved=True)(ids)
    assert torch.equal(got, want) and torch.equal(want[0, 0], torch.ops.runner.gguf_dequantize(plain[:1], number)[0])


@pytest.mark.skipif(not gguf_rows.load(), reason="runner's C++ kernels are not built here (no compiler)")
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q5_0"])
def test_a_prompts_rows_multiply_the_dequantized_weight_and_a_steps_rows_use_the_kernel(weight_type):
    """From DEQUANTIZE_ROWS rows of x on, a plain tensor is de-quantized once and multiplied in float (exactly
    x @ Wᵀ on the de-quantized weight); fewer rows go through gguf_rows, whose x is quantized (close, not equal)."""
    number = gguf_rows.GGML_TYPES[weight_type]
    weights = np.random.default_rng(4).standard_normal((48, 64)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[weight_type]))
    layer = GGUFLinear(torch.nn.Parameter(blocks, requires_grad=False), number, 64)
    dense = torch.ops.runner.gguf_dequantize(blocks, number)  # [48,64]
    x = torch.randn(gguf_weights.DEQUANTIZE_ROWS, 64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(layer(x), x @ dense.t())
    few = x[:gguf_weights.DEQUANTIZE_ROWS - 1]
    assert torch.equal(layer(few), torch.ops.runner.gguf_rows(few, blocks, number, 0, False))
    assert not torch.equal(layer(few), few @ dense.t())


# --- the zoo's files (slow: downloads once) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_kept():
    return load_model("zoo:smollm2-135m", device="cpu", quantization="gguf")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zoo:smollm2-135m", "zoo:qwen2.5-coder-0.5b"])
def test_a_zoo_models_kept_weights_are_its_files_bytes(name):
    """SmolLM2: Q4_1 matrices, a Q8_0 embedding read by a tied head; Qwen2.5-Coder: Q5_0, Q8_0, Q4_K and Q6_K, and
    an output head of its own."""
    from runner.infer.loading.zoo import fetch_gguf, zoo_entry

    lm = load_model(name, device="cpu", quantization="gguf")
    path = fetch_gguf(zoo_entry(name))
    assert lm.fingerprint["quantization"] == "gguf"
    assert lm.fingerprint["weight_bytes"] == weight_bytes(lm.model) == gguf_weight_bytes(path)
    assert not [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.slow
def test_smollm2_kept_at_4_bits_predicts_as_its_dequantized_model(smollm2_kept):
    """The same weights, only llama.cpp's 8-bit activations between them. On the evaluation text (8 windows × 8
    scored steps, a 256-token perplexity window) this measured ΔNLL −0.019 nats, perplexity ratio 0.995, mean KL
    0.003 and top-1 agreement 1.0; bounds: |ΔNLL| ≤ 0.03 (64 scored tokens are noisy), perplexity within 2 %,
    KL ≤ 0.005, agreement ≥ 0.95."""
    from runner.infer.loading.texts import load_text
    from runner.infer.measure.quality import build_probe, compare, run_probe

    reference = load_model("zoo:smollm2-135m", device="cpu")
    probe = build_probe(reference.tokenizer, load_text("pydoc"), 64, 8, 8, 256, torch.device("cpu"))
    metrics = compare(run_probe(reference.model, probe, None), run_probe(smollm2_kept.model, probe, None))
    assert abs(metrics["delta_nll"]) <= 0.03 and abs(metrics["ppl_ratio"] - 1) <= 0.02 and metrics["mean_kl"] <= 0.005
    assert metrics["top1_agreement"] >= 0.95


@pytest.mark.slow
def test_smollm2_written_in_q8_0_gives_its_dequantized_models_greedy_tokens(tmp_path):
    """Q8_0 weights with 16-bit activations: the same greedy tokens as the de-quantized float32 model, 48 new tokens
    from each of four prompts of the evaluation text."""
    import copy

    from runner.infer.config.decoding import GenerateConfig
    from runner.infer.generation.generator import Generator
    from runner.infer.loading.texts import load_text, token_windows

    lm = load_model("zoo:smollm2-135m", device="cpu")
    path = tmp_path / "smollm2-q8_0.gguf"
    write_gguf(lm.model, lm.tokenizer, path, "Q8_0")
    lm.model.load_state_dict(load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=lm.model)["tensors"],
                             strict=False)
    kept = copy.deepcopy(lm.model)
    keep_gguf_formats(kept, path)
    ids = torch.tensor(token_windows(lm.tokenizer, load_text("pydoc"), 32, 4))
    config = GenerateConfig(max_new_tokens=48, temperature=0, eos_token_id=None)
    want, got = (Generator(m, config).generate(ids, torch.ones_like(ids)) for m in (lm.model, kept))
    assert torch.equal(got, want)
