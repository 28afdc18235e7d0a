"""What each proposal's best chain would have accepted, against what the budget expected.

    python -m benchmarks.replay --concurrency 4                 # 26 prompts x 64, greedy
    python -m benchmarks.replay --concurrency 1 --depth 4 --out replay.json

Greedy decoding is deterministic, so the tokens a request goes on to commit are the tokens
any draft of it is checked against -- whether or not the budget let the draft be verified.
The engine runs greedy requests with ``max_num_seqs`` = concurrency (all prompts submitted
at once, as ``benchmarks.interleave``), and every proposal the driver builds is recorded: the
request, its committed tokens at the time, its tree's best chain (the first ``--depth`` nodes)
with the calibrated acceptance probability the budget prices each node by, and how many
draft tokens the step actually scheduled for it. Afterwards each chain is replayed against
the request's output: a node counts as accepted while it equals the token committed at its
position. Proposals are grouped by whether they were drafted or declined, in full batches
(``concurrency`` requests proposing) or not, and while the batch drained or not.

What it answers: are the budget's declines right (a declined chain that would have accepted
much is a decline that cost), and is the calibration right where it is not chosen (the
outcome correction of ``LevelOutcomes`` learns only on chosen levels)? Measured 2026-12-05
(Intel Xeon, bf16, concurrency 4): declined two-node chains would have accepted 0.11 tokens
per request (0.075 expected); drafted ones 0.55 (0.54), see
``benchmarks/results/idle-share-xeon_2026-12-05/``. Idle steps propose nothing and are not
in the replay. In bfloat16 a speculative run's output may differ from plain decoding's; the
replay checks drafts against the run's own output, which is what its verifier saw.

It also checks the calibration where it is chosen: every verified node's P(accepted), as the
budget's calibration gave it just before its tree's outcome was observed, against whether it
was accepted, by node source (memory rows, the request's own continuation, the shared index,
or several) and depth (``calibration`` in the JSON, the second table). Measured 2026-12-07
(AMD EPYC AVX-512, bf16, concurrency 4): with one factor for every source, memory-only nodes
were accepted 0.29x as often as estimated and the request's continuations 0.82x; with a factor
per source 0.38x and 0.84x, see ``benchmarks/results/source-calibration-epyc-avx512_2026-12-07/``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from vllm_recap.core.tree import SOURCE_MEMORY, SOURCE_SHARED, SOURCE_SUFFIX

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process


@dataclass
class Proposal:
    """One request's proposal at the end of one engine step.

    Attributes:
        step: the driver's proposing step (counts ``propose`` calls).
        request: vLLM's request id.
        num_tokens: the request's committed tokens (prompt + output) when it was proposed.
        chain: the first nodes of its tree's best chain (draft token ids, root excluded).
        probs: the budget's calibrated P(accepted) of each chain node.
        scheduled: draft tokens the step sent for it (0: declined).
        proposing: requests proposing in that step.
        draining: the batch was draining (only its longest requests propose).
    """

    step: int
    request: str
    num_tokens: int
    chain: list[int]
    probs: list[float]
    scheduled: int = 0
    proposing: int = 0
    draining: bool = False


def accepted_prefix(chain: list[int], tokens: list[int], start: int) -> int:
    """How many leading chain nodes equal ``tokens[start:]`` (the tokens committed after the
    proposal)."""
    n = 0
    for token in chain:
        if start + n >= len(tokens) or tokens[start + n] != token:
            break
        n += 1
    return n


def replay(proposals: Iterable[Proposal], outputs: dict[str, list[int]], full: int,
           depth: int) -> dict[str, dict[str, float]]:
    """Replayed against expected acceptance, per group of proposals.

    Args:
        proposals: the recorded proposals.
        outputs: request id -> its prompt and output tokens (proposals of requests missing
            here are skipped).
        full: proposing requests that make a full batch (the concurrency).
        depth: chain nodes replayed (at most).

    Returns:
        group ("drafted" | "declined", then "full" | "partial", then "" | " drain") ->
        proposals, mean replayed accepted nodes (``accepted``), mean expected (``expected``:
        the sum of the nodes' probabilities), and the share of proposals with any chain.
    """
    groups: dict[str, list[tuple[int, float, bool]]] = {}
    for p in proposals:
        tokens = outputs.get(p.request)
        if tokens is None or p.num_tokens >= len(tokens):
            continue  # the proposal after the request's last token: nothing to check
        chain = p.chain[:depth]
        key = (f"{'drafted' if p.scheduled else 'declined'} "
               f"{'full' if p.proposing >= full else 'partial'}{' drain' if p.draining else ''}")
        groups.setdefault(key, []).append(
            (accepted_prefix(chain, tokens, p.num_tokens), sum(p.probs[:depth]), bool(chain)))
    return {key: {"proposals": len(rows),
                  "accepted": statistics.fmean(r[0] for r in rows),
                  "expected": statistics.fmean(r[1] for r in rows),
                  "with_chain": statistics.fmean(r[2] for r in rows)}
            for key, rows in sorted(groups.items())}


# DraftTree.sources bits, named for the table (the metrics line's names: core.calibration.SOURCES)
SOURCE_NAMES = ((SOURCE_MEMORY, "memory"), (SOURCE_SUFFIX, "continuation"),
                (SOURCE_SHARED, "shared index"))


def source_name(mask: int) -> str:
    """'memory', 'continuation + shared index', ... for a node's source bit mask."""
    return " + ".join(name for bit, name in SOURCE_NAMES if mask & bit) or "untracked"


def calibration_table(nodes: Iterable[tuple[int, int, float, bool]], deepest: int = 4
                      ) -> dict[str, dict[str, float]]:
    """Verified nodes' calibrated P(accepted) against acceptance, by source and depth.

    Args:
        nodes: (source mask, depth, P, accepted) of every verified draft node.
        deepest: depths from this one on are pooled ("4+").

    Returns:
        "<source>, all depths" and "<source>, depth <d>" -> nodes, expected (sum of P),
        accepted (count) and accepted / expected (``ratio``; 1 is calibrated).
    """
    sums: dict[str, list[float]] = {}
    for mask, depth, p, accepted in nodes:
        name = source_name(mask)
        d = f"{deepest}+" if depth >= deepest else str(depth)
        for key in (f"{name}, all depths", f"{name}, depth {d}"):
            row = sums.setdefault(key, [0, 0.0, 0])
            row[0] += 1
            row[1] += p
            row[2] += int(accepted)
    return {key: {"nodes": n, "expected": e, "accepted": a, "ratio": a / e if e else float("nan")}
            for key, (n, e, a) in sorted(sums.items())}


def record_verified(budget) -> list[tuple[int, int, float, bool]]:
    """Wraps the budget's ``observe_tree`` in place; returns the list it fills with
    (source mask, depth, P, accepted) per verified draft node of trees with sources, P from
    the calibration before the tree is observed."""
    nodes: list[tuple[int, int, float, bool]] = []
    observe = budget.observe_tree

    def observe_tree(parents, scores, accepted, depths=None, kind="greedy", sources=None):
        if len(parents) > 1 and sources is not None and depths is not None:
            probs = budget.calibration(kind).probability_list(depths, parents, scores, sources)
            hits = (set(range(1, int(accepted) + 1)) if np.isscalar(accepted)
                    else set(np.asarray(accepted).tolist()))
            nodes.extend((int(sources[v]), int(depths[v]), probs[v], v in hits)
                         for v in range(1, len(parents)))
        return observe(parents, scores, accepted, depths, kind, sources)

    budget.observe_tree = observe_tree
    return nodes


def record(driver, depth: int) -> list[Proposal]:
    """Wraps the driver's ``_draft`` and ``propose`` in place; returns the list they fill."""
    proposals: list[Proposal] = []
    pending: dict[str, Proposal] = {}
    draft, propose = driver._draft, driver.propose
    steps = [0]

    def _draft(runner, req_id, node_budget, room):
        tree = draft(runner, req_id, node_budget, room)
        path = tree.first_path()
        probs = driver.budget.calibration(driver._kind(runner, req_id)).probability_list(
            path.depths, path.parents, path.scores, path.sources)
        row = runner.input_batch.req_id_to_index[req_id]
        pending[req_id] = Proposal(steps[0], req_id,
                                   int(runner.input_batch.num_tokens_no_spec[row]),
                                   path.tokens[1:1 + depth].tolist(), probs[1:1 + depth])
        return tree

    def _propose(runner, scheduler_output, sampled_token_ids, hidden_states):
        pending.clear()
        drafts = propose(runner, scheduler_output, sampled_token_ids, hidden_states)
        for req_id, sent in zip(runner.input_batch.req_ids, drafts):
            p = pending.get(req_id)
            if p is not None:
                p.scheduled, p.proposing, p.draining = len(sent), len(pending), \
                    driver.drain.draining
                proposals.append(p)
        steps[0] += 1
        return drafts

    driver._draft, driver.propose = _draft, _propose
    return proposals


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default='{"method": "recap"}', help="speculative_config (JSON)")
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 | gemma3 (the embedded models) | a local HF folder")
    ap.add_argument("--prompts", type=int, default=26,
                    help="Spec-Bench prompts (benchmarks.workloads.first_spec_bench_prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4, help="max_num_seqs")
    ap.add_argument("--depth", type=int, default=2, help="chain nodes replayed")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None, help="also write the groups to this JSON file")
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.depth < 1:
        ap.error("--concurrency and --depth must be at least 1")

    from vllm import LLM, SamplingParams, TokensPrompt

    from benchmarks.harness import model_runner
    from benchmarks.machine import cpu_line
    from benchmarks.workloads import first_spec_bench_prompts
    from vllm_recap.models import resolve_model
    from vllm_recap.models.engine import engine_kwargs, shutdown_llm

    llm = LLM(**engine_kwargs(resolve_model(args.model), dtype=args.dtype,
                              speculative_config=json.loads(args.spec),
                              max_num_seqs=args.concurrency))
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in
               first_spec_bench_prompts(llm.get_tokenizer(), args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (not recorded)
    driver = model_runner(llm).drafter.recap_hooks
    proposals = record(driver, args.depth)
    verified = record_verified(driver.budget)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    # the engine's request ids carry a suffix after the one ``generate`` returns
    by_id = {o.request_id: [*o.prompt_token_ids, *o.outputs[0].token_ids] for o in outs}
    outputs = {r: by_id[base] for r in {p.request for p in proposals}
               if (base := r.rsplit("-", 1)[0]) in by_id}
    groups = replay(proposals, outputs, args.concurrency, args.depth)
    result = {"machine": cpu_line(), "model": args.model, "dtype": args.dtype,
              "spec": json.loads(args.spec), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
              "depth": args.depth, "wall_s": wall, "proposals": len(proposals),
              "groups": groups, "calibration": calibration_table(verified)}
    print(f"{result['machine']}, {args.model}, dtype {args.dtype}, spec {args.spec}, "
          f"concurrency {args.concurrency}, {len(prompts)} prompts x {args.max_new_tokens}")
    print(f"{len(proposals)} proposals; first {args.depth} nodes of each best chain replayed")
    print("| proposals | n | accepted | expected | with a chain |\n|---|---|---|---|---|")
    for key, g in groups.items():
        print(f"| {key} | {g['proposals']} | {g['accepted']:.3f} | {g['expected']:.3f} | "
              f"{g['with_chain']:.2f} |")
    print(f"\n{len(verified)} verified draft nodes: calibrated P(accepted) against acceptance")
    print("| source, depth | nodes | expected | accepted | accepted / expected |\n|---|---|---|---|---|")
    for key, g in result["calibration"].items():
        print(f"| {key} | {g['nodes']} | {g['expected']:.1f} | {g['accepted']} | {g['ratio']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**result, "records": [asdict(p) for p in proposals]}, f)
    shutdown_llm(llm)
    return result


if __name__ == "__main__":
    main()
