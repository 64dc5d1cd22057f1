"""The manifest schema: the single source of truth for what a manifest may say (its blocks: blocks.py).

Every model forbids unknown keys and every field has a description and bounds; the JSON Schema
printed by `run schema` is exported from these classes. Validators check and normalise only:
they never touch torch, devices or disk (paths are resolved later, relative to the manifest).
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Literal

from pydantic import Field, field_validator, model_validator

from runner.errors import ValueAt
from runner.infer.config.tasks import length_problem
from runner.infer.loading.zoo import DEFAULT_MODEL, ZOO, ZOO_PREFIX
from runner.manifest.blocks import (
    MAX_SEED,
    NAME_MAX,
    NAME_PATTERN,
    BenchBlock,
    GenerateBlock,
    ModelBlock,
    SpeculativeBlock,
    Strict,
)
from runner.manifest.eval_block import EvalBlock
from runner.manifest.serve_block import ServeBlock

Mode = Literal["generate", "auto-cache-select", "speculative", "bench", "serve", "eval"]
MODES = typing.get_args(Mode)
BLOCKS = {"generate": "generate", "auto-cache-select": "generate", "speculative": "speculative",
          "bench": "bench", "serve": "serve", "eval": "eval"}  # mode → its block


class Run(Strict):
    id: str = Field(pattern=NAME_PATTERN, max_length=NAME_MAX, description=(
        "Unique within its target; names the results folder."))
    mode: Mode = Field(description="What the run does: " + ", ".join(MODES) + ".")
    generate: GenerateBlock | None = Field(None, description=(
        "Decoding settings and prompts (auto-cache-select: the cache_* settings)."))
    speculative: SpeculativeBlock | None = Field(None, description="Speculative decoding: the draft and its settings.")
    bench: BenchBlock | None = Field(None, description="Bench matrix: sizes, cache kinds, dtypes, repeats, baseline.")
    serve: ServeBlock | None = Field(None, description=(
        "Serving under load: arrivals, request lengths, SLO, scheduler limits, axes and baselines."))
    eval: EvalBlock | None = Field(None, description=(
        "Long-context tasks (docs/long-context.md) scored with each cache kind: tasks, lengths, samples, seed, "
        "cache_kinds."))

    @model_validator(mode="before")
    @classmethod
    def _default_block(cls, data):
        """generate, auto-cache-select, bench and eval may leave their block out (all defaults); speculative needs
        its draft."""
        block = BLOCKS.get(data.get("mode")) if isinstance(data, dict) and isinstance(data.get("mode"), str) else None
        if block in ("generate", "bench", "eval") and block not in data:
            return {**data, block: {}}
        return data

    @model_validator(mode="after")
    def _auto_only_where_it_means_something(self) -> Run:
        block = BLOCKS[self.mode]
        others = [name for name in ("generate", "speculative", "bench", "serve", "eval")
                  if name != block and getattr(self, name) is not None]
        if others:
            raise ValueError(f"mode {self.mode} reads the '{block}' block: remove '{others[0]}'")
        if getattr(self, block) is None:
            raise ValueError(f"mode {self.mode} needs a '{block}' block")
        if self.mode in ("generate", "auto-cache-select"):
            assert self.generate is not None  # the mode's block, checked above
            if self.mode == "generate" and self.generate.weight_candidates:
                raise ValueError("weight_candidates is read by mode auto-cache-select (it chooses the weights and "
                                 "the cache kind together): remove it, or use mode: auto-cache-select")
            if self.mode == "auto-cache-select" and self.generate.cache_kind not in (None, "auto"):
                raise ValueError(f"mode auto-cache-select chooses the cache kind itself: remove cache_kind: "
                                 f"{self.generate.cache_kind} (or use mode: generate)")
        return self


class RunError(ValueAt):
    """A target's check that concerns one of its runs: reported at that run (its index and key), naming its id."""

    def __init__(self, index: int, run_id: str, key: tuple[str | int, ...], message: str):
        super().__init__(("runs", index, *key), f"run {run_id!r}: {message}")


class Target(Strict):
    type: Literal["experiment"] = Field("experiment", description="Kind of target (only 'experiment' for now).")
    name: str = Field(pattern=NAME_PATTERN, max_length=NAME_MAX, description="Unique within the manifest.")
    model: ModelBlock = Field(default_factory=ModelBlock, description="The model; omitted = " + DEFAULT_MODEL + ".")
    runs: list[Run] = Field(min_length=1, description="Runs on this target's model, in order.")

    @field_validator("runs")
    @classmethod
    def _unique_run_ids(cls, runs: list[Run]) -> list[Run]:
        _reject_duplicates([r.id for r in runs], "run id")
        return runs

    @model_validator(mode="after")
    def _weights_chosen_from_full_precision(self) -> Target:
        joint = [r for r in self.runs if r.generate is not None and r.generate.weight_candidates]
        if joint and self.model.quantization != "none":
            raise ValueError(f"run {joint[0].id!r} chooses among weight_candidates, gated against the unquantized "
                             f"model: remove model.quantization ({self.model.quantization})")
        context = model_context(self.model)
        for i, run in enumerate(self.runs):  # a prompt that fills the model's context leaves no room to answer
            suite, key = ((run.eval, ("eval", "lengths")) if run.eval is not None else
                          (run.generate.cache_quality_tasks, ("generate", "cache_quality_tasks", "lengths"))
                          if run.generate is not None else (None, ()))
            if suite is None:
                continue
            for j, length in enumerate(suite.lengths):
                if problem := length_problem(length, suite.tasks, context):
                    raise RunError(i, run.id, (*key, j), problem)
        for i, run in enumerate(self.runs):  # int4 weights need bfloat16: each run judged by its own dtypes
            if run.bench is not None:
                quantizations, dtypes = run.bench.quantizations or [], run.bench.dtypes or [self.model.dtype]
                key, fix = ("bench", "quantizations"), "add bfloat16 to its dtypes (or set model.dtype: bfloat16)"
            elif run.serve is not None:
                quantizations, dtypes = run.serve.quantizations or [], [self.model.dtype]
                key, fix = ("serve", "quantizations"), "set model.dtype: bfloat16"
            else:
                quantizations = run.generate.weight_candidates or [] if run.generate is not None else []
                dtypes, key, fix = [self.model.dtype], ("generate", "weight_candidates"), "set model.dtype: bfloat16"
            source = self.model.id or ""
            if "gguf" in quantizations and not (source.startswith(ZOO_PREFIX) or source.endswith(".gguf")):
                raise RunError(i, run.id, key, "gguf keeps a GGUF file's tensors as stored: model.id must be a zoo: "
                               "name or a .gguf file, or leave gguf out")
            int4 = [q for q in quantizations if q.startswith("int4")]
            if int4 and "bfloat16" not in dtypes:
                raise RunError(i, run.id, key, f"{int4[0]} runs in bfloat16 (torchao's int4 kernels; on CPU float32 "
                               f"takes a path hundreds of times slower): {fix}, or leave int4 out")
        return self


def model_context(model: ModelBlock) -> int | None:
    """The model's context in tokens where the manifest alone says it (a zoo model, a config); else None (a hub id
    or a folder: the library checks it when the model is loaded)."""
    if model.config is not None:
        return model.config.get("max_position_embeddings")
    name = (model.id or DEFAULT_MODEL).removeprefix(ZOO_PREFIX)
    return ZOO[name].context if (model.id or DEFAULT_MODEL).startswith(ZOO_PREFIX) and name in ZOO else None


URI_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow could not use `uri` (an unknown scheme), or None; checked before any run folder exists."""
    if "://" not in uri:
        return None if ":" not in uri.split("/")[0] else f"tracking URI {uri!r} has no '//' after its scheme"
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in URI_SCHEMES or scheme.startswith("databricks"):
        return None
    close = difflib.get_close_matches(scheme, URI_SCHEMES, n=1)
    hint = f"did you mean '{close[0]}://'? " if close else ""
    return (f"unknown tracking URI scheme {scheme!r}: {hint}MLflow takes "
            + ", ".join(f"{s}://" for s in URI_SCHEMES) + " or a folder")


class Tracking(Strict):
    mlflow: bool = Field(True, description="Mirror results to MLflow.")
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment; default: the manifest's name.")
    tracking_uri: str | None = Field(None, min_length=1, description=(
        "MLflow store; default sqlite:///<runs_dir>/mlflow.db. " + ", ".join(f"{s}://" for s in URI_SCHEMES)
        + " or a folder."))
    runs_dir: str = Field("runs", min_length=1, description="Where run folders go (relative to the working directory).")

    @field_validator("tracking_uri")
    @classmethod
    def _known_scheme(cls, uri: str | None) -> str | None:
        problem = tracking_uri_problem(uri) if uri is not None else None
        if problem:
            raise ValueError(problem)
        return uri


class Manifest(Strict):
    version: int = Field(1, description="Manifest format version (this runner reads 1).")
    name: str = Field(pattern=NAME_PATTERN, max_length=NAME_MAX, description=(
        "Names the run folder; default: the file's stem."))
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seeds weights of config models and every sampler.")
    tracking: Tracking = Field(default_factory=Tracking, description="Where results are mirrored.")
    models: dict[str, ModelBlock] = Field(default_factory=dict, description=(
        "Named model blocks, e.g. pulled in by a defaults: list and used as model: ${models.NAME}."))
    targets: list[Target] = Field(min_length=1, description="Models and the runs to do on each.")
    on_failure: Literal["continue", "stop"] = Field("continue", description=(
        "When a step (or a sweep point) fails: continue with the others and report failures at the end, "
        "or stop at the first."))
    sweep: dict[str, list[str | int | float | bool | None] | str] = Field(default_factory=dict, description=(
        "Sweep: key path → values, a list or Hydra's sweep grammar ('0.1,0.5', 'range(1,4)', 'choice(a,b)'); "
        "every combination runs as one point (e.g. targets.0.runs.0.generate.temperature: [0.0, 0.7])."))
    sweep_max_points: int = Field(1000, ge=1, le=1_000_000, description=(
        "Most points a sweep may have (a guard against a typo such as range(0,100000)); raise it to run more."))

    @field_validator("sweep", mode="before")
    @classmethod
    def _sweep_values(cls, sweep):
        for key, values in sweep.items() if isinstance(sweep, dict) else ():
            if not isinstance(key, str) or not re.match(r"^[\w-]+(\.[\w-]+)*$", key):
                raise ValueError(f"sweep key {key!r} is not a key path: names and list indices joined by dots "
                                 "(e.g. targets.0.runs.0.generate.temperature)")
            if isinstance(values, list) and not values:
                raise ValueError(f"sweep key {key!r} has no values")
            if not isinstance(values, (list, str)) or any(isinstance(v, (list, dict)) for v in values if
                                                          isinstance(values, list)):
                raise ValueError(f"sweep key {key!r}: expected a list of values or a string in Hydra's sweep grammar "
                                 f"('0.1,0.5', 'range(1,4)'), got {type(values).__name__}")
        return sweep

    @field_validator("version")
    @classmethod
    def _supported_version(cls, version: int) -> int:
        if version != 1:
            raise ValueError(f"unsupported manifest version {version}: this runner reads version 1")
        return version

    @field_validator("targets")
    @classmethod
    def _unique_target_names(cls, targets: list[Target]) -> list[Target]:
        _reject_duplicates([t.name for t in targets], "target name")
        return targets


def _reject_duplicates(names: list[str], what: str) -> None:
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise ValueError(f"duplicate {what}: {', '.join(sorted(seen))}")


def json_schema() -> dict:
    return Manifest.model_json_schema()
