"""Helpers for engine tests of RECAP: reaching the proposer, oracle drafts, generation."""
from __future__ import annotations

import contextlib

import numpy as np

from vllm_recap.core.drafter import Drafter
from vllm_recap.core.tree import DraftTree


def recap_proposer(llm):
    """The RecapProposer inside an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.drafter


def generate_ids(llm, prompts, params) -> list[list[int]]:
    """Token ids generated for each prompt (token-id lists or prompt dicts), in order."""
    from vllm import TokensPrompt

    batch = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


def oracle_tree(root: int, truth: list[int], vocab: int, wrong_at: int | None) -> DraftTree:
    """A tree whose correct path is never at the first slots, so acceptance needs KV moves.

    Layout (parents first): node 1 is a wrong sibling of the first true token, node 2 a child
    of node 1; the true chain follows from node 3. With ``wrong_at`` = d, the true chain's
    token at depth d is replaced by a wrong one (partial acceptance, then a bonus token).
    """
    tokens, parents = [root], [-1]
    if not truth:
        return DraftTree(np.array(tokens), np.array(parents), np.ones(1))
    decoy = (truth[0] + 1) % vocab
    tokens += [decoy, (decoy + 1) % vocab]
    parents += [0, 1]
    prev = 0
    for depth, tok in enumerate(truth, start=1):
        if wrong_at is not None and depth == wrong_at:
            tok = (tok + 7) % vocab
        tokens.append(tok)
        parents.append(prev)
        prev = len(tokens) - 1
    n = len(tokens)
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64),
                     np.linspace(1.0, 0.1, n))


@contextlib.contextmanager
def oracle_drafts(monkeypatch, references: list[list[int]], vocab: int, depth: int = 5):
    """Replaces Drafter.propose by trees built from the known greedy continuations.

    ``references`` are full sequences (prompt + greedy output). A request's history is a prefix
    of exactly one of them; its next ``depth`` tokens form the true path. Every third step
    plants a wrong token at depth 3.
    """
    calls = {"n": 0, "off_chain": 0, "unmatched": 0}
    original = Drafter.propose

    def propose(self: Drafter, req_id, node_budget=None, max_depth=None):
        hist = self.history(req_id)
        for ref in references:
            if ref[:len(hist)] == hist:
                truth = ref[len(hist):len(hist) + depth]
                break
        else:  # the drafter's warm-up, or a diverged engine (the equality check catches it)
            calls["unmatched"] += 1
            return original(self, req_id, node_budget, max_depth)
        calls["n"] += 1
        tree = oracle_tree(hist[-1], truth, vocab, 3 if calls["n"] % 3 == 0 else None)
        calls["off_chain"] += int(tree.num_nodes > 3)
        return tree

    monkeypatch.setattr(Drafter, "propose", propose)
    yield calls
