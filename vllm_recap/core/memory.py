"""The three memories: U (persistent, per salt partition), C and G (request-local).

A row is K token ids and a distribution over them (softmax of the kept top-K logits). Rows are
written by the compiled kernels in ``_kernels.py``; this module owns the arrays, their growth
and their lifetimes. Layout and key packing are described in ``_kernels.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

from vllm_recap.core import _kernels as kernels

T = TypeVar("T")


def _decode(rec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    k = (rec.shape[0] - 1) // 2
    return rec[:k].astype(np.int64), rec[k : 2 * k].copy()


class UnigramTable:
    """U: one dense row per vocabulary entry, keyed by the context's last token.

    Dense because it is bounded by the vocabulary anyway and a lookup is then one index, no
    hashing: vocab * (8 K + 4) bytes (~3.3 MB for vocab 49152, K = 8).

    Creating one costs no memory traffic: the table is all zeros (``np.zeros`` asks the OS for
    zero pages, which are only mapped when a row is written), and conf = 0 marks "no row"
    (a written row's conf = exp(-H) is at least 1/K). A new cache_salt partition therefore
    takes microseconds in the engine loop, not a multi-MB fill.

    Attributes:
        rows: [vocab, 2K + 1] float32 records (ids | probs | conf), conf = 0 where no row was
            written yet.
    """

    __slots__ = ("rows",)

    def __init__(self, vocab_size: int, k: int) -> None:
        self.rows = np.zeros((vocab_size, 2 * k + 1), np.float32)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    @property
    def num_rows(self) -> int:
        return int(np.count_nonzero(self.rows[:, -1] > 0))

    def row(self, token: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids [K] int64, probs [K] float32) stored for `token`, or None."""
        if self.rows[token, -1] <= 0:
            return None
        return _decode(self.rows[token])


class ContextStore:
    """C (last 2 tokens) and G (last 3 tokens) rows of one request, in one hash table.

    Rows live inline in the table (one record per slot), so a lookup touches the key's cache
    line and the record's, nothing else. The table grows on demand from a small allocation up
    to `max_rows` keys at load factor <= 0.5; at the cap the oldest-inserted key is evicted
    (an overwrite keeps the key's age): recency matters more than the first prompt rows.
    """

    INITIAL_ROWS = 256

    __slots__ = ("max_rows", "tkeys", "tvals", "ring", "meta")

    def __init__(self, k: int, max_rows: int) -> None:
        self.max_rows = max_rows
        n_rows = min(max_rows, self.INITIAL_ROWS)
        self.tkeys, self.tvals = self._table(k, n_rows)
        self.ring = np.zeros(n_rows, np.int64)
        self.meta = np.zeros(2, np.int64)  # (rows used, next ring slot to evict once full)

    @staticmethod
    def _table(k: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        size = 1
        while size < 2 * n_rows:  # load factor <= 0.5 keeps linear probes short
            size *= 2
        return np.full(size, kernels.EMPTY, np.int64), np.zeros((size, 2 * k + 1), np.float32)

    def reserve(self, n_new: int) -> None:
        """Makes room for `n_new` new keys, growing (never past max_rows) if needed.

        Growing replaces tkeys, tvals and ring with new arrays (`meta` stays).
        """
        count = int(self.meta[0])
        n_rows = self.ring.shape[0]
        if count + n_new <= n_rows or n_rows >= self.max_rows:
            return
        # Before the cap no key was ever evicted, so the ring is exactly ring[:count].
        new_rows = min(self.max_rows, max(2 * n_rows, count + n_new))
        tkeys, tvals = self._table((self.tvals.shape[1] - 1) // 2, new_rows)
        kernels.rehash(self.tkeys, self.tvals, tkeys, tvals)
        ring = np.zeros(new_rows, np.int64)
        ring[:count] = self.ring[:count]
        self.tkeys, self.tvals, self.ring = tkeys, tvals, ring

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tkeys, tvals, ring, meta): the last four fields of the kernels' `Memories`."""
        return self.tkeys, self.tvals, self.ring, self.meta

    @property
    def num_rows(self) -> int:
        return int(self.meta[0])

    @property
    def nbytes(self) -> int:
        return self.tkeys.nbytes + self.tvals.nbytes + self.ring.nbytes

    def row(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids [K], probs [K]) stored for a 2-token (C) or 3-token (G) context, or None."""
        if len(context) == 2:
            key = -((int(context[0]) << 21) | int(context[1])) - 2
        elif len(context) == 3:
            key = (int(context[0]) << 42) | (int(context[1]) << 21) | int(context[2])
        else:
            raise ValueError(f"context must have 2 (C) or 3 (G) tokens, got {len(context)}")
        slot = kernels.context_slot(self.tkeys, key)
        return None if slot < 0 else _decode(self.tvals[slot])


def empty_context_arrays(k: int) -> tuple[np.ndarray, ...]:
    """Placeholder C/G arrays for kernels called with context memories off (never read)."""
    return ContextStore(k, 16).arrays()


class Partitions(Generic[T]):
    """Per-partition objects (one per cache_salt), LRU-bounded.

    A request keeps a reference to its partition's object, so evicting a partition never
    disturbs a running request; new requests with that salt start from a fresh one. Memory is
    thus bounded by `max_partitions` objects plus those held by running requests of evicted
    salts.

    Args:
        make: builds the object of a new partition.
        max_partitions: most partitions kept (least recently used evicted).
    """

    def __init__(self, make: Callable[[], T], max_partitions: int) -> None:
        self._make = make
        self.max_partitions = max_partitions
        self._items: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, salt: Hashable) -> T:
        """The object for `salt`, created (evicting the least recently used) if absent."""
        item = self._items.get(salt)
        if item is not None:
            self._items.move_to_end(salt)
            return item
        item = self._items[salt] = self._make()
        while len(self._items) > self.max_partitions:
            self._items.popitem(last=False)
        return item

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, salt: Hashable) -> bool:
        return salt in self._items

    def values(self) -> list[T]:
        return list(self._items.values())


class UnigramPartitions(Partitions[UnigramTable]):
    """Persistent U tables, one per partition key (cache_salt), LRU-bounded (`Partitions`)."""

    def __init__(self, vocab_size: int, k: int, max_partitions: int) -> None:
        super().__init__(lambda: UnigramTable(vocab_size, k), max_partitions)

    def tables(self) -> list[UnigramTable]:
        return self.values()

