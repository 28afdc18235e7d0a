"""Replay simulator: drive a Drafter against a deterministic stand-in target, no engine.

Each decoding step does what an engine does: propose a tree, let the target produce top-K rows
for every node, verify greedily, observe the rows, commit the accepted path + bonus token. The
simulator counts acceptance the way vLLM logs it (1 + accepted / drafts, over steps that had a
draft) and also tokens per target pass over all steps, and checks that the output equals the
target's own greedy stream -- the losslessness contract. Stand-in targets (test fixtures) live
in ``tests/core/targets.py``; anything with the `Target` methods will do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np

from vllm_recap.core.drafter import Drafter
from vllm_recap.core.verify import verify_greedy


class Target(Protocol):
    """A deterministic stand-in for the target model: what the simulator asks of it."""

    def rows(self, history: Sequence[int], tokens: np.ndarray,
             parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-K rows after each node's context (history + path root->i, node 0 = history[-1]).

        Args:
            history: [h] the committed tokens, history[-1] = tokens[0].
            tokens: [n] node tokens of a parents-first tree.
            parents: [n] its parents, parents[0] == -1.

        Returns:
            ids [n, K] int64 (argmax first) and probs [n, K] float32 (descending).
        """
        ...

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """The first n tokens of greedy decoding after `prompt` (the ground truth)."""
        ...


class SeedingTarget(Target, Protocol):
    """A target that can also give the rows of a whole prompt (``seed_prompt_rows=True``)."""

    def prompt_rows(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows after every prompt prefix: ids [p, K] int64, probs [p, K] float32."""
        ...


@dataclass
class SimStats:
    """Counters over all simulated requests (prefill passes excluded)."""

    steps: int = 0
    draft_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    decode_tokens: int = 0
    tree_nodes: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """vLLM's "Mean acceptance length": 1 + accepted / steps that had a draft."""
        return 1.0 + self.accepted_tokens / self.draft_steps if self.draft_steps else 1.0

    @property
    def tokens_per_pass(self) -> float:
        """Committed tokens per target pass over all decoding steps (drafted or not)."""
        return self.decode_tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "draft_steps": self.draft_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "decode_tokens": self.decode_tokens,
            "acceptance_length": self.acceptance_length,
            "tokens_per_pass": self.tokens_per_pass,
            "mean_drafts": float(np.mean(self.tree_nodes)) if self.tree_nodes else 0.0,
        }


@dataclass
class SimResult:
    outputs: list[list[int]]
    stats: SimStats


def simulate(drafter: Drafter, target: Target, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, seed_prompt_rows: bool = False,
             node_budget: int | None = None, salt: str | None = None,
             check: bool = True) -> SimResult:
    """Generates `max_new_tokens` per prompt, one request after another, with speculation.

    The first token comes from the prefill pass (its row is observed as a single-node step);
    every later step proposes, verifies, observes and commits. Accepted counts include drafts
    accepted beyond `max_new_tokens` in the last step, as vLLM counts them; the output is cut.

    Args:
        drafter: the drafter under test (its persistent memory carries across prompts).
        target: deterministic stand-in.
        prompts: token id lists.
        max_new_tokens: tokens generated per prompt (>= 1).
        seed_prompt_rows: pass the target's rows for every prompt position to `start`
            (needs a `SeedingTarget`).
        node_budget: per-call budget override.
        salt: persistent-U partition.
        check: raise AssertionError unless each output equals `target.greedy`.
    """
    stats = SimStats()
    outputs: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        rid = f"sim-{i}"
        rows = cast(SeedingTarget, target).prompt_rows(prompt) if seed_prompt_rows else None
        drafter.start(rid, prompt, prompt_rows=rows, salt=salt)
        root = np.array([prompt[-1]], np.int64)
        no_parent = np.array([-1], np.int64)
        ids, probs = target.rows(prompt, root, no_parent)
        drafter.observe(rid, root, no_parent, ids, probs)
        out = [int(ids[0, 0])]
        drafter.commit(rid, out)
        while len(out) < max_new_tokens:
            tree = drafter.propose(rid, node_budget=node_budget)
            ids, probs = target.rows(prompt + out, tree.tokens, tree.parents)
            accepted, bonus = verify_greedy(tree.tokens, tree.parents, ids[:, 0])
            drafter.observe(rid, tree.tokens, tree.parents, ids, probs)
            new = [int(t) for t in tree.tokens[accepted]] + [bonus]
            new = new[: max_new_tokens - len(out)]
            drafter.commit(rid, new)
            out.extend(new)
            stats.steps += 1
            stats.decode_tokens += len(new)
            stats.tree_nodes.append(tree.num_drafts)
            if tree.num_drafts:
                stats.draft_steps += 1
                stats.drafted_tokens += tree.num_drafts
                stats.accepted_tokens += len(accepted)
        drafter.stop(rid)
        if check:
            expected = target.greedy(prompt, max_new_tokens)
            if out != expected:
                pairs = enumerate(zip(out, expected, strict=False))
                first = next((j for j, (a, b) in pairs if a != b), min(len(out), len(expected)))
                raise AssertionError(
                    f"prompt {i}: speculative output differs from greedy at token {first}: "
                    f"{out[first:first + 8]} != {expected[first:first + 8]}")
        outputs.append(out)
    return SimResult(outputs, stats)
