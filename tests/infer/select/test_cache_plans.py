"""The cache-plan store: keys, freshness, atomic and concurrent writes, corrupt files set aside."""

import json
import multiprocessing

import pytest

from runner import __version__
from runner.errors import RunnerError
from runner.infer.select.cache_plans import CachePlanStore, cache_plan_key

FIELDS = {"model": "zoo:smollm2-135m", "model_sha256": "ab" * 32, "dtype": "float32", "device": "cpu",
          "device_name": "x86_64", "torch": "2.5.0", "transformers": "5.0.0", "batch": 1, "max_seq_len": 2048,
          "cache_budget_mb": 64, "gates": {"max_delta_nll": 0.05, "max_ppl_ratio": 1.05, "max_mean_kl": 0.1},
          "eval_data_sha256": "cd" * 32}
PLAN = {"choice": "q8_0", "source": "measured",
        "candidates": {"fp16": {"median_ms": 10.0}, "q4_0": {"rejected": "delta_nll 0.2 > 0.05"}}}


def test_put_then_get_round_trip(tmp_path):
    store = CachePlanStore(tmp_path / "plans" / "cache_plans.json")  # parent folder does not exist yet
    key = cache_plan_key(FIELDS)
    stored = store.put(key, PLAN, FIELDS)
    assert stored["choice"] == "q8_0" and stored["candidates"] == PLAN["candidates"]
    assert stored["fields"] == FIELDS and stored["runner_version"] == __version__
    assert stored["created"].endswith("+00:00") and isinstance(stored["created_unix"], float)
    assert store.get(key) == stored
    assert CachePlanStore(store.path).get(key) == stored  # a fresh store reads it from disk
    assert store.get(cache_plan_key({**FIELDS, "batch": 2})) is None
    doc = json.loads(store.path.read_text())
    assert doc == {"version": 1, "plans": {key: stored}}
    assert sorted(p.name for p in store.path.parent.iterdir()) == ["cache_plans.json", "cache_plans.json.lock"]


def test_put_keeps_other_plans_and_replaces_the_same_key(tmp_path):
    store = CachePlanStore(tmp_path / "p.json")
    other = {**FIELDS, "dtype": "bfloat16"}
    store.put(cache_plan_key(FIELDS), PLAN, FIELDS)
    store.put(cache_plan_key(other), {"choice": "fp16"}, other)
    store.put(cache_plan_key(FIELDS), {"choice": "nf4"}, FIELDS)
    assert store.get(cache_plan_key(FIELDS))["choice"] == "nf4"
    assert store.get(cache_plan_key(other))["choice"] == "fp16"
    assert len(json.loads(store.path.read_text())["plans"]) == 2


def test_put_refuses_a_key_that_is_not_the_fields_key(tmp_path):
    store = CachePlanStore(tmp_path / "p.json")
    with pytest.raises(ValueError, match="cache_plan_key"):
        store.put(cache_plan_key({**FIELDS, "batch": 4}), PLAN, FIELDS)
    assert not store.path.exists()


def test_put_of_a_non_json_plan_leaves_the_file_alone(tmp_path):
    store = CachePlanStore(tmp_path / "p.json")
    store.put(cache_plan_key(FIELDS), PLAN, FIELDS)
    before = store.path.read_bytes()
    other = {**FIELDS, "batch": 8}
    with pytest.raises(TypeError):
        store.put(cache_plan_key(other), {"choice": object()}, other)
    assert store.path.read_bytes() == before


def test_key_is_independent_of_dict_order():
    reordered = dict(reversed(list(FIELDS.items())))
    reordered["gates"] = dict(reversed(list(FIELDS["gates"].items())))
    assert list(reordered) != list(FIELDS)
    assert cache_plan_key(reordered) == cache_plan_key(FIELDS)
    assert len(cache_plan_key(FIELDS)) == 64 and int(cache_plan_key(FIELDS), 16) >= 0


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_key_changes_when_any_field_changes(name):
    value = FIELDS[name]
    changed = {**value, "max_mean_kl": 0.2} if isinstance(value, dict) else (
        value + 1 if isinstance(value, int) else value + "x")
    assert cache_plan_key({**FIELDS, name: changed}) != cache_plan_key(FIELDS)
    assert cache_plan_key({k: v for k, v in FIELDS.items() if k != name}) != cache_plan_key(FIELDS)


def test_freshness_uses_the_age_only_when_probing(tmp_path):
    store = CachePlanStore(tmp_path / "p.json")
    cache_plan = store.put(cache_plan_key(FIELDS), PLAN, FIELDS)
    t0 = cache_plan["created_unix"]
    assert store.is_fresh(cache_plan, probe=False, interval_sec=3600, now=t0 + 10**7)
    assert store.is_fresh(cache_plan, probe=True, interval_sec=3600, now=t0 + 3599)
    assert not store.is_fresh(cache_plan, probe=True, interval_sec=3600, now=t0 + 3600)
    assert not store.is_fresh(cache_plan, probe=True, interval_sec=3600, now=t0 + 4000)
    assert store.is_fresh(cache_plan, probe=True, interval_sec=3600)  # now defaults to the clock: just written
    assert not CachePlanStore.is_fresh({"choice": "fp16"}, probe=True, interval_sec=3600)  # no creation time


def test_lookup_reasons(tmp_path):
    store = CachePlanStore(tmp_path / "p.json")
    key = cache_plan_key(FIELDS)
    assert store.lookup(key, probe=True, interval_sec=3600) == (None, "missing")
    cache_plan = store.put(key, PLAN, FIELDS)
    t0 = cache_plan["created_unix"]
    assert store.lookup(key, probe=False, interval_sec=3600, now=t0 + 10**7) == (cache_plan, "fresh (probe off)")
    assert store.lookup(key, probe=True, interval_sec=3600, now=t0 + 12) == (cache_plan, "fresh (age 12 s < 3600 s)")
    assert store.lookup(key, probe=True, interval_sec=3600, now=t0 + 4000) == (None, "stale (age 4000 s >= 3600 s)")


def test_lookup_of_a_cache_plan_without_creation_time(tmp_path):
    """lookup decides by is_fresh: no creation time is stale while probing, fresh with probing off."""
    key = cache_plan_key(FIELDS)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "plans": {key: {"choice": "fp16"}}}))
    store = CachePlanStore(path)
    assert store.lookup(key, probe=True, interval_sec=3600) == (None, "stale (no creation time)")
    assert store.lookup(key, probe=False, interval_sec=3600) == ({"choice": "fp16"}, "fresh (probe off)")


def _put_many(path, worker, start):
    start.wait()
    store = CachePlanStore(path)
    for i in range(10):
        fields = {**FIELDS, "worker": worker, "i": i}
        store.put(cache_plan_key(fields), {"choice": "fp16", "worker": worker, "i": i}, fields)


def test_concurrent_writers_lose_no_plan(tmp_path):
    path = tmp_path / "plans" / "cache_plans.json"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_put_many, args=(path, w, start)) for w in range(8)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 8
    doc = json.loads(path.read_text())  # valid JSON, whole
    assert doc["version"] == 1 and len(doc["plans"]) == 80
    store = CachePlanStore(path)
    for w in range(8):
        for i in range(10):
            cache_plan = store.get(cache_plan_key({**FIELDS, "worker": w, "i": i}))
            assert cache_plan is not None and (cache_plan["worker"], cache_plan["i"]) == (w, i)
    assert not list(path.parent.glob("*.tmp")) and not list(path.parent.glob("*.corrupt-*"))


BAD_FILES = {
    "garbage": b"{not json at all\x00\xff",
    "wrong shape": b'["a", "list"]',
    "plans not an object": b'{"version": 1, "plans": []}',
    "a plan not an object": b'{"version": 1, "plans": {"k": 3}}',
    "wrong version": b'{"version": 2, "plans": {}}',
}


@pytest.mark.parametrize("how", ["get", "lookup", "put"])
@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_a_corrupt_file_is_moved_aside_with_a_warning(tmp_path, capsys, bad, how):
    store = CachePlanStore(tmp_path / "cache_plans.json")
    store.path.write_bytes(BAD_FILES[bad])
    key = cache_plan_key(FIELDS)
    if how == "get":
        assert store.get(key) is None
    elif how == "lookup":
        assert store.lookup(key, probe=False, interval_sec=1) == (None, "missing")
    else:
        store.put(key, PLAN, FIELDS)
    asides = list(tmp_path.glob("cache_plans.json.corrupt-*"))
    assert len(asides) == 1 and asides[0].read_bytes() == BAD_FILES[bad]
    err = capsys.readouterr().err
    assert "[runner] WARNING" in err and str(asides[0]) in err
    store.put(key, PLAN, FIELDS)  # works afterwards, and leaves the set-aside file alone
    assert store.get(key)["choice"] == "q8_0"
    assert json.loads(store.path.read_text())["plans"].keys() == {key}
    assert list(tmp_path.glob("cache_plans.json.corrupt-*")) == asides
    assert "WARNING" not in capsys.readouterr().err


def test_two_corrupt_files_in_a_row_both_kept(tmp_path, capsys):
    store = CachePlanStore(tmp_path / "p.json")
    for garbage in (b"one", b"two"):
        store.path.write_bytes(garbage)
        assert store.get("k") is None
    assert sorted(p.read_bytes() for p in tmp_path.glob("p.json.corrupt-*")) == [b"one", b"two"]


def test_unwritable_location_is_a_runner_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the plans folder should be")
    store = CachePlanStore(blocker / "cache_plans.json")
    assert store.get(cache_plan_key(FIELDS)) is None  # reading a missing file needs no folder
    with pytest.raises(RunnerError, match="cannot write cache plans .*not-a-folder"):
        store.put(cache_plan_key(FIELDS), PLAN, FIELDS)
