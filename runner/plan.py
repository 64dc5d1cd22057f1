"""Manifest → Plan: an ordered, frozen, printable list of steps, each with a content hash.

Pure: no torch, no disk. The hash covers everything that decides a step's output (model spec,
run spec, seed, runner version), so equal hashes mean the step would compute the same thing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from runner import __version__
from runner.manifest import BLOCKS, Manifest


@dataclass(frozen=True)
class Step:
    index: int
    target: str
    run_id: str
    mode: str
    model: dict  # ModelSpec as a plain dict
    spec: dict  # the mode's block (e.g. generate) as a plain dict
    seed: int  # the sampler's
    model_seed: int  # the weights' of a config model: the manifest's seed, shared by its steps
    hash: str

    @property
    def key(self) -> str:
        """Unique within a plan; names the step's results folder."""
        return f"{self.target}/{self.run_id}"


@dataclass(frozen=True)
class Plan:
    name: str
    steps: tuple[Step, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "runner_version": __version__, "steps": [asdict(s) for s in self.steps]}

    def describe(self) -> str:
        lines = [f"plan '{self.name}': {len(self.steps)} step{'s' if len(self.steps) != 1 else ''}"]
        for s in self.steps:
            model = s.model.get("id") or f"config:{s.model['config'].get('model_type')}"
            details = ", ".join(f"{k}={v}" for k, v in sorted(s.spec.items()) if k != "prompts")
            lines.append(f"  {s.index + 1}. {s.key}  [{s.mode}]  model={model} ({s.model['dtype']}, "
                         f"{s.model['device']})  seed={s.seed}  hash={s.hash[:12]}")
            lines.append(f"       {details}")
        return "\n".join(lines)


def make_plan(manifest: Manifest) -> Plan:
    steps = []
    for target in manifest.targets:
        model = target.model.model_dump(mode="json")
        for run in target.runs:
            spec = getattr(run, _block_of(run.mode)).model_dump(mode="json", exclude_none=True)
            seed = spec.get("seed", manifest.seed)
            content = {"model": model, "mode": run.mode, "spec": spec, "seed": seed, "model_seed": manifest.seed,
                       "runner": __version__}
            digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
            steps.append(Step(len(steps), target.name, run.id, run.mode, model, spec, seed, manifest.seed, digest))
    return Plan(manifest.name, tuple(steps))


def _block_of(mode: str) -> str:
    return BLOCKS[mode]
