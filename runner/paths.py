"""Files a manifest names must exist before anything runs: found at `run check`, not an hour into a run.

Relative paths resolve against the manifest's folder, and errors show both the path as written and
where it was looked for. Only what is plainly a path is checked: a model id that starts with `.`, `/`
or `~` or ends in `.gguf` (a bare `owner/name` is a hub id), a prompts file, and an eval text that is
not a builtin name or `hf:`.
"""

from __future__ import annotations

from pathlib import Path

from runner.infer.data import BUILTIN_TEXTS  # torch-free, like everything `run check` imports
from runner.manifest import Manifest


def missing_paths(manifest: Manifest, base_dir: Path) -> list[tuple[tuple, str]]:
    """(key path, message) for every named file or folder that is not there."""
    problems = []
    for t, target in enumerate(manifest.targets):
        _model(problems, ("targets", t, "model", "id"), target.model.id, base_dir)
        for r, run in enumerate(target.runs):
            loc = ("targets", t, "runs", r)
            for block_name in ("generate", "speculative", "bench"):
                block = getattr(run, block_name, None)
                if block is None:
                    continue
                where = loc + (block_name,)
                if getattr(block, "prompts_file", None):
                    _file(problems, where + ("prompts_file",), block.prompts_file, base_dir, "prompts file")
                for key in ("cache_quality_data", "data"):
                    source = getattr(block, key, None)
                    if source and source not in BUILTIN_TEXTS and not source.startswith("hf:"):
                        _file(problems, where + (key,), source, base_dir, "text file")
                draft = getattr(block, "draft", None) or getattr(getattr(block, "speculative", None), "draft", None)
                if draft is not None and not isinstance(draft, str):
                    suffix = ("draft", "id") if block_name == "speculative" else ("speculative", "draft", "id")
                    _model(problems, where + suffix, draft.id, base_dir)
    return problems


def _model(problems: list, loc: tuple, model_id: str | None, base_dir: Path) -> None:
    if model_id and (model_id[0] in "./~" or model_id.endswith(".gguf")):
        path = _resolve(model_id, base_dir)
        if not path.exists():
            problems.append((loc, f"model path {model_id!r} does not exist (looked for {path})"))


def _file(problems: list, loc: tuple, name: str, base_dir: Path, what: str) -> None:
    path = _resolve(name, base_dir)
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        problems.append((loc, f"{what} {name!r} {state} (looked for {path})"))


def _resolve(name: str, base_dir: Path) -> Path:
    path = Path(name).expanduser()
    return (path if path.is_absolute() else base_dir / path).resolve()
