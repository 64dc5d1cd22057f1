"""`run serve m.yaml`: a manifest's `mode: serve` run behind the OpenAI-compatible HTTP server (runner/infer/server).

From the run it takes its target's model, its serve block's scheduler limits (max_batch_size, kv_budget_mib or
kv_blocks, block_size, max_tokens_per_step, max_queue, prefix_caching), its first cache kind and first engine; the
load, the SLO and the baselines are for `mode: serve`'s measurements and are not used here. The manifest is
validated as `run check` does (every problem at once, exit 2) and the address is bound before the model loads, so a
taken port is said at once. Nothing is written to a run folder or MLflow: the server's figures are its /metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from runner.errors import ServerError
from runner.infer.config.decoding import GenerateConfig
from runner.infer.config.kinds import speculative_serve_reason
from runner.infer.loading.models import load_model_block
from runner.infer.server.lifecycle import HttpServer, bind, make_scheduler
from runner.manifest.compose import load_manifest
from runner.manifest.paths import model_source
from runner.manifest.plan import Step, make_plan
from runner.manifest.serve_block import ServeBlock
from runner.steps.serve import scheduler_config, slot_columns
from runner.steps.shared import load_draft

log = logging.getLogger(__name__)
DEFAULT_MAX_SEQ_LEN = 2048  # a model whose config names no context length


@dataclass(frozen=True)
class ServeTarget:
    step: Step
    block: ServeBlock
    base_dir: Path

    @property
    def model_name(self) -> str:
        """What clients send as `model`: the model's id (zoo:NAME, a hub id, a path), else the target's name."""
        return str(self.step.model.get("id") or self.step.target)


def serve_target(path: Path, overrides: list[str], run: str | None = None) -> ServeTarget:
    """The manifest's one `mode: serve` run, or the one `run` names (its id, or target/id)."""
    manifest, _ = load_manifest(path, overrides)
    steps = [s for s in make_plan(manifest, path.parent).steps if s.mode == "serve"]
    if not steps:
        raise ServerError(f"{path} has no run with mode: serve to serve")
    names = ", ".join(s.key for s in steps)
    if run is not None:
        steps = [s for s in steps if run in (s.run_id, s.key)]
        if not steps:
            raise ServerError(f"--run {run}: no serve run of {path} is called that; its serve runs: {names}")
    if len(steps) > 1:
        raise ServerError(f"{path} has {len(steps)} serve runs ({names}): choose one with --run")
    step = steps[0]
    return ServeTarget(step, ServeBlock.model_validate(step.block), path.parent)


def start_server(target: ServeTarget, host: str = "127.0.0.1", port: int = 8000) -> HttpServer:
    """Bind, load the model, build the scheduler (the compiled engine compiles its one shape here), listen."""
    sock = bind(host, port)
    try:
        step, block = target.step, target.block
        weights = {"quantization": block.quantizations[0]} if block.quantizations else {}
        lm = load_model_block(model_source(step.model, target.base_dir), step.model_seed, target.base_dir, **weights)
        max_seq_len = int(getattr(lm.model.config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN)
        sampling = GenerateConfig(temperature=0.0, seed=step.seed, max_seq_len=max_seq_len)
        kind = block.cache_kinds[0] if block.cache_kinds else None
        engine = block.engines[0] if block.engines else "eager"  # engines: [] (endpoints only): our default
        asked = block.speculative[0] != "none"
        why = "" if not asked else ("it runs on the eager engine, this server on the compiled one" if engine != "eager"
                                    else speculative_serve_reason(kind))
        draft = None
        if asked and not why and block.speculative[0] == "draft":
            draft, draft_tokenizer = load_draft(block, lm, step, target.base_dir)
            why = "the draft has another tokenizer than the target's" if draft_tokenizer is not None else ""
        if why:
            log.warning("%s speculation is off: %s", block.speculative[0], why)
        speculating = asked and not why
        config = scheduler_config(block, kind, sampling, speculating=speculating)
        if len(block.cache_kinds or []) > 1 or len(block.engines) > 1 or len(block.quantizations or []) > 1:
            log.warning("serving one setting: cache kind %s on engine %s, weights %s (the first of the run's axes)",
                        kind or "of the model's dtype", engine, weights.get("quantization", "as the model block's"))
        try:
            scheduler = make_scheduler(lm.model, lm.tokenizer, config, engine, slot_columns(block, max_seq_len),
                                       draft if speculating else None)
        except ValueError as exc:  # a kind the scheduler cannot serve
            raise ServerError(f"{step.key}: {exc}") from None
        server = HttpServer(scheduler, lm.tokenizer, target.model_name, sock, max_seq_len)
    except BaseException:
        sock.close()
        raise
    server.start()
    return server

