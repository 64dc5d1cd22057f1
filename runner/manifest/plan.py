"""Manifest → StepPlan: an ordered, frozen, printable list of steps, each with a content hash.

No torch. The hash covers everything that decides a step's output: the model block, the mode's block,
the seeds, every input file the step reads (as runner.manifest.paths resolves and fingerprints them: the content
of prompts and evaluation text files, a local model's file names, sizes and times), the code (a hash of
runner's source) and the environment (Python, torch, transformers versions, OS and machine), so equal
hashes mean the step would compute the same thing, and `--resume` may skip a finished step by its hash.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from runner import __version__
from runner.files import package_version
from runner.manifest.paths import input_digests
from runner.manifest.schema import BLOCKS, Manifest


@dataclass(frozen=True)
class Step:
    index: int
    target: str
    run_id: str
    mode: str
    model: dict  # the ModelBlock as a plain dict
    block: dict  # the mode's block (e.g. generate) as a plain dict; "spec" in plan.json and results.json
    seed: int  # the sampler's
    model_seed: int  # the weights' of a config model: the manifest's seed, shared by its steps
    hash: str

    @property
    def key(self) -> str:
        """Unique within a plan; names the step's results folder."""
        return f"{self.target}/{self.run_id}"

    def to_json(self) -> dict:
        """The step as plan.json holds it (keys unchanged since the first plan files: the block is "spec")."""
        return {"index": self.index, "target": self.target, "run_id": self.run_id, "mode": self.mode,
                "model": self.model, "spec": self.block, "seed": self.seed, "model_seed": self.model_seed,
                "hash": self.hash}


@dataclass(frozen=True)
class StepPlan:
    name: str
    steps: tuple[Step, ...]
    environment: dict  # code and environment fingerprint, part of every step's hash

    def to_json(self) -> dict:
        return {"name": self.name, "runner_version": __version__, "environment": self.environment,
                "steps": [s.to_json() for s in self.steps]}

    def describe(self) -> str:
        lines = [f"plan '{self.name}': {len(self.steps)} step{'s' if len(self.steps) != 1 else ''}"]
        for s in self.steps:
            model = s.model.get("id") or f"config:{s.model['config'].get('model_type')}"
            details = ", ".join(f"{k}={v}" for k, v in sorted(s.block.items()) if k != "prompts")
            lines.append(f"  {s.index + 1}. {s.key}  [{s.mode}]  model={model} ({s.model['dtype']}, "
                         f"{s.model['device']})  seed={s.seed}  hash={s.hash[:12]}")
            lines.append(f"       {details}")
        return "\n".join(lines)


def make_plan(manifest: Manifest, base_dir: str | Path = ".") -> StepPlan:
    """`base_dir`: where the manifest's relative input files are (the manifest's folder)."""
    env = environment_fingerprint()
    steps: list[Step] = []
    for target in manifest.targets:
        model = target.model.model_dump(mode="json")
        model_files = {f"model.{k}": v for k, v in input_digests(target.model, Path(base_dir)).items()}
        for run in target.runs:
            mode_block = getattr(run, _block_of(run.mode))
            block = mode_block.model_dump(mode="json", exclude_none=True)
            seed = block.get("seed", manifest.seed)
            files = model_files | {f"spec.{k}": v for k, v in input_digests(mode_block, Path(base_dir)).items()}
            content = {"model": model, "mode": run.mode, "spec": block, "seed": seed, "model_seed": manifest.seed,
                       "files": files, "environment": env}  # the keys of the first hashes: equal steps keep theirs
            digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
            steps.append(Step(len(steps), target.name, run.id, run.mode, model, block, seed, manifest.seed, digest))
    return StepPlan(manifest.name, tuple(steps), env)


@lru_cache(maxsize=1)
def environment_fingerprint() -> dict:
    """What besides the manifest decides the output: the code and the numeric stack (no torch import)."""
    source = Path(__file__).resolve().parents[1]  # all of runner
    code = hashlib.sha256()
    for path in sorted(source.rglob("*.py")):
        code.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes())
    return {"runner": __version__, "code": code.hexdigest()[:16], "python": sys.version.split()[0],
            "torch": package_version("torch"), "transformers": package_version("transformers"),
            "system": f"{platform.system()}-{platform.machine()}"}



def _block_of(mode: str) -> str:
    return BLOCKS[mode]
