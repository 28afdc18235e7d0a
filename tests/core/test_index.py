"""Shared continuation index: publishing, document boundaries, the memory bound and eviction,
LRU partitions, and its use by later requests through the Drafter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import Drafter, RecapConfig, SharedIndex
from vllm_recap.core.index import BYTES_PER_TOKEN, SharedIndexPartitions
from vllm_recap.core.tree import SOURCE_SHARED

pytestmark = pytest.mark.unit


def test_publish_appends_documents_with_separators() -> None:
    index = SharedIndex(1000)
    index.publish(np.array([1, 2, 3]))
    index.publish(np.array([4, 5]))
    index.publish(np.array([], np.int64))  # nothing to publish
    assert len(index) == 7 and index.num_documents == 2 and index.generation == 2
    match = np.zeros(2, np.int64)
    index.match(np.array([9, 3, 4]), match)
    assert match[1] == 1  # "3 4" spans the document boundary: only "4" matches
    index.match(np.array([9, 1, 2]), match)
    assert match[1] == 2 and index.sam.continuations(int(match[0])) == [(3, 1, 2)]


def test_eviction_drops_the_oldest_documents_down_to_half_the_cap() -> None:
    index = SharedIndex(64)
    docs = [np.arange(10 * i, 10 * i + 15) for i in range(10)]  # 16 tokens with separator
    for i, doc in enumerate(docs):
        index.publish(doc)
        assert len(index) <= 64
        if i == 3:
            assert len(index) == 64 and index.num_documents == 4  # exactly at the cap
        if i == 4:  # 64 + 16 > 64: drop the oldest until 16 more fit in 32
            assert len(index) == 32 and index.num_documents == 2
    match = np.zeros(2, np.int64)
    index.match(docs[-1][:5], match)
    assert match[1] == 5  # the newest document is always there
    index.match(docs[0][:5], match)
    assert match[1] < 5  # the oldest is gone


def test_a_document_longer_than_half_the_cap_keeps_its_end() -> None:
    index = SharedIndex(64)
    index.publish(np.arange(100))
    assert len(index) == 32 and index.num_documents == 1
    match = np.zeros(2, np.int64)
    index.match(np.arange(69, 80), match)
    assert match[1] == 11  # tokens 69..99 survive
    index.match(np.arange(60, 68), match)
    assert match[1] == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.sampled_from([64, 256, 1024]))
def test_memory_stays_within_the_stated_bound(sizes: list[int], cap: int) -> None:
    index = SharedIndex(cap)
    rng = np.random.default_rng(len(sizes))
    for size in sizes:
        index.publish(rng.integers(0, 50, size))
        assert len(index) <= cap
        assert index.nbytes <= BYTES_PER_TOKEN * cap + 4096


def test_partitions_are_lru_bounded() -> None:
    parts = SharedIndexPartitions(128, max_partitions=2)
    a = parts.get("a")
    parts.get("b")
    assert parts.get("a") is a  # refreshed
    parts.get("c")  # evicts b, the least recently used
    assert "a" in parts and "c" in parts and "b" not in parts and len(parts) == 2


# ---------------------------------------------------------------- through the Drafter


def drafter(**kw: object) -> Drafter:
    cfg = dict(top_k=2, use_context_memories=False, node_budget=1, calibrated_scores=False)
    cfg.update(kw)
    return Drafter(RecapConfig(**cfg), 50)


def finish(d: Drafter, rid: str, prompt: list[int], output: list[int], salt=None) -> None:
    d.start(rid, prompt, salt=salt)
    d.commit(rid, output)
    d.stop(rid)


OUTPUT = [20, 21, 22, 23, 24, 25, 26, 27]


def test_a_finished_output_continues_a_later_request() -> None:
    d = drafter()
    finish(d, "a", [1, 2], OUTPUT)
    assert d.memory_stats()["index_tokens"] == len(OUTPUT) + 1
    d.start("b", [3, 4, 20, 21, 22, 23])
    t = d.propose("b")
    assert t.best_path().tolist()[:2] == [24, 25]
    assert np.all(t.sources[1:3] & SOURCE_SHARED)


@pytest.mark.parametrize(("knobs", "salt_b", "drafts"), [
    ({}, None, True),
    ({"shared_index": "off"}, None, False),
    ({"suffix_mode": "earliest"}, None, False),  # the original insertion has no index
    ({"suffix_len": 0}, None, False),
    ({}, "other tenant", False),  # partitions by cache_salt
])
def test_shared_index_switches_and_isolation(knobs: dict, salt_b, drafts: bool) -> None:
    d = drafter(**knobs)
    finish(d, "a", [1, 2], OUTPUT)
    d.start("b", [3, 4, 20, 21, 22, 23], salt=salt_b)
    assert (d.propose("b").num_drafts > 0) is drafts


def test_prompts_are_published_only_when_asked() -> None:
    for mode, expected in (("outputs", len(OUTPUT) + 1), ("outputs_and_prompts", 2 + 8 + 1)):
        d = drafter(shared_index=mode)
        finish(d, "a", [1, 2], OUTPUT)
        assert d.memory_stats()["index_tokens"] == expected


def test_a_running_request_sees_outputs_published_after_it_started() -> None:
    d = drafter()
    d.start("b", [3, 4, 20, 21])
    assert d.propose("b").num_drafts == 0
    finish(d, "a", [1, 2], OUTPUT)  # the corpus changes under b's match
    d.commit("b", [22, 23])
    assert d.propose("b").best_path().tolist()[:2] == [24, 25]


def test_index_memory_in_stats() -> None:
    d = drafter(shared_index_tokens=64)
    for i in range(20):
        finish(d, f"r{i}", [1], OUTPUT)
    stats = d.memory_stats()
    assert stats["index_partitions"] == 1 and stats["index_tokens"] <= 64
    assert 0 < stats["index_bytes"] <= BYTES_PER_TOKEN * 64 + 4096
