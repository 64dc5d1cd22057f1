"""Word lists built in-process (no download) and the byte tokenizer: RULER's generators without a network."""

import pytest

from runner.infer.loading.models import byte_tokenizer
from runner.infer.tasks.words import WordLists

NOUNS = tuple(f"noun{i}" for i in range(400))
ADJECTIVES = tuple(f"adj{i}" for i in range(60))
VERBS = tuple(f"verb{i}" for i in range(80))


@pytest.fixture(scope="session")
def words() -> WordLists:
    return WordLists(NOUNS, ADJECTIVES, VERBS)


@pytest.fixture(scope="session")
def tok():
    return byte_tokenizer()
