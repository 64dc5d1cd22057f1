"""Peers' packages installed beside runner, never into its venv: kvpress, NVIDIA's KV-eviction library, the
reference that runner's own eviction is compared with (benchmarks/kvpress_reference.py).

kvpress 0.5.5 requires transformers<5.3 while runner runs 5.24, so kvpress gets its own site folder, made once under
runner's cache (`cache_dir()/peers/kvpress-0.5.5/`) with `pip install --target --no-deps` of exact, sha256-checked
wheels, and runs in a subprocess of runner's own python with that folder first on PYTHONPATH: its transformers (and
the hub client and tokenizers that transformers checks at import) shadow ours; torch, numpy, safetensors and the rest
come from runner's venv. kvpress's other requirements are not installed: `datasets`, `fire` and `peft` are used only
by presses we do not run (DuoAttention, the expected-attention statistics script, RestoreKV) and by its pipeline's
evaluation; `import kvpress` would import them all, so the worker imports the press modules it needs without
running the package's `__init__` (see `import_kvpress_presses` in the benchmark). accelerate, cachetools, requests
and pandas come from runner's venv.

The sequence is pinned.py's: download → verify every wheel's sha256 → install into a temporary folder beside the
cache → write the marker → `publish_folder` (complete or absent). ~15 MB of wheels; about 20 s on this project's
machines. Does not import torch or transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from runner.errors import CacheError, ModelError
from runner.files import cache_dir, cache_folder, cache_problem
from runner.infer.loading.pinned import pip_download, publish_folder, sha256_file

log = logging.getLogger(__name__)

KVPRESS_VERSION = "0.5.5"
MARKER = "runner-peer.json"
# wheel file name -> sha256. transformers 5.2.0 is the newest release kvpress 0.5.5 accepts (<5.3); it checks at
# import that huggingface-hub is <2.0 and tokenizers <=0.23.0, which runner's venv has newer, so those two are pinned
# too (and httpx + httpcore, which huggingface-hub 1.x needs and runner's venv lacks). The tokenizers wheel is the
# Linux x86-64 one: elsewhere the download's sha256 differs and `kvpress_site` says so.
KVPRESS_WHEELS: dict[str, str] = {
    "kvpress-0.5.5-py3-none-any.whl": "900bdb175b546f19c844a8d40e9e7bc6bff7f302689821263d376e31ff62f07e",
    "transformers-5.2.0-py3-none-any.whl": "9ecaf243dc45bee11a7d93f8caf03746accc0cb069181bbf4ad8566c53e854b4",
    "huggingface_hub-1.33.0-py3-none-any.whl": "04e434b06e100eddbce9a6e817d72693a7884b10a79bd67ab48080d5c07eb899",
    "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl":
        "369cc9fc8cc10cb24143873a0d95438bb8ee257bb80c71989e3ee290e8d72c67",
    "httpx-0.28.1-py3-none-any.whl": "d909fcccc110f8c7faf814ca82a9a4d816bc5a6dbfea25d6591d6985b8ba59ad",
    "httpcore-1.0.9-py3-none-any.whl": "2d400746a40668fc9dec9810239072b40b4484b640a8c38fd654a024c7a1bf55",
}
KVPRESS_PINS = ("kvpress==0.5.5", "transformers==5.2.0", "huggingface-hub==1.33.0", "tokenizers==0.22.2",
                "httpx==0.28.1", "httpcore==1.0.9")


def kvpress_site_dir() -> Path:
    """Where the kvpress site folder lives (it may not exist yet)."""
    return cache_dir() / "peers" / f"kvpress-{KVPRESS_VERSION}"


def kvpress_site_ready() -> bool:
    """Whether the site folder is made and its marker names these pins (using it downloads nothing)."""
    try:
        doc = json.loads((kvpress_site_dir() / MARKER).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("wheels") == KVPRESS_WHEELS


def kvpress_site() -> Path:
    """The site folder holding kvpress and the transformers it accepts, made once (download, verify, install,
    publish); ModelError when PyPI cannot be reached or a wheel does not match its pin, CacheError when the cache
    cannot hold it."""
    target = kvpress_site_dir()
    if kvpress_site_ready():
        return target
    if target.exists():  # a folder for other pins, or without its marker: never used as is
        log.warning("%s is not a finished kvpress %s site: making it again", target, KVPRESS_VERSION)
        shutil.rmtree(target, ignore_errors=True)
    peers = cache_folder("peers")
    tmp = Path(tempfile.mkdtemp(dir=peers, prefix=".installing-"))
    try:
        _build(tmp)
        publish_folder(tmp / "site", target, MARKER)  # a concurrent install that won the race is fine
    except OSError as exc:
        raise CacheError(cache_problem(target, exc, folder=True)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(tmp: Path) -> None:
    """Download and verify the wheels into tmp/wheels, install them into tmp/site and write its marker."""
    wheels, site = tmp / "wheels", tmp / "site"
    pip_download(KVPRESS_PINS, wheels, ModelError, f"kvpress {KVPRESS_VERSION} and the transformers it accepts")
    found = {p.name: p for p in wheels.iterdir()}
    if set(found) != set(KVPRESS_WHEELS):
        raise ModelError(f"kvpress site: pip fetched {sorted(found)}, expected {sorted(KVPRESS_WHEELS)} (a platform "
                         "without the pinned Linux x86-64 tokenizers wheel?); nothing was installed")
    for name, want in KVPRESS_WHEELS.items():
        got = sha256_file(found[name])
        if got != want:
            raise ModelError(f"kvpress site: {name} does not match its pin (sha256 {got} vs {want}); "
                             "nothing was installed")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
           "--target", str(site), *(str(found[name]) for name in KVPRESS_WHEELS)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelError(f"could not install the kvpress site: pip said:\n{done.stderr.strip()[-2000:]}")
    site.chmod(0o755)
    (site / MARKER).write_text(json.dumps({"pins": list(KVPRESS_PINS), "wheels": KVPRESS_WHEELS}, indent=2))


def kvpress_env(site: Path) -> dict[str, str]:
    """The environment for a subprocess that runs kvpress: the site first on PYTHONPATH, hub access off."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return env
