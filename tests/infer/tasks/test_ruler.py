"""RULER's generators on the byte tokenizer (one token per byte) and in-process word lists: seeded, sized, placed."""

import re
from collections import Counter

import pytest

from runner.infer.tasks.ruler import NEEDLE, TASKS, count_tokens, make_sample, make_samples, zeta

LENGTH = 3000  # bytes = tokens; below 4k, cwe uses RULER's short repeats
UNIT_TOKENS = {"niah_single_1": 90, "niah_multikey_2": 80, "niah_multikey_3": 130, "vt": 110}  # one unit, at most


@pytest.mark.parametrize("name", list(TASKS))
def test_a_sample_fills_the_length_to_within_one_unit_and_holds_its_answers(name, tok, words):
    sample = make_sample(name, tok, LENGTH, seed=0, index=0, words=words)
    assert sample.tokens == count_tokens(tok, sample.prompt) <= LENGTH
    assert LENGTH - sample.tokens <= UNIT_TOKENS.get(name, 40), (sample.tokens, sample.units)
    assert sample.answers and all(answer in sample.prompt for answer in sample.answers)
    assert sample.metric == "string_match_all" and sample.max_new_tokens == TASKS[name].max_new_tokens


@pytest.mark.parametrize("name", ["niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"])
def test_samples_are_deterministic_from_the_seed_and_index(name, tok, words):
    first = make_samples(name, tok, LENGTH, 2, seed=3, words=words)
    assert first == make_samples(name, tok, LENGTH, 2, seed=3, words=words)
    other = make_sample(name, tok, LENGTH, seed=4, index=0, words=words)
    assert other.prompt != first[0].prompt and first[0].prompt != first[1].prompt
    assert other.answers != first[0].answers


def _context_tokens(tok, prompt: str, start: str, end: str, needle: str) -> tuple[int, int, int]:
    """(tokens before the needle, before the context, in the context without the needle)."""
    begin, stop = prompt.index(start) + len(start), prompt.rindex(end)
    at = prompt.index(needle)
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return count(prompt[:at]), count(prompt[:begin]), count(prompt[begin:stop]) - count(needle)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("name", ["niah_single_1", "niah_single_2"])
def test_the_needle_sits_at_the_depth_asked(name, depth, tok, words):
    sample = make_sample(name, tok, 6000, depths=[depth], words=words)
    (needle,) = sample.needles
    assert sample.answers[0] in needle and needle.startswith("One of the special magic numbers for ")
    at, begin, size = _context_tokens(tok, sample.prompt, "afterwards.\n", "\nWhat is the special magic", needle)
    assert abs((at - begin) / size - sample.depths[0]) <= 0.01, (at - begin, size)  # the depth reported is true
    # noise: 90-token units; essay: at the sentence boundary nearest the depth (pydoc's sentences run to ~500 tokens)
    assert abs(sample.depths[0] - depth) <= (0.03 if name == "niah_single_1" else 0.08)


def test_multi_needle_depths_are_drawn_from_rulers_forty_and_every_needle_is_placed(tok, words):
    sample = make_sample("niah_multikey_1", tok, LENGTH, seed=1, words=words)
    assert len(sample.needles) == 4 and all(n in sample.prompt for n in sample.needles)
    assert all(0 <= d <= 1 for d in sample.depths)
    key = re.search(r"numbers? for (\S+) mentioned", sample.prompt).group(1)
    assert NEEDLE.format(type_needle_v="numbers", key=key, value=sample.answers[0]) in sample.prompt


def test_singular_and_plural_wording_follow_rulers(tok, words):
    one = make_sample("niah_single_1", tok, LENGTH, words=words).prompt
    assert one.startswith("A special magic number is hidden") and one.endswith("mentioned in the provided text is")
    many = make_sample("niah_multiquery", tok, LENGTH, words=words).prompt
    assert many.startswith("Some special magic numbers are hidden") and ", and " in many


def test_variable_tracking_chains_the_value_through_five_names_after_one_worked_example(tok, words):
    sample = make_sample("vt", tok, LENGTH, words=words)
    names = sample.answers
    assert len(names) == 5 and len(set(names)) == 5
    value = re.search(rf"VAR {names[0]} = (\d+)", sample.prompt).group(1)
    assert all(f"VAR {b} = VAR {a}" in sample.prompt for a, b in zip(names, names[1:]))
    assert sample.prompt.count("Memorize and track") == 2  # the worked example, then the question
    assert sample.prompt.endswith(f"5 variables are assigned the value {value}, they are: ")
    assert sorted(sample.depths) == list(sample.depths) and len(sample.depths) == 5


def test_common_words_are_the_ten_listed_most_often(tok, words):
    sample = make_sample("cwe", tok, LENGTH, words=words)
    question = sample.prompt[sample.prompt.rindex("Below is a numbered list"):]
    listed = Counter(re.findall(r"\d+\. (\S+)", question.split("\nQuestion:")[0]))
    assert {w for w, c in listed.items() if c == 6} == set(sample.answers) and len(sample.answers) == 10
    assert set(listed.values()) == {6, 1}  # below 4k: RULER's 6 and 1 repeats


def test_frequent_words_are_the_three_after_the_dots(tok, words):
    sample = make_sample("fwe", tok, LENGTH, words=words)
    text = sample.prompt.split("coded words. ")[1].split("\nQuestion:")[0]
    top = [w for w, _ in Counter(text.split()).most_common(4)]
    assert top[0] == "..." and top[1:] == list(sample.answers)


def test_zeta_matches_known_values():
    assert zeta(2.0) == pytest.approx(1.6449340668482264, rel=1e-12)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-12)


def test_unknown_tasks_short_lengths_and_bad_depths_are_value_errors(tok, words):
    with pytest.raises(ValueError, match="unknown task 'niah_singel_1'; did you mean 'niah_single_1'"):
        make_sample("niah_singel_1", tok, LENGTH, words=words)
    with pytest.raises(ValueError, match="length 100 is too short for niah_single_1"):
        make_sample("niah_single_1", tok, 100, words=words)
    with pytest.raises(ValueError, match="1 needle"):
        make_sample("niah_single_1", tok, LENGTH, depths=[0.2, 0.4], words=words)
    with pytest.raises(ValueError, match="niah tasks"):
        make_sample("vt", tok, LENGTH, depths=[0.2], words=words)


@pytest.mark.parametrize("name, question", [("niah_single_1", "\nWhat is the special magic number for"),
                                            ("niah_multivalue", "\nWhat are all the special magic numbers for"),
                                            ("vt", "\nQuestion: Find all variables"),
                                            ("cwe", "\nQuestion: What are the 10 most common words"),
                                            ("fwe", "\nQuestion: Do not provide any explanation")])
def test_the_question_begins_where_the_sample_says_after_every_needle(name, question, tok, words):
    """What `compress: context` feeds unpressed: the question and answer prefix, none of the haystack."""
    sample = make_sample(name, tok, LENGTH, words=words)
    assert sample.prompt[sample.question_at:].startswith(question)
    assert all(sample.prompt.rindex(needle.strip()) < sample.question_at for needle in sample.needles)
    assert all(answer not in sample.prompt[sample.question_at:] for answer in sample.answers)
