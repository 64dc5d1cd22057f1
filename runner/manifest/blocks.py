"""The manifest's blocks: the model, the `generate`, `speculative` and `bench` blocks of a run, and the strict base
they share (unknown keys forbidden, YAML booleans refused where numbers belong). manifest.py assembles them into
runs, targets and the whole manifest.

Every field has a description and bounds (the JSON Schema of `run schema` is exported from them). Validators check
and normalise only: they never touch torch, devices or disk.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from runner.errors import ValueAt
from runner.infer.config.architecture import config_problem
from runner.infer.config.decoding import ENGINES, GenerateConfig, SpeculativeConfig
from runner.infer.config.kinds import DTYPES, parse_kind, seq_len_problem
from runner.infer.config.quantization import check_quantizations, parse_quantization
from runner.infer.loading.zoo import DEFAULT_MODEL, ZOO, ZOO_PREFIX
from runner.manifest.shapes import as_list, schema_hook

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # safe as a folder name
NAME_MAX = 200  # a folder name is at most 255 bytes, with the run folder's time stamp in front
MAX_SEED = 2**63 - 1  # torch.manual_seed's range

# DTYPES and ENGINES spelled as types (a Literal cannot be built from a variable a type checker reads); the same
# values, checked at import.
Dtype = Literal["float32", "float16", "bfloat16"]
Engine = Literal["eager", "compiled", "llama.cpp"]
if typing.get_args(Dtype) != tuple(DTYPES) or typing.get_args(Engine) != tuple(ENGINES):
    raise RuntimeError("runner.manifest.blocks: Dtype and Engine differ from DTYPES and ENGINES")




class NumbersNotBooleans(BaseModel):
    """YAML 1.1 reads yes/no/on/off/true/false as booleans, which pydantic would take as 1 and 0: a number
    field refuses them (`max_new_tokens: yes` is a mistake, not 1). And one value stands for a one-element list
    wherever a list of plain values goes (runner.manifest.shapes: the same rule makes the JSON Schema)."""

    model_config = ConfigDict(json_schema_extra=schema_hook)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value, info):
        field = cls.model_fields.get(info.field_name)
        if field is not None and _is_boolean(value) and _takes_numbers(field.annotation):
            raise ValueError("expected a number, not a boolean (YAML reads yes/no/on/off/true/false as booleans)")
        return as_list(field, value)


def _is_boolean(value) -> list:
    """The booleans in `value` (itself, or a list's items)."""
    items = value if isinstance(value, list) else [value]
    return [v for v in items if isinstance(v, bool)]


def _takes_numbers(annotation) -> bool:
    """int or float somewhere in the annotation (list[int], float | None, ...) and bool nowhere."""
    parts, numbers = [annotation], False
    while parts:
        part = parts.pop()
        if part is bool:
            return False
        numbers |= part in (int, float)
        parts += typing.get_args(part)
    return numbers


class Strict(NumbersNotBooleans):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelBlock(Strict):
    """Which model to load: `id` or `config` (not both); neither means the embedded default."""

    id: str | None = Field(None, min_length=1, json_schema_extra={"input_file": "model"}, description=(
        "zoo:NAME, a Hugging Face id, a local folder, a .gguf file, or a .json transformers config built with "
        "random weights like `config` (paths relative to the manifest)."))
    config: dict | None = Field(None, description=(
        "A transformers config (model_type + sizes) built with random weights from the seed."))
    dtype: Dtype = Field("float32", description="Weights and compute dtype.")
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$", description="auto, cpu, cuda[:N] or mps.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for a Hugging Face id.")
    trust_remote_code: bool = Field(False, description="Run code shipped with a hub model. Off unless set.")
    quantization: str = Field("none", description=(
        "Weight quantization through torchao: none, int8 (weight-only, per row), int8-dynamic (int8 weights and "
        "activations quantized per token), int4 (weight-only, groups of 64 inputs, the embedding "
        "too; int4:g32, int4:g128; int4:g32:e8 keeps the embedding and a tied head in int8; bfloat16 models only). "
        "cpu or cuda. gguf: a GGUF model (zoo: or .gguf) keeps its tensors as the file stores them (Q8_0, Q4_0, "
        "Q4_1, Q5_0, Q4_K, Q6_K), read by runner's block kernels; cpu. See docs/weights.md."))

    @model_validator(mode="before")
    @classmethod
    def _shorthand_and_default(cls, data):
        """`model: zoo:smollm2-135m` means `model: {id: zoo:smollm2-135m}`; no id and no config → the default."""
        if isinstance(data, str):
            return {"id": data}
        if isinstance(data, dict) and data.get("id") is None and data.get("config") is None:
            return {**data, "id": DEFAULT_MODEL}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelBlock:
        if self.id is not None and self.config is not None:
            raise ValueError("give either 'id' or 'config', not both")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("'config' needs 'model_type' (e.g. llama, qwen2, gpt2) and the sizes to change")
        if self.config is not None and (problem := config_problem(self.config)):
            raise ValueError(f"config: {problem}")
        if self.id is not None and self.id.startswith(ZOO_PREFIX) and self.id[len(ZOO_PREFIX):] not in ZOO:
            raise ValueError(f"unknown zoo model {self.id!r}; the zoo has: {', '.join(ZOO_PREFIX + n for n in ZOO)}")
        return self

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str) -> str:
        parse_quantization(value)  # ValueError names the known ones
        return value

    @model_validator(mode="after")
    def _device_runs_the_quantization(self) -> ModelBlock:
        name, _ = parse_quantization(self.quantization)
        if name != "none" and self.device == "mps":
            raise ValueError(f"quantization {self.quantization} runs on cpu or cuda (torchao), not mps: use "
                             "device: cpu, or quantization: none")
        if name == "gguf" and (self.id is None or not (self.id.startswith(ZOO_PREFIX) or self.id.endswith(".gguf"))):
            raise ValueError("quantization gguf keeps a GGUF file's tensors as stored: model.id must be a zoo: name "
                             "or a .gguf file")
        if name == "gguf" and self.device not in ("auto", "cpu"):
            raise ValueError(f"quantization gguf runs on cpu (runner's block kernels), not {self.device}: use "
                             "device: cpu")
        if name == "int4" and self.dtype != "bfloat16":
            raise ValueError(f"quantization {self.quantization} runs in bfloat16 (torchao's int4 kernels; on CPU "
                             "float32 takes a path hundreds of times slower): set dtype: bfloat16, or use int8")
        return self

    @field_validator("id")
    @classmethod
    def _plain_id(cls, value: str | None) -> str | None:
        if value is not None and value.strip() != value:
            raise ValueError("model id has leading or trailing spaces")
        return value


class PromptSource(NumbersNotBooleans):
    """Where prompts come from and how they are batched (shared by the generate and speculative blocks)."""

    prompts: list[str] | None = Field(None, min_length=1, description="Prompts, inline; none = one default prompt.")
    prompts_file: str | None = Field(None, json_schema_extra={"input_file": "prompts"}, description=(
        "A .txt file (one prompt per line) or .jsonl file ({\"prompt\": ...} per line), relative to the manifest."))
    batch_size: int = Field(1, ge=1, le=4096, description="Prompts decoded together (left-padded).")

    @model_validator(mode="after")
    def _one_prompt_source(self):
        if self.prompts is not None and self.prompts_file is not None:
            raise ValueError("give one of 'prompts' (a list) or 'prompts_file' (a .txt or .jsonl path), not both")
        if self.prompts_file is not None and Path(self.prompts_file).suffix not in {".txt", ".jsonl"}:
            raise ValueError("'prompts_file' must end in .txt (one prompt per line) or .jsonl")
        return self


STRATEGY_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                 "no_repeat_ngram_size", "num_beams", "length_penalty", "early_stopping", "num_return_sequences",
                 "penalty_alpha", "seed", "decode_plan", "decode_q_chunk", "decode_local_window", "decode_sink_tokens")
def _optional(field: FieldInfo) -> Any:
    """The field's type (with its bounds) or None."""
    assert field.annotation is not None  # GenerateConfig's fields are all annotated
    if not field.metadata:
        return field.annotation | None
    annotated = (field.annotation | None, *field.metadata)  # Annotated[type, bound, ...]
    return Annotated[annotated]


STRATEGY_FIELDS: dict[str, Any] = {key: (_optional(GenerateConfig.model_fields[key]),
                                         Field(None, description=GenerateConfig.model_fields[key].description))
                                   for key in STRATEGY_KEYS}
Strategy = create_model(  # a decoding strategy: GenerateConfig's decoding keys and bounds, each overriding the block's
    "Strategy", __base__=Strict, **STRATEGY_FIELDS)


StrategyName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=NAME_MAX)]  # names columns and metrics


class StrategyError(ValueAt):
    """A strategy that does not validate with its block's settings: reported at the strategy (and its key)."""

    def __init__(self, name: str, key: str | None, message: str):
        super().__init__(("strategies", name, *((key,) if key else ())), f"strategy {name!r}: {message}", message)


class GenerateBlock(GenerateConfig, PromptSource):
    """The `generate` block: GenerateConfig's seed names plus where prompts come from and how to batch.

    `auto-cache-select` reads the same block (the cache_* settings, batch_size, max_seq_len) and no prompts.
    """

    stream: bool = Field(False, description="Print tokens as they are generated (batch_size 1).")
    strategies: dict[StrategyName, Strategy] | None = Field(None, min_length=1, description=(
        "Decode the same prompts once per named strategy (each overrides the block's decoding keys); outputs "
        "side by side in the results and outputs.csv."))

    @model_validator(mode="after")
    def _stream_one_at_a_time(self) -> GenerateBlock:
        for name, config in self.strategy_configs().items():
            where = f"strategy {name!r}: " if self.strategies else ""
            if self.stream and self.batch_size != 1:
                raise ValueError("'stream' prints one sequence at a time: set batch_size: 1, or stream: false")
            if self.stream and config.num_beams > 1:
                raise ValueError(f"{where}beam search decides its tokens at the end and cannot stream: "
                                 f"remove stream or num_beams")
            if config.engine == "llama.cpp" and self.batch_size != 1:
                raise ValueError("engine: llama.cpp decodes one prompt at a time (llama-cpp-python's one sequence): "
                                 "set batch_size: 1")
            if config.contrastive and self.batch_size != 1:
                raise ValueError(f"{where}contrastive search (penalty_alpha) decodes one prompt at a time: "
                                 f"set batch_size: 1")
        return self

    def strategy_configs(self, **updates) -> dict[str, GenerateConfig]:
        """Strategy name → its GenerateConfig (the block's settings, then the strategy's).

        No strategies → {"": the block's own GenerateConfig}."""
        if not self.strategies:
            return {"": library_config(self, GenerateConfig, **updates)}
        try:
            return {name: library_config(self, GenerateConfig, **strategy.model_dump(exclude_none=True) | updates)
                    for name, strategy in self.strategies.items()}
        except ValidationError as exc:
            name = next(n for n, st in self.strategies.items()  # the first strategy that does not validate
                        if not _validates(self, st.model_dump(exclude_none=True) | updates))
            err = exc.errors()[0]
            key = next((part for part in err["loc"] if isinstance(part, str)), None)
            given = self.strategies[name].model_dump(exclude_none=True)
            shown = f" (got {given[key]!r})" if key in given else ""
            raise StrategyError(name, key if key in given else None,
                                err["msg"].removeprefix("Value error, ") + shown) from None


class DraftSource(BaseModel):
    """Where draft tokens come from (the speculative block, and a bench matrix's speculative axis)."""

    draft: ModelBlock | Literal["prompt-lookup"] = Field(description=(
        "The draft model, or prompt-lookup: n-gram drafting from the context. A draft with another tokenizer "
        "than the target's proposes through text (decoded, re-encoded for the target; exact all the same)."))

    @field_validator("draft", mode="before")
    @classmethod
    def _lookup_or_model(cls, value):
        if value == "prompt-lookup":
            return value
        if isinstance(value, str) and difflib.get_close_matches(value.lower(), ["prompt-lookup"], n=1, cutoff=0.8):
            raise ValueError(f"unknown draft {value!r}: did you mean 'prompt-lookup'? (a model id would be "
                             "zoo:NAME, OWNER/NAME or a local path)")
        return ModelBlock.model_validate(value)


class SpeculativeBlock(SpeculativeConfig, PromptSource, DraftSource):
    """The `speculative` block: SpeculativeConfig's seed names, the draft, prompts, and the target-only baseline."""

    compare_target_only: bool = Field(True, description=(
        "Also decode the same prompts with the target alone, to measure the speedup in the same step."))


class BenchDraft(Strict, DraftSource):
    """Speculative decoding as one more axis of a bench matrix: every cell also runs with it on."""

    spec_k: int = Field(4, ge=1, le=64, description="Draft tokens proposed per round.")
    spec_k_adaptive: bool = Field(False, description="Adapt k to the acceptance rate.")


Size = Annotated[int, Field(ge=1, le=1_000_000)]  # a bench axis's batch size or token count: bounds in the schema too


class BenchBlock(Strict):
    """The `bench` block: a matrix of cells, each timed with warm-up, repeats and (by default) transformers'
    own generate() beside it. Every list also takes a single value."""

    batch_sizes: list[Size] = Field([1], min_length=1, description="Prompts decoded together.")
    prompt_lens: list[Size] = Field([128], min_length=1, description="Prompt tokens, cut from the eval text.")
    max_new_tokens: list[Size] = Field([64], min_length=1, description="Tokens generated per prompt (EOS ignored).")
    cache_kinds: list[str] | None = Field(None, min_length=1, description=(
        "KV-cache kinds (fp32, fp16, bf16, q8_0, q4_0, q4_1, nf4, kivi4, kivi3, kivi2, KIVI options as in "
        "kivi3:g128:r128:s4:o1); default: the model's dtype."))
    dtypes: list[Dtype] | None = Field(None, min_length=1, description=(
        "Weight dtypes (the model is reloaded for each); default: the target's."))
    quantizations: list[str] | None = Field(None, min_length=1, description=(
        "Weight quantizations (none, int8, int8-dynamic, int4, int4:g32, ...; the model is quantized for each); "
        "weights MiB and total MiB (weights + measured cache) in every row. Default: the target's."))
    speculative: BenchDraft | None = Field(None, description="Also run every cell with speculative decoding.")
    repeats: int = Field(5, ge=1, le=1000, description="Timed repeats per cell; medians, p90 and spread over them.")
    warmup: int = Field(1, ge=0, le=100, description="Untimed runs before the timed repeats.")
    engines: list[Engine] = Field(["eager"], min_length=1, description=(
        "Our decode engines, an axis of the matrix (engine: one value is the same): eager, compiled (static "
        "caches, a compiled decode step; compile seconds reported apart). The compiled engine takes every cache "
        "kind."))
    baseline: list[Literal["hf", "hf-compiled", "none"]] = Field(["hf"], description=(
        "Baselines timed on the same model and inputs beside every cell, with ratios: hf (transformers' eager "
        "model.generate() with the same cache kind), hf-compiled (transformers' own static cache and compiled "
        "forward; model dtype only); one value or a list; none = no baseline."))
    roofline: bool = Field(True, description=(
        "Measure the memory bandwidth once and report the fraction of the bandwidth bound reached by decode."))
    data: str = Field("pydoc", min_length=1, json_schema_extra={"input_file": "text"}, description=(
        "Text the prompts are cut from: pydoc, shakespeare, britannica, a .txt file or hf:OWNER/REPO/PATH."))

    engine: Engine | None = Field(None, exclude=True, description=(
        "One engine, the same as engines: [it] (not both)."))

    @model_validator(mode="before")
    @classmethod
    def _engine_is_one_engine(cls, data):
        """`engine: compiled` is `engines: [compiled]`; a bad value stays at `engine`, where the error names it."""
        if isinstance(data, dict) and data.get("engine") is not None:
            if "engines" in data:
                raise ValueError("give engine (one) or engines (a list), not both")
            if data["engine"] in ENGINES:
                data = {**data, "engines": [data["engine"]]}
        return data

    @field_validator("baseline")
    @classmethod
    def _none_is_no_baseline(cls, values: list[str]) -> list[str]:
        return no_baseline(values)

    @field_validator("cache_kinds")
    @classmethod
    def _known_kinds(cls, values: list[str] | None, info) -> list[str] | None:
        longest = max(info.data.get("prompt_lens") or [0]) + max(info.data.get("max_new_tokens") or [0])
        for kind in values or []:
            parse_kind(kind)  # ValueError names the known kinds
            problem = seq_len_problem(kind, longest, "the longest cell's prompt_len + max_new_tokens")
            if problem and "prompt_lens" in info.data and "max_new_tokens" in info.data:
                raise ValueError(problem)
        return values

    @field_validator("quantizations")
    @classmethod
    def _known_quantizations(cls, values: list[str] | None) -> list[str] | None:
        return check_quantizations(values)




ConfigT = TypeVar("ConfigT", bound=BaseModel)


def library_config(block: BaseModel, config_class: type[ConfigT], **updates) -> ConfigT:
    """The library's config (GenerateConfig, SpeculativeConfig) inside a manifest block: what the user set,
    plus `updates`; the block's own keys (prompts, draft, ...) stay behind."""
    fields = block.model_dump(exclude_unset=True).items()
    return config_class.model_validate({k: v for k, v in fields if k in config_class.model_fields} | updates)


def _validates(block: BaseModel, updates: dict) -> bool:
    try:
        library_config(block, GenerateConfig, **updates)
    except ValidationError:
        return False
    return True


def no_baseline(values: list[str]) -> list[str]:
    """A list of baselines where `none` (alone) means none: []."""
    if "none" in values and len(values) > 1:
        raise ValueError(f"none means no baseline: give it alone, or leave it out (got {values})")
    return [] if values == ["none"] else values
