"""The torch weights written as an f32 GGUF (llama, qwen2): read back with the gguf package, every tensor is ours (a
llama's q and k in llama.cpp's interleaved rotary order, qwen2's as they are, with its biases), the vocabulary is the
tokenizer's, and the file is cached by content."""

import numpy as np
import pytest
import torch

from runner.errors import ModelError
from runner.infer.llamacpp.gguf_file import _permute, gguf_weight_bytes, model_gguf, unsupported, written_gguf
from tests.conftest import tiny_qwen2


def test_permute_pairs_each_rotary_half_with_its_partner():
    weight = torch.arange(8.0)[:, None]  # one head of 8 rows: halves [0..3] and [4..7]
    assert _permute(weight, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_written_gguf_holds_the_models_weights_and_vocabulary(tiny_lm, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    path = written_gguf(tiny_lm.model, tiny_lm.tokenizer)
    assert path.parent == tmp_path / "gguf-f32"
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = tiny_lm.model.config
    assert len(tensors) == 2 + 9 * cfg.num_hidden_layers + (0 if cfg.tie_word_embeddings else 1)
    sd = tiny_lm.model.state_dict()
    v = np.asarray(tensors["blk.1.attn_v.weight"].data).reshape(sd["model.layers.1.self_attn.v_proj.weight"].shape)
    assert np.array_equal(v, sd["model.layers.1.self_attn.v_proj.weight"].numpy())
    q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(sd["model.layers.0.self_attn.q_proj.weight"].shape)
    assert np.array_equal(q, _permute(sd["model.layers.0.self_attn.q_proj.weight"], cfg.num_attention_heads).numpy())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg.vocab_size
    assert gguf_weight_bytes(path) == sum(int(t.n_elements) * 4 for t in reader.tensors)  # f32: 4 bytes a value
    assert written_gguf(tiny_lm.model, tiny_lm.tokenizer) == path  # cached: the same file, not rewritten
    assert model_gguf(None, tiny_lm.model, tiny_lm.tokenizer) == path


def test_what_the_writer_cannot_write_is_refused(tmp_path):
    from transformers import AutoConfig

    assert "llama and qwen2 only" in unsupported(AutoConfig.for_model("gpt2"))
    assert "sliding window" in unsupported(AutoConfig.for_model("qwen2", use_sliding_window=True))
    assert unsupported(AutoConfig.for_model("qwen2")) is None
    with pytest.raises(ModelError, match="no GGUF file"):
        model_gguf(str(tmp_path / "absent.gguf"), None, None)


def test_a_vocabulary_source_gives_the_written_file_its_tokenizer_settings(tiny_lm, tmp_path, monkeypatch):
    """llama.cpp's own tools tokenize text by the file's pre-tokenizer and token types: a file written with
    `vocab_from` carries the source GGUF's (the zoo's "smollm", its control tokens), and is cached apart."""
    import gguf

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    cfg = tiny_lm.model.config
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (cfg.vocab_size - 3)
    source = tmp_path / "source.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_types(types)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    plain, copied = written_gguf(tiny_lm.model, tiny_lm.tokenizer), written_gguf(
        tiny_lm.model, tiny_lm.tokenizer, vocab_from=source)
    assert plain != copied
    fields = gguf.GGUFReader(copied).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["tokenizer.ggml.token_type"].contents() == [int(t) for t in types]
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert gguf.GGUFReader(plain).fields["tokenizer.ggml.pre"].contents() == "default"


def test_a_qwen2_is_written_with_its_biases_and_its_rows_in_their_own_order(tmp_path, monkeypatch):
    """qwen2's rotary embedding is llama.cpp's NEOX kind (halves, as HF's): q and k are written unpermuted, and its
    q, k, v biases go beside them in f32."""
    import gguf

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    lm = tiny_qwen2()
    reader = gguf.GGUFReader(written_gguf(lm.model, lm.tokenizer))
    tensors, sd = {t.name: t for t in reader.tensors}, lm.model.state_dict()
    assert reader.fields["general.architecture"].contents() == "qwen2"
    cfg = lm.model.config  # 9 matrices and norms, 3 biases a layer; a head of its own
    assert len(tensors) == 2 + 12 * cfg.num_hidden_layers + (0 if cfg.tie_word_embeddings else 1)
    for x in "qk":
        ours = sd[f"model.layers.1.self_attn.{x}_proj.weight"]
        assert np.array_equal(np.asarray(tensors[f"blk.1.attn_{x}.weight"].data).reshape(ours.shape), ours.numpy())
    bias = sd["model.layers.0.self_attn.k_proj.bias"]
    assert bias.abs().sum() > 0 and np.array_equal(np.asarray(tensors["blk.0.attn_k.bias"].data), bias.numpy())
