"""The shared continuation index: earlier requests' outputs as continuation sources.

Suffix decoding keeps a global tree over earlier outputs; this is RECAP's equivalent. Each
cache_salt partition owns one suffix automaton over a corpus of documents -- the outputs of
finished requests (and their prompts, if configured) -- separated by
``SuffixAutomaton.SEPARATOR``, so no match spans two documents. A running request keeps the
longest suffix of its history that occurs in the corpus (its *match*, amortised O(1) per
committed token), and the tree builder grows continuations from there exactly as from the
request's own text.

Memory bound and eviction: a partition holds at most ``max_tokens`` corpus tokens. Publishing
a document that would exceed it first drops the oldest documents until the corpus is at most
half the cap (a document longer than half the cap keeps its last half-cap tokens), then
rebuilds the automaton from the survivors: O(kept tokens) once per ~max_tokens / 2 published
tokens, so amortised O(1) per token. The automaton's arrays cost about
``BYTES_PER_TOKEN`` bytes per token of capacity (the capacity doubles as needed, up to the
cap), the documents 8 more. Partitions are LRU-bounded (``max_partitions``, evicting the least
recently used); a running request keeps its partition's index object, as with U.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from vllm_recap.core.memory import Partitions
from vllm_recap.core.suffix import SuffixAutomaton

# Worst case per corpus token of automaton capacity: tokens 8, states 2 x 6 x 4, edges
# 3 x 3 x 4, transition hash up to 2 x 2 x 3 slots x 12 bytes, plus the 8-byte document copy.
BYTES_PER_TOKEN = 8 + 48 + 36 + 144 + 8
RESYNC_TOKENS = 256  # history tokens re-matched after the corpus changed


class SharedIndex:
    """One partition's corpus and its automaton.

    Args:
        max_tokens: corpus cap (tokens, separators included), >= 2.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.sam = SuffixAutomaton(max_tokens=max_tokens)
        self.generation = 0  # bumped on every change: running matches re-sync
        self._docs: deque[np.ndarray] = deque()
        self._tokens = 0

    def __len__(self) -> int:
        """Corpus tokens (separators included)."""
        return self._tokens

    @property
    def num_documents(self) -> int:
        return len(self._docs)

    @property
    def nbytes(self) -> int:
        """Bytes held: the automaton's arrays plus the documents kept for rebuilding."""
        return self.sam.nbytes + sum(d.nbytes for d in self._docs)

    def publish(self, tokens: np.ndarray) -> None:
        """Adds one document (int64 ids < 2**21 - 1); evicts the oldest ones past the cap."""
        doc = np.ascontiguousarray(tokens, np.int64).reshape(-1)
        if doc.size == 0:
            return
        half = max(1, self.max_tokens // 2)
        if doc.size + 1 > half:
            doc = doc[-(half - 1):] if half > 1 else doc[:0]
        if doc.size == 0:
            return
        doc = np.concatenate([doc, [SuffixAutomaton.SEPARATOR]])
        self.generation += 1
        if self._tokens + doc.size > self.max_tokens:
            while self._docs and self._tokens + doc.size > half:
                self._tokens -= self._docs.popleft().size
            self.sam = SuffixAutomaton(np.concatenate(list(self._docs)) if self._docs else (),
                                       max_tokens=self.max_tokens)
        self._docs.append(doc)
        self._tokens += doc.size
        self.sam.extend(doc)

    def match(self, history: np.ndarray, match: np.ndarray) -> None:
        """Re-matches the last tokens of `history` from scratch into `match` [2] = (state,
        length) (after the corpus changed: its states may have split or been rebuilt)."""
        match[0] = 0
        match[1] = 0
        self.sam.match_against(np.ascontiguousarray(history[-RESYNC_TOKENS:], np.int64), match)


class SharedIndexPartitions(Partitions[SharedIndex]):
    """Shared indexes, one per partition key (cache_salt), LRU-bounded (`Partitions`).

    Args:
        max_tokens: corpus cap of each partition.
        max_partitions: most partitions kept (least recently used evicted).
    """

    def __init__(self, max_tokens: int, max_partitions: int) -> None:
        super().__init__(lambda: SharedIndex(max_tokens), max_partitions)

    def indexes(self) -> list[SharedIndex]:
        return self.values()
