"""How much recycled evidence a sampling setting's text offers: recurring contexts, stale rows.

    python -m benchmarks.recurrence                        # greedy vs qwen_vl, 26 x 128, bf16
    python -m benchmarks.recurrence --per-category 1 --max-new-tokens 64

RECAP drafts from rows stored after earlier occurrences of the last 1-3 tokens, suffix
decoding from earlier occurrences of the longest matching suffix: both can only draft well
where the text repeats itself. A repetition penalty (Qwen2.5-VL's settings: 1.05) changes the
text, and it also makes a stored row stale: the row was processed with the history of its
own position, and tokens generated since are penalised at the new one.

For each greedy-equivalent setting this decodes Spec-Bench prompts without speculation (vLLM,
``logprobs_mode="raw_logits"``: the unprocessed logits of the top ``--top`` tokens of every
prompt and output position) and counts, over the generated positions, for contexts of C = 1,
2 and 3 tokens:

- *recurring*: the C tokens before the position occurred together earlier (prompt or output);
- *stored hit*: the row after their latest earlier occurrence, processed with the history of
  that occurrence (what RECAP's memory holds; prompt rows with the whole prompt, as
  ``vllm_recap.vllm.memory_rows`` seeds them), ranks the generated token first;
- *re-processed hit*: the same raw row processed with the current history instead (what a
  penalty-aware re-ranking of memory rows at draft time would give).

A sanity figure checks the processing: each position's own row, processed with its own
history, must rank the generated token first (the greedy-equivalent contract; ties and tokens
outside the top ``--top`` make it fall just short of 100%).

Results: ``<out>/result.json`` and ``summary.md``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process

REPO = Path(__file__).resolve().parents[1]
CONTEXTS = (1, 2, 3)
# SamplingParams keys this script knows how to reproduce from raw logits (greedy-equivalent
# settings only: temperature / top-k / top-p cannot move the argmax)
HANDLED = {"temperature", "top_k", "top_p", "repetition_penalty"}


def process(row: dict[int, float], seen: set[int], penalty: float) -> int:
    """The argmax of one raw row under vLLM's repetition penalty over ``seen`` (lowest id
    among equal values, vLLM's rule), with the project's own copy of vLLM's float32 penalty
    ops (:func:`~vllm_recap.vllm.tree_sampling.penalise_candidates`).

    Args:
        row: token id -> raw logit, the top tokens of one position.
        seen: token ids of the history (prompt + output so far).
        penalty: repetition penalty (1.0: none).
    """
    from vllm_recap.vllm.tree_sampling import RequestSampling, penalise_candidates

    ids = np.fromiter(row.keys(), np.int64, len(row))[None]
    values = np.fromiter(row.values(), np.float32, len(row))[None]
    # the repetition penalty covers prompt + output alike: the history can stand as the prompt
    state = RequestSampling(prompt_token_ids=list(seen), output_token_ids=(),
                            repetition_penalty=penalty)
    v = penalise_candidates(values, ids, np.zeros(1, np.int64), [[]], [state])[0]
    return int(ids[0][v == v.max()].min())


def count(prompt: list[int], output: list[int], rows: dict[int, dict[int, float]],
          penalty: float) -> dict:
    """The figures of one request.

    Args:
        prompt: [P] prompt ids; output: [O] generated ids.
        rows: position i -> raw row predicting token i (i in [1, P + O)); positions vLLM gave
            no row for are missing.
        penalty: the setting's repetition penalty.
    """
    seq = prompt + output
    n_prompt = len(prompt)
    figures = {"positions": 0, "own_row_ok": 0,
               **{f"c{c}_{k}": 0 for c in CONTEXTS for k in ("recurring", "stored", "reprocessed")}}
    latest: dict[int, dict[tuple, int]] = {c: {} for c in CONTEXTS}
    seen: set[int] = set()
    for i in range(len(seq)):
        if i >= n_prompt and i in rows:
            figures["positions"] += 1
            figures["own_row_ok"] += process(rows[i], seen, penalty) == seq[i]
            for c in CONTEXTS:
                s = latest[c].get(tuple(seq[i - c:i])) if i >= c else None
                if s is None or s not in rows:
                    continue
                figures[f"c{c}_recurring"] += 1
                stored_seen = set(prompt) if s < n_prompt else set(seq[:s])
                figures[f"c{c}_stored"] += process(rows[s], stored_seen, penalty) == seq[i]
                figures[f"c{c}_reprocessed"] += process(rows[s], seen, penalty) == seq[i]
        for c in CONTEXTS:
            if i >= c:
                latest[c][tuple(seq[i - c:i])] = i
        seen.add(seq[i])
    return figures


def run_setting(llm, prompts, setting: str, max_new_tokens: int, top: int) -> dict:
    """Decodes every prompt under one setting; returns summed figures and shares."""
    from vllm import SamplingParams, TokensPrompt

    from benchmarks.sampling import SAMPLINGS

    s = SAMPLINGS[setting]
    unknown = set(s.params) - HANDLED
    if not s.deterministic or unknown:
        raise SystemExit(f"setting {setting!r} is not greedy-equivalent with only "
                         f"{sorted(HANDLED)} ({sorted(unknown) or 'sampled'}): its argmax "
                         "cannot be reproduced from raw logits here")
    penalty = float(s.params.get("repetition_penalty", 1.0))
    params = SamplingParams(**s.params, max_tokens=max_new_tokens, logprobs=top,
                            prompt_logprobs=top)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts], params,
                        use_tqdm=False)
    total: dict[str, int] = {}
    for p, out in zip(prompts, outs):
        rows = {i: {t: lp.logprob for t, lp in d.items()}
                for i, d in enumerate(out.prompt_logprobs or []) if d}
        gen = out.outputs[0]
        rows.update({len(p.token_ids) + j: {t: lp.logprob for t, lp in d.items()}
                     for j, d in enumerate(gen.logprobs or [])})
        for k, v in count(list(p.token_ids), list(gen.token_ids), rows, penalty).items():
            total[k] = total.get(k, 0) + v
    n = max(1, total["positions"])
    shares = {"own_row_ok": total["own_row_ok"] / n}
    for c in CONTEXTS:
        rec = total[f"c{c}_recurring"]
        shares[f"c{c}_recurring"] = rec / n
        for k in ("stored", "reprocessed"):
            shares[f"c{c}_{k}_hit"] = total[f"c{c}_{k}"] / max(1, rec)
            shares[f"c{c}_{k}_hits_per_position"] = total[f"c{c}_{k}"] / n
    return {"setting": s.to_dict(), "counts": total, "shares": shares}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Recycled evidence by sampling setting ({result['date']})", "",
             f"{m['cpu_model']} ({m['cpus']} CPUs), model {result['model']}, dtype {result['dtype']}, "
             f"{result['prompts']} Spec-Bench prompts x {result['max_new_tokens']} tokens, no "
             f"speculation, raw top-{result['top']} rows; git {m.get('git')}.", "",
             "Over generated positions. recurring = the last C tokens occurred earlier; stored "
             "hit = the row after their latest earlier occurrence, processed with that "
             "occurrence's history, ranks the generated token first (share of recurring); "
             "re-processed = the same row processed with the current history.", "",
             "| setting | positions | own row ok | C | recurring | stored hit | re-processed hit "
             "| stored hits / position |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["settings"].items():
        sh, co = r["shares"], r["counts"]
        for c in CONTEXTS:
            lines.append(f"| {name} | {co['positions']} | {sh['own_row_ok']:.3f} | {c} | "
                         f"{sh[f'c{c}_recurring']:.3f} | {sh[f'c{c}_stored_hit']:.3f} | "
                         f"{sh[f'c{c}_reprocessed_hit']:.3f} | "
                         f"{sh[f'c{c}_stored_hits_per_position']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.recurrence",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="greedy,qwen_vl",
                    help="greedy-equivalent settings of benchmarks/sampling.py")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=20, help="raw logits kept per position")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from vllm import LLM

    from benchmarks.machine import machine_info
    from benchmarks.sampling import parse_settings
    from benchmarks.workloads import spec_bench_prompts
    from vllm_recap.models import resolve_model
    from vllm_recap.models.engine import engine_kwargs

    settings = parse_settings(args.settings)
    llm = LLM(**engine_kwargs(resolve_model(args.model), dtype=args.dtype,
                              logprobs_mode="raw_logits", max_logprobs=args.top))
    prompts = spec_bench_prompts(llm.get_tokenizer(), args.per_category, max_prompt_tokens=1536)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(), "model": args.model, "dtype": args.dtype,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "top": args.top,
              "settings": {s: run_setting(llm, prompts, s, args.max_new_tokens, args.top)
                           for s in settings}}
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"recurrence_{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
