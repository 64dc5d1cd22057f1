"""The static-batching baseline (seed 003's `max_batch_size` + `max_wait_ms`): our Generator fed fixed batches.

A batch starts when the generator is idle and either `max_batch_size` requests wait or the oldest has waited
`max_wait_ms`; it decodes to the end of its longest request (rows that are done ride along, as in any static
batch), and the next batch waits for it. Each row's own stop rules are applied to what the Generator yields
(EOS once `min_new_tokens` are out, its `max_new_tokens`), so the records say what each request got and when,
exactly as the continuous scheduler's do. Greedy rows equal their solo decode up to left padding's float rounding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from runner.infer.config.decoding import GenerateConfig
from runner.infer.decode.forward import eos_ids
from runner.infer.generation.generator import Generator
from runner.infer.serve.requests import Request, RequestRecord


class StaticBatcher:
    """The static-batching baseline as a Server for runner.infer.serve.driver.drive: `submit` queues a request,
    `step` decodes one whole batch once it is due (full, or its oldest request waited `max_wait_ms`), `wake_s` says
    when a batch that is filling falls due. Requests that arrive during a batch wait for the next one."""

    def __init__(self, model, max_batch_size: int = 8, max_wait_ms: float = 50.0,
                 sampling: GenerateConfig | None = None):
        self.model, self.max_batch_size, self.max_wait_s = model, max_batch_size, max_wait_ms / 1000
        self.sampling = sampling or GenerateConfig(temperature=0.0)
        self.eos = eos_ids(model, self.sampling.eos_token_id)
        self.clock: Callable[[], float] = _zero  # drive sets the load's
        self.queue: deque[tuple[Request, RequestRecord]] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    @property
    def wake_s(self) -> float | None:
        """When the waiting batch falls due; None when it is due now (full)."""
        if len(self.queue) >= self.max_batch_size or not self.queue:
            return None
        return self.queue[0][0].arrival_s + self.max_wait_s

    def submit(self, request: Request) -> RequestRecord:
        record = RequestRecord(request.id, request.arrival_s, len(request.prompt_ids))
        self.queue.append((request, record))
        return record

    def step(self) -> None:
        taken = [self.queue.popleft() for _ in range(min(self.max_batch_size, len(self.queue)))]
        _decode_batch(self.model, [r for r, _ in taken], [rec for _, rec in taken], self.sampling, self.eos,
                      self.clock)


def _zero() -> float:
    return 0.0


def _decode_batch(model, batch: list[Request], records: list[RequestRecord], sampling: GenerateConfig,
                  eos: set[int], clock: Callable[[], float]) -> None:
    """One static batch, left-padded; every row's tokens and their times recorded until its own stop."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B,T] left-padded
    mask = torch.zeros_like(ids)
    for row, request in enumerate(batch):
        ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
        mask[row, width - len(request.prompt_ids):] = 1
    config = sampling.model_copy(update={"max_new_tokens": max(r.max_new_tokens for r in batch),
                                         "eos_token_id": []})  # each row's own EOS rule below
    start = clock()
    for record in records:
        record.scheduled_s = start
    for token in Generator(model, config).steps(ids, mask):
        now = clock()
        for row, (request, record) in enumerate(zip(batch, records)):
            if record.finish:
                continue
            record.output_ids.append(int(token[row]))
            record.token_s.append(now)
            n = len(record.output_ids)
            if int(token[row]) in eos and n >= request.min_new_tokens:
                record.finish = "eos"
            elif n >= request.max_new_tokens:
                record.finish = "length"
        if all(record.finish for record in records):
            break
