"""Deterministic stand-in targets (`simulator.Target`) for the replay simulator and bench_core.

A target answers what the real model would: the top-K row after any context (every node of a
draft tree), and its own greedy stream (the ground truth a speculative run must reproduce).

    NGramTarget    hash-seeded rows from the last `order` tokens (small vocabularies, tests)
    TableTarget    explicit next-token table; `cycle` builds repetitive streams
    PoolTarget     vectorised, Zipf-ish ids over a large vocabulary (benchmarks)
    RecordedTarget replays a recorded stream with its rows (e.g. captured from an engine)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_recap.core.simulator import Target


class ContextTarget:
    """Base for targets whose row depends only on the last `order` tokens of the context."""

    def __init__(self, k: int, order: int) -> None:
        self.k = k
        self.order = order
        self._cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def row(self, tail: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Row after a context ending in `tail` (the last `order` tokens, -1 padded)."""
        hit = self._cache.get(tail)
        if hit is None:
            hit = self._cache[tail] = self._make_row(tail)
        return hit

    def _make_row(self, tail: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _tail(self, context: Sequence[int]) -> tuple[int, ...]:
        tail = [int(t) for t in context[-self.order:]]
        return tuple([-1] * (self.order - len(tail)) + tail)

    def rows(self, history: Sequence[int], tokens: np.ndarray,
             parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(tokens)
        tails: list[tuple[int, ...]] = [self._tail(history)]
        for i in range(1, n):
            tails.append(tails[int(parents[i])][1:] + (int(tokens[i]),))
        ids = np.empty((n, self.k), np.int64)
        probs = np.empty((n, self.k), np.float32)
        for i, tail in enumerate(tails):
            ids[i], probs[i] = self.row(tail)
        return ids, probs

    def prompt_rows(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows after every prompt prefix: [len(prompt), K] ids and probs."""
        rows = [self.row(self._tail(prompt[: i + 1])) for i in range(len(prompt))]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        seq = [int(t) for t in prompt]
        for _ in range(n):
            seq.append(int(self.row(self._tail(seq))[0][0]))
        return seq[len(prompt):]


class NGramTarget(ContextTarget):
    """Pseudo-random rows determined by the last `order` tokens (hash-seeded), Zipf-ish ids.

    Args:
        vocab_size: ids drawn from [0, vocab_size).
        k: ids per row.
        order: context tokens the row depends on.
        seed: changes every row.
        skew: id = floor(V * u**skew); larger skew = heavier head = more repetition.
        spread: logit gap scale; smaller = flatter rows.
    """

    def __init__(self, vocab_size: int, k: int = 8, order: int = 2, seed: int = 0,
                 skew: float = 2.0, spread: float = 1.0) -> None:
        super().__init__(k, order)
        if vocab_size < 2 * k:
            raise ValueError(f"vocab_size must be >= 2k = {2 * k}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.skew = skew
        self.spread = spread

    def _make_row(self, tail: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed] + [t + 1 for t in tail])
        ids: list[int] = []
        while len(ids) < self.k:
            z = int(self.vocab_size * rng.random() ** self.skew)
            if z not in ids:
                ids.append(z)
        # Strictly decreasing logits, so ids[0] is the unique argmax.
        logits = -np.cumsum(0.05 + self.spread * rng.random(self.k))
        p = np.exp(logits - logits[0])
        return np.array(ids, np.int64), (p / p.sum()).astype(np.float32)


class TableTarget(ContextTarget):
    """Rows from an explicit next-token table: row after a context = table[last token].

    Args:
        ids: [V, K] int, argmax first.
        probs: [V, K] float, descending.
    """

    def __init__(self, ids: np.ndarray, probs: np.ndarray) -> None:
        super().__init__(int(ids.shape[1]), 1)
        self.ids = np.asarray(ids, np.int64)
        self.probs = np.asarray(probs, np.float32)

    def _make_row(self, tail: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[tail[0]], self.probs[tail[0]]

    @classmethod
    def cycle(cls, vocab_size: int, period: int, k: int = 8, seed: int = 0,
              confidence: float = 0.9) -> TableTarget:
        """A table whose greedy stream cycles through tokens 0..period-1 forever.

        Args:
            confidence: probability of the greedy successor; the rest decays geometrically.
        """
        rng = np.random.default_rng(seed)
        ids = np.empty((vocab_size, k), np.int64)
        for t in range(vocab_size):
            first = (t + 1) % period if t < period else int(rng.integers(0, period))
            others = rng.permutation(np.delete(np.arange(vocab_size), first))[: k - 1]
            ids[t] = np.concatenate([[first], others])
        rest = 0.5 ** np.arange(1, k, dtype=np.float64)
        p = np.concatenate([[confidence], (1.0 - confidence) * rest / rest.sum()])
        probs = np.tile(p, (vocab_size, 1))
        return cls(ids, probs)


class PoolTarget:
    """Fast target for benchmarks: a context hashes into a pool of fixed rows.

    For a fraction `order2_fraction` of tokens t (chosen by hash) the row after a context
    depends on (t-1, t), otherwise on t alone -- so U predicts most steps and C/G the rest, as
    with a real model. Vectorised over tree nodes (no per-node Python), so large batches
    simulate quickly. Ids are Zipf-ish over the whole vocabulary, so memory accesses look like
    a real model's.

    Args:
        vocab_size: ids drawn from [0, vocab_size).
        k: ids per row.
        pool_size: distinct rows.
        seed: changes the pool.
        skew: id = floor(V * u**skew).
        order2_fraction: share of tokens whose next row also depends on the previous token.
    """

    def __init__(self, vocab_size: int, k: int = 8, pool_size: int = 1 << 16, seed: int = 0,
                 skew: float = 3.0, order2_fraction: float = 0.3) -> None:
        rng = np.random.default_rng(seed)
        self.k = k
        self.vocab_size = vocab_size
        self.order2_fraction = order2_fraction
        draws = (vocab_size * rng.random((pool_size, 4 * k)) ** skew).astype(np.int64)
        self.ids = np.empty((pool_size, k), np.int64)
        for i in range(pool_size):
            _, first = np.unique(draws[i], return_index=True)
            uniq = draws[i, np.sort(first)]
            if uniq.size < k:  # vanishingly rare; pad with fresh distinct ids
                extra = np.setdiff1d(np.arange(vocab_size), uniq)[: k - uniq.size]
                uniq = np.concatenate([uniq, extra])
            self.ids[i] = uniq[:k]
        logits = -np.cumsum(0.05 + rng.random((pool_size, k)), axis=1)
        p = np.exp(logits - logits[:, :1])
        self.probs = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)

    def _index(self, prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
        hc = (cur.astype(np.uint64) + np.uint64(1)) * np.uint64(0xC2B2AE3D27D4EB4F)
        order2 = (hc >> np.uint64(40)) % np.uint64(1000) < np.uint64(
            int(1000 * self.order2_fraction))
        hp = (prev.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        h = np.where(order2, hc ^ hp, hc)
        return ((h >> np.uint64(17)) % np.uint64(self.ids.shape[0])).astype(np.int64)

    def rows(self, history: Sequence[int], tokens: np.ndarray,
             parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.asarray(tokens, np.int64)
        prev = np.empty_like(tokens)
        prev[0] = history[-2] if len(history) >= 2 else -1
        prev[1:] = tokens[np.asarray(parents[1:], np.int64)]
        idx = self._index(prev, tokens)
        return self.ids[idx], self.probs[idx]

    def prompt_rows(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        cur = np.asarray(prompt, np.int64)
        prev = np.concatenate([[-1], cur[:-1]])
        idx = self._index(prev, cur)
        return self.ids[idx], self.probs[idx]

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        seq = [int(t) for t in prompt]
        for _ in range(n):
            prev = np.array([seq[-2] if len(seq) >= 2 else -1])
            seq.append(int(self.ids[self._index(prev, np.array([seq[-1]]))[0], 0]))
        return seq[len(prompt):]


class RecordedTarget:
    """Replays a recorded stream: rows recorded along it, a fallback target elsewhere.

    Args:
        sequence: [L] prompt + recorded output tokens.
        ids: [L - 1, K] recorded rows, row j = the target's top-K after sequence[:j + 1];
            ids[j, 0] must equal sequence[j + 1] from the prompt's last position on.
        probs: [L - 1, K].
        fallback: target for contexts that leave the recorded stream (off-path tree nodes).
    """

    def __init__(self, sequence: Sequence[int], ids: np.ndarray, probs: np.ndarray,
                 fallback: Target) -> None:
        self.sequence = [int(t) for t in sequence]
        self.ids = np.asarray(ids, np.int64)
        self.probs = np.asarray(probs, np.float32)
        self.fallback = fallback
        self.k = int(self.ids.shape[1])

    def rows(self, history: Sequence[int], tokens: np.ndarray,
             parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids, probs = self.fallback.rows(history, tokens, parents)
        h = len(history)
        if list(history) != self.sequence[:h]:
            return ids, probs
        on = np.zeros(len(tokens), np.bool_)  # node context is a prefix of the sequence
        depth = np.zeros(len(tokens), np.int64)
        on[0] = True
        for i in range(len(tokens)):
            if i:
                p = int(parents[i])
                depth[i] = depth[p] + 1
                pos = h - 1 + depth[i]
                on[i] = on[p] and pos < len(self.sequence) and self.sequence[pos] == tokens[i]
            row = h - 1 + depth[i]
            if on[i] and row < len(self.ids):
                ids[i], probs[i] = self.ids[row], self.probs[row]
        return ids, probs

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        return self.sequence[len(prompt): len(prompt) + n]
