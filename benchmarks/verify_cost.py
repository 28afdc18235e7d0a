"""What one verification pass costs, by draft nodes and context length: plain decode vs RECAP
chain vs RECAP tree, in one run on one engine kind (issue 13's yardstick).

    python -m benchmarks.verify_cost                      # SmolLM2, dtype auto, 3 contexts
    python -m benchmarks.verify_cost --contexts 500 --nodes 1,5,17 --rounds 5

Every engine runs one request at a time whose drafts are forced: the drafter returns a tree
of exactly n nodes (a chain for ``chain``, a bushy breadth-first tree of width 4 for ``tree``)
with tokens the target never picks, so every step verifies n drafts on the same context.
A step's time is the wall time of ``LLMEngine.step()`` (the whole pass: forward, sampling,
RECAP's own work); the figure is the median over ``--steps`` steps after a warm-up, and the
three modes run in turn in each of ``--rounds`` rounds (tree / chain is taken within a round:
on a shared host, modes run one after another drifted by more than the effect).
``plain`` is vLLM without speculation (one token per pass). Ratios T(n) / T_plain are what
to read: the machine is shared and absolute times drift.

``paired`` (a fourth engine per round) is the steadier tree / chain figure: one tree-mode
engine whose forced draft is a chain or a tree drawn at random each step, so both shapes run
interleaved under the same host load (a chain in a tree-mode engine takes the same path as in
a chain-mode one: vLLM's kernel and rejection sampler). Its ratio is the median tree step
over the median chain step of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process

OUT = Path(__file__).resolve().parent / "results" / "verify_cost"
WIDTH = 4  # branching of the forced bushy trees
# KV cache per engine: RECAP keeps 1/16 of it (16-128 blocks) as tree scratch, and a tree that
# does not fit is recomputed densely; at 2048 MiB SmolLM2 keeps 128 blocks of 32, enough for
# the bushy 64-node tree's 48 paths (512 MiB kept 43: n = 64 measured the dense fallback).
KV_CACHE_MIB = 2048


def forced_tree(root: int, n: int, shape: str, vocab: int):
    """A DraftTree of n nodes (root included) whose drafts the target will not accept."""
    from vllm_recap.core.tree import DraftTree

    parents = [-1] + [(i - 1) if shape == "chain" else (i - 1) // WIDTH for i in range(1, n)]
    tokens = [root] + [vocab - 1 - i for i in range(1, n)]  # rare ids: rejected every step
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64), np.ones(n))


def time_steps(llm, prompt: list[int], steps: int, label=None) -> list:
    """Wall seconds of each engine step of one request (after its prefill); with ``label``
    (a function called before each step: what that step verifies), (label, seconds) pairs."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    engine.add_request("cost", TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        tag = label() if label is not None else None
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        times.append(seconds if label is None else (tag, seconds))
    return times[3:3 + steps]  # skip prefill and the first decodes (no drafts yet)


def _row(mode: str, context: int, n: int, seconds) -> dict:
    ms = np.asarray(seconds) * 1e3
    return dict(mode=mode, context=context, nodes=n, median_ms=float(np.median(ms)),
                p10_ms=float(np.percentile(ms, 10)), p90_ms=float(np.percentile(ms, 90)),
                samples=int(ms.shape[0]))


def measure(model: str, dtype: str, mode: str, contexts: list[int], nodes: list[int],
            steps: int, kv_cache_mib: int = KV_CACHE_MIB) -> list[dict]:
    """Rows (mode, context, nodes, median ms, p10, p90) for one engine kind; mode "paired"
    gives rows "paired-chain" and "paired-tree" from one tree-mode engine (2 x ``steps``
    steps, the shape drawn per step)."""
    from vllm import LLM

    from vllm_recap.core.drafter import Drafter
    from vllm_recap.models.engine import engine_kwargs, shutdown_llm

    size = {"n": 1, "shape": "chain" if mode == "chain" else "tree"}
    original = Drafter.propose
    draw = np.random.default_rng(1)

    def propose(self, req_id, node_budget=None, max_depth=None):
        if req_id == "warmup":
            return original(self, req_id, node_budget, max_depth)
        if mode == "paired":  # what the next step verifies
            size["shape"] = ("chain", "tree")[int(draw.integers(2))]
        return forced_tree(self.history(req_id)[-1], size["n"], size["shape"],
                           self.vocab_size)

    spec = None
    if mode != "plain":
        spec = {"method": "recap", "budget_policy": "fixed", "batch_node_budget": 0,
                "node_budget": max(nodes), "suffix_len": 0, "max_depth": 64,
                "draft_mode": "chain" if mode == "chain" else "tree"}
    Drafter.propose = propose
    llm = LLM(**engine_kwargs(model, dtype=dtype, kv_cache_mib=kv_cache_mib,
                              max_model_len=max(contexts) + 4 * steps + max(nodes) + 64,
                              speculative_config=spec))
    rng = np.random.default_rng(0)
    rows = []
    try:
        for context in contexts:
            prompt = rng.integers(100, 20000, context).tolist()
            for n in ([1] if mode == "plain" else nodes):
                size["n"] = n
                time_steps(llm, prompt, 2)  # warm this shape
                if mode != "paired":
                    rows.append(_row(mode, context, n, time_steps(llm, prompt, steps)))
                    continue
                timed = time_steps(llm, prompt, 2 * steps, label=lambda: size["shape"])
                for shape in ("chain", "tree"):
                    rows.append(_row(f"paired-{shape}", context, n,
                                     [t for tag, t in timed if tag == shape]))
    finally:
        Drafter.propose = original
        shutdown_llm(llm)
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    """The table: per (context, n), medians over rounds of each mode's per-round median, and
    tree / chain as the median [min-max] of the per-round ratios (modes run in turn within a
    round, so a ratio compares passes minutes apart at most)."""
    def per_round(mode):
        return {(r.get("round", 0), r["context"], r["nodes"]): r["median_ms"]
                for r in rows if r["mode"] == mode}

    plain, chain, tree = per_round("plain"), per_round("chain"), per_round("tree")
    pchain, ptree = per_round("paired-chain"), per_round("paired-tree")
    rounds = sorted({k[0] for k in tree})
    lines = [f"# Verification pass cost ({meta['model']}, {meta['dtype']}, {meta['cpu']})", "",
             f"{meta['date']}; {len(rounds)} round(s), each running plain, chain and tree in "
             f"turn; a mode's figure is the median over rounds of its median of "
             f"{meta['steps']} steps; T = ms per engine step of one request verifying n "
             "tokens (root + n - 1 drafts); x plain = T / T(plain decode) at the same context; "
             "tree/chain = median [min-max] over rounds of the same round's tree pass over its "
             "chain pass of the same n; paired = the same, from one tree-mode engine drawing "
             "the shape per step (both shapes under the same host load). Tree-mode engines "
             "(tree, paired) run RECAP's CPU default block size 32, plain and chain vLLM's 128"
             + (f"; KV cache {meta['kv_cache_mib']} MiB per engine" if meta.get("kv_cache_mib")
                else "") + ".", "",
             "| context | n | plain ms | chain ms (x plain) | tree ms (x plain) | tree / chain "
             "| tree / chain, paired |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    cells = sorted({(k[1], k[2]) for k in tree})
    for c, n in cells:
        t = float(np.median([tree[(r, c, n)] for r in rounds]))
        ps = [plain[(r, c, 1)] for r in rounds if (r, c, 1) in plain]
        chs = [chain[(r, c, n)] for r in rounds if (r, c, n) in chain]
        p = float(np.median(ps)) if ps else None
        ch = float(np.median(chs)) if chs else None
        ratios = [tree[(r, c, n)] / chain[(r, c, n)] for r in rounds if (r, c, n) in chain]
        paired = [ptree[(r, c, n)] / pchain[(r, c, n)] for r in rounds
                  if (r, c, n) in ptree and (r, c, n) in pchain]
        lines.append("| " + " | ".join([
            f"{c}", f"{n}", f"{p:.1f}" if p else "",
            f"{ch:.1f} ({ch / p:.2f})" if ch and p else "",
            f"{t:.1f} ({t / p:.2f})" if p else f"{t:.1f}", _spread(ratios),
            _spread(paired)]) + " |")
    return "\n".join(lines) + "\n"


def _spread(ratios: list[float]) -> str:
    """median [min-max] over rounds (one round: the ratio alone)."""
    if len(ratios) > 1:
        return f"{np.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
    return f"{ratios[0]:.2f}" if ratios else ""


def parser() -> argparse.ArgumentParser:
    """The command line (its defaults are what the README's figures use)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.verify_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--contexts", default="100,500,1000")
    p.add_argument("--nodes", default="1,5,9,17,33,64")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each running plain, chain, tree and paired in turn (default: "
                        "3): on a shared host one mode after another drifts by more than the "
                        "effect")
    p.add_argument("--kv-cache-mib", type=int, default=KV_CACHE_MIB,
                   help=f"KV cache per engine (default {KV_CACHE_MIB}): large enough that "
                        "every forced tree fits RECAP's scratch reserve (else it is "
                        "recomputed densely and the row measures that fallback)")
    p.add_argument("--out", type=Path, default=OUT)
    return p


def main(argv: list[str] | None = None) -> dict:
    import datetime

    from benchmarks.machine import cpu_model, resolve_dtype
    from vllm_recap.models import resolve_model

    p = parser()
    args = p.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    model, dtype = str(resolve_model(args.model)), resolve_dtype(args.dtype)
    rows = []
    for r in range(args.rounds):
        for mode in ("plain", "chain", "tree", "paired"):
            rows += [dict(row, round=r)
                     for row in measure(model, dtype, mode, contexts, nodes, args.steps,
                                        args.kv_cache_mib)]
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), model=args.model,
                dtype=dtype, cpu=cpu_model(), steps=args.steps, rounds=args.rounds,
                kv_cache_mib=args.kv_cache_mib)
    result = {"meta": meta, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    (args.out / "summary.md").write_text(to_markdown(meta, rows))
    print(to_markdown(meta, rows))
    return result


if __name__ == "__main__":
    main()
