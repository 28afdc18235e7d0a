"""Seeded sampled rows drawn as vLLM's CPU sampler draws them, position by position.

The oracle is vLLM's own ``TopKTopPSampler.forward_cpu`` with the request's generator at the
state it has, without speculation, when it samples that position (seed draws: one per output
token); ``process_tree_logits`` is tested against vLLM's sequential processing elsewhere
(test_tree_sampling.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_tree_sampling import random_forest
from vllm_recap.vllm.candidate_walk import CANDIDATES, walk_rows
from vllm_recap.vllm.seeded import SeedStream, gumbel_tokens, replays_vllm_draws
from vllm_recap.vllm.tree_sampling import RequestSampling, process_tree_logits
from vllm_recap.vllm.tree_walk import verify_trees, walk_visited

pytestmark = pytest.mark.unit


def _vllm_draw(row: torch.Tensor, generator: torch.Generator) -> int:
    """vLLM's CPU sampler on one processed row (temperature and filters already applied)."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    assert replays_vllm_draws(type("S", (), {"topk_topp_sampler": sampler})())
    token, _ = sampler(row.clone().reshape(1, -1), {0: generator}, None, None)
    return int(token[0])


def test_streams_give_vllms_draw_at_every_position():
    """Output token k of a request sampled without speculation == gumbel_tokens at stream
    draw k, and the generator at ``state_at(k)`` draws it too, whatever order the stream is
    asked in (a step's deeper rows first, restarts after a preemption)."""
    rng = np.random.default_rng(0)
    seed = 1234
    vllm_gen = torch.Generator().manual_seed(seed)  # as InputBatch seeds a request's
    stream = SeedStream(seed)
    rows = torch.from_numpy(rng.standard_normal((12, 500)).astype(np.float32) * 3)
    rows[:, 400:] = -torch.inf  # cut entries, as top-k/top-p leave them
    want = [_vllm_draw(rows[k], vllm_gen) for k in range(12)]  # sequential decoding
    ahead = stream.seeds(3, 6)  # a step at output index 3 with rows down to depth 5
    assert gumbel_tokens(rows[3:9], ahead).tolist() == want[3:9]
    assert gumbel_tokens(rows[:4], stream.seeds(0, 4)).tolist() == want[:4]  # restart
    for k in (7, 2, 11):
        gen = torch.Generator()
        gen.set_state(stream.state_at(k))
        assert _vllm_draw(rows[k], gen) == want[k]
    assert stream.seeds(11, 1) == (stream.seeds(8, 4)[3],)


def _requests(rng, vocab, kinds):
    """Sampled requests with position seeds, unseeded sampled and greedy ones."""
    out = []
    for kind in kinds:
        prompt = rng.integers(0, vocab, 20).tolist()
        output = rng.integers(0, vocab, 6).tolist()
        seeds = tuple(int(s) for s in rng.integers(0, 2**31, 12))
        if kind == "greedy":
            out.append(RequestSampling(prompt, output, temperature=0.0, repetition_penalty=1.1))
        elif kind == "text":  # Qwen2.5's text settings: the candidate walk takes them
            out.append(RequestSampling(prompt, output, temperature=0.7, top_k=20, top_p=0.8,
                                       repetition_penalty=1.05, position_seeds=seeds))
        elif kind == "t1":
            out.append(RequestSampling(prompt, output, temperature=1.0, position_seeds=seeds))
        else:  # unseeded, drawn at uniforms
            out.append(RequestSampling(prompt, output, temperature=0.8, top_p=0.9))
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_seeded_rows_draw_vllms_token_on_every_walk(data):
    """Every walk (all rows processed, visited rows only, candidates with lazy draws) takes
    vLLM's draw at the row's position seed from the row vLLM would sample (a wrong row --
    unfiltered, or another node's -- or another seed would draw other tokens: the rows are
    spread, up to 1000 wide)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    vocab = data.draw(st.sampled_from([200, 1000]))
    kinds = data.draw(st.lists(st.sampled_from(["greedy", "text", "t1", "plain"]),
                               min_size=1, max_size=3))
    requests = _requests(rng, vocab, kinds)
    tree = random_forest(rng, requests, [data.draw(st.integers(1, 8)) for _ in requests],
                         n_tokens=30)
    logits = torch.from_numpy(rng.standard_normal((tree.num_nodes, vocab)).astype(np.float32)
                              * data.draw(st.sampled_from([1.0, 4.0])))
    processed = process_tree_logits(logits, tree, requests)
    seeded = np.array([requests[r].position_seeds is not None for r in tree.req])
    want = {}
    for n in np.flatnonzero(seeded).tolist():  # vLLM's draw at that seed (the test above)
        seed = requests[tree.req[n]].position_seeds[tree.depth[n]]
        want[n] = int(gumbel_tokens(processed[n:n + 1], [seed])[0])
    every = verify_trees(processed, tree, requests).target
    assert all(every[n] == t for n, t in want.items())
    walk, visited, _ = walk_visited(lambda nodes: logits[torch.from_numpy(nodes)], tree,
                                    requests)
    assert all(walk.target[n] == want[n] for n in visited.tolist() if n in want)
    if all(k in ("text", "greedy") for k in kinds):
        path = tree.path_tokens()
        top = torch.topk(logits, CANDIDATES, dim=1)
        rows = walk_rows(top.values.numpy(), top.indices.numpy().astype(np.int64), tree.req,
                         [path[n, :tree.depth[n]].tolist() for n in range(tree.num_nodes)],
                         requests, 8, lambda r: logits[r])
        assert set(want) <= rows.pending  # drawn only when a walk reaches them
        assert all(rows.resolve(n) == t for n, t in want.items())

