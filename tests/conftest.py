"""Shared fixtures: tiny random models built in-process, no network ever."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # make test: -n auto. Each worker, and each `run` it starts, gets its
    # share of the cores: torch's threads from several workers on the same cores wait on each other (set before torch)
    share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))

import pytest  # noqa: E402

from runner import report  # noqa: E402

NEEDS_LLAMACPP = "needs llama-cpp-python (engine: llama.cpp): make setup-llamacpp installs it"
LLAMA_32 = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # head size 32: llama.cpp's block K/V types divide it
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped, saying why, where this machine has no CUDA device."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
            for item in gpu:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _console():
    """The library's messages shown as the CLI shows them (status and warnings on stderr, results on stdout)."""
    report.configure(0)


@pytest.fixture(scope="module")
def one_thread():
    """Batch-1 forwards of a tiny model: extra intra-op threads only contend (20× slower on a busy 2-core box)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def draft_lm():
    """A second tiny model with other random weights: a draft unrelated to tiny_lm."""
    from runner.infer.loading.models import load_model

    return load_model(config=TINY_LLAMA, device="cpu", seed=1)


@pytest.fixture(scope="session")
def tiny_lm():
    from runner.infer.loading.models import load_model

    return load_model(config=TINY_LLAMA, device="cpu", seed=0)


@pytest.fixture(scope="session")
def smollm():
    from runner.infer.loading.models import load_model

    return load_model("zoo:smollm2-135m", device="cpu")


def tiny_qwen2(seed: int = 0, **config):
    """A tiny random qwen2 (LLAMA_32's sizes; `config` on top) whose q, k, v biases are random too: transformers
    starts them at zero, which would hide a bias written or read wrong."""
    import torch

    from runner.infer.loading.models import load_model

    lm = load_model(config={**LLAMA_32, "model_type": "qwen2", **config}, device="cpu", seed=seed)
    with torch.no_grad():
        for name, parameter in lm.model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return lm


def tiny_manifest(tmp_path, runs_yaml: str, extra: str = "") -> "os.PathLike":
    """Write a manifest on the tiny llama with MLflow and run folders under tmp_path."""
    path = tmp_path / "m.yaml"
    path.write_text(f"""name: t
seed: 0
tracking: {{mlflow: true, runs_dir: {tmp_path / 'runs'}}}
{extra}
targets:
  - name: tiny
    model:
      config: {TINY_LLAMA}
      device: cpu
    runs:
{runs_yaml}""")
    return path
