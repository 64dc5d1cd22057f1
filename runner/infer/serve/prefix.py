"""Prefix caching by a chained hash of full prompt blocks (nano-vllm's scheme), served by sharing the blocks.

Block i of a prompt hashes (hash of block i − 1, its block_size token ids), so equal hashes mean equal prefixes
(the tokens are compared too: no collision is trusted). A request whose prompt is in registers its full prompt
blocks with itself as owner; a later request whose prompt starts with the same blocks starts its block table with
the owner's (the scheduler's `_share_prefix`: the same physical blocks of serve/paged.py, reference-counted) and
prefills only the rest; `RequestRecord.cached_prompt_tokens` counts them. When an owner finishes, its full prompt
blocks stay as a `Retained` owner (`retire`): a conversation's next turn, or a request of the same group arriving
after the last one left, still finds them. Retained prefixes are kept least recently used first out
(`evict_oldest`): the scheduler charges their blocks to the KV budget and drops them before it preempts anyone, and
caps them at `prefix_cache_blocks`.
A request sharing an owner's blocks offers them once the owner is preempted or cancelled (the scheduler's `_leave`).
What it does not do: keep a preempted request's own prefix (its blocks are wanted back at once), or serve KIVI kinds
(their groups and residual depend on how the prompt was fed, and they are not in the pool).
Exact for kinds that store each token alone: the first n tokens' stored K/V depend on those tokens only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of `tokens`."""
    hashes, previous = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start:start + block_size])))
        hashes.append(previous)
    return hashes


@dataclass(eq=False)
class Retained:
    """A finished request's full prompt blocks. `key`: its holder id in the block pool (negative: never a
    request's)."""

    key: int
    held: int  # tokens: whole blocks


class PrefixIndex:
    """Full prompt blocks of running requests and of retained finished ones: chained hash → (owner, its prompt).
    Owners are opaque objects with `held` tokens (the scheduler's Live, or a Retained)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.owners: dict[int, tuple[Any, tuple[int, ...]]] = {}  # hash → (owner, the owner's prompt)
        self.retained: OrderedDict[int, Retained] = OrderedDict()  # key → prefix, least recently used first
        self._keys = 0

    def add(self, owner: Any, prompt: tuple[int, ...]) -> None:
        for h in block_hashes(prompt, self.block_size):
            self.owners.setdefault(h, (owner, prompt))

    def remove(self, owner: Any) -> None:
        for h in [h for h, (o, _) in self.owners.items() if o is owner]:
            del self.owners[h]

    def retire(self, owner: Any) -> Retained | None:
        """`owner` leaves: the blocks it owns pass to a Retained, its full prompt blocks (None when it owns none:
        another owner offers the same blocks)."""
        owned = [h for h, (o, _) in self.owners.items() if o is owner]
        if not owned:
            return None
        prompt = self.owners[owned[0]][1]
        tokens = len(prompt) // self.block_size * self.block_size  # it holds its prompt: it was added once in
        self._keys -= 1
        kept = self.retained[self._keys] = Retained(self._keys, tokens)
        for h in owned:
            self.owners[h] = (kept, prompt)
        return kept

    def evict_oldest(self) -> Retained:
        """The least recently used retained prefix, out of the index."""
        _, oldest = self.retained.popitem(last=False)
        self.remove(oldest)
        return oldest

    def lookup(self, tokens: Sequence[int], most: int) -> tuple[Any, int]:
        """The owner of the longest run of `tokens`' leading full blocks, at most `most` tokens → (owner, tokens);
        (None, 0) when none."""
        found, length = None, 0
        for i, h in enumerate(block_hashes(tokens[:most], self.block_size)):
            entry = self.owners.get(h)
            end = (i + 1) * self.block_size
            if entry is None or tuple(tokens[:end]) != entry[1][:end] or entry[0].held < end:
                break
            found, length = entry[0], end
        if isinstance(found, Retained):
            self.retained.move_to_end(found.key)  # used: the last to go
        return found, length

