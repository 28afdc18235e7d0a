"""Tree-aware speculative metrics (vLLM's counters assume chains).

vLLM counts drafts and accepted tokens per position of a chain. For trees the useful figures
are: nodes verified per step, accepted depth, and per-depth acceptance (of the steps whose tree
reached depth d, how many accepted at least d tokens). They are kept per worker and logged
periodically, like vLLM's "SpecDecoding metrics" line.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_recap.core.config import MAX_DEPTH

logger = logging.getLogger("vllm.recap")


@dataclass
class TreeMetrics:
    """Counters over verification steps that had at least one draft node.

    Attributes:
        steps: verification steps with drafts.
        nodes: draft nodes verified.
        accepted: draft tokens accepted.
        reached: [MAX_DEPTH + 1] steps whose tree had a node at depth d.
        accepted_at: [MAX_DEPTH + 1] steps that accepted at least d tokens.
    """

    steps: int = 0
    nodes: int = 0
    accepted: int = 0
    reached: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DEPTH + 1, np.int64))
    accepted_at: np.ndarray = field(default_factory=lambda: np.zeros(MAX_DEPTH + 1, np.int64))
    log_interval_s: float = 10.0
    _last_log: float = field(default_factory=time.monotonic)

    def record(self, num_nodes: int, tree_depth: int, num_accepted: int) -> None:
        """One request's verification step: draft nodes, deepest node, tokens accepted."""
        if num_nodes <= 0:
            return
        self.steps += 1
        self.nodes += num_nodes
        self.accepted += num_accepted
        self.reached[1:min(tree_depth, MAX_DEPTH) + 1] += 1
        self.accepted_at[1:min(num_accepted, MAX_DEPTH) + 1] += 1

    def snapshot(self) -> dict:
        """Plain figures: mean nodes and acceptance length per step, per-depth acceptance."""
        depth = int(np.max(np.nonzero(self.reached)[0], initial=0))
        per_depth = [round(float(self.accepted_at[d] / self.reached[d]), 3)
                     for d in range(1, depth + 1)]
        return {
            "steps": self.steps,
            "mean_nodes": self.nodes / self.steps if self.steps else 0.0,
            "acceptance_length": 1 + self.accepted / self.steps if self.steps else 1.0,
            "per_depth_acceptance": per_depth,
        }

    def maybe_log(self, live_requests: int,
                  sources: Callable[[], dict[str, dict[str, list]]] | None = None) -> None:
        """The periodic "RECAP metrics" line (every ``log_interval_s`` while drafting).

        Args:
            live_requests: requests holding request-local state.
            sources: the drafter's per-source acceptance (`Drafter.acceptance_snapshot`),
                called only when a line is logged; its per-depth rates join the line.
        """
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s or not self.steps:
            return
        self._last_log = now
        s = self.snapshot()
        logger.info("RECAP metrics: %d tree steps, mean draft nodes %.1f, mean acceptance length "
                    "%.2f, per-depth acceptance %s, live requests %d%s", s["steps"],
                    s["mean_nodes"], s["acceptance_length"], s["per_depth_acceptance"],
                    live_requests, format_sources(sources() if sources else {}))


def format_sources(snapshot: dict[str, dict[str, list]], depths: int = 6) -> str:
    """"; per-source acceptance by depth: memory [..] (n tested), ..." for the metrics line:
    of the nodes each source proposed whose parent was accepted, the share accepted, per depth
    (first ``depths`` depths); sources never tested are left out."""
    parts = []
    for name, row in snapshot.items():
        tested = sum(row["tested"])
        if tested:
            parts.append(f"{name} {row['rate'][:depths]} ({tested} tested)")
    return "; per-source acceptance by depth: " + ", ".join(parts) if parts else ""


def log_idle(memory: dict[str, int]) -> None:
    """One line when the last request's local state is freed (a burst of traffic ended)."""
    logger.info("RECAP idle: request-local state freed (live requests %d, context rows %d); "
                "persistent unigram tables %d (%.1f MiB)", memory["requests"],
                memory["context_rows"], memory["u_tables"], memory["u_bytes"] / 2**20)
