"""Per-category figures of an interleaved batch-1 run (``benchmarks.interleave`` at
concurrency 1, whose child serves the prompts one at a time and records each request).

Issue 14 asks for RECAP to be at or above the best of vLLM's ngram and suffix decoding in
*every* Spec-Bench category. ``benchmarks.run`` reports categories from methods run one after
another, which on a shared 2-core host mixes the machine's drift (+-10% within minutes) into
every comparison; here each category's speed is paired with the ``none`` run of its own round,
as the whole run's is, and the spread over rounds shows what one round resolves.

A category's speed in one run: its requests' generated tokens over their seconds (submission to
last token, prefill included: the same prompts for every engine). Tokens per pass: a request's
first token comes from its prefill and every later pass commits one token plus the drafts it
accepted, so its decode passes are ``tokens - 1 - accepted``; pooled over the category's
requests and the engine's rounds (vLLM counts a last pass's accepted drafts before the length
limit cuts them, so a request may be off by a few tokens, as in ``interleave.pass_figures``).
"""
from __future__ import annotations

import statistics


def _category_speed(requests: list[dict], members: list[int]) -> float:
    """Generated tokens per second of the requests at ``members`` (prompt indices)."""
    seconds = sum(requests[i]["seconds"] for i in members)
    return sum(requests[i]["tokens"] for i in members) / seconds if seconds > 0 else 0.0


def category_rows(runs: list[dict], names: list[str], categories: list[str]) -> list[dict]:
    """One row per category: per engine, its ratio to the same round's ``none`` in every
    round, their median, min and max, and its pooled tokens per pass.

    Args:
        runs: the interleave runs (``engine``, ``round``, and ``requests`` in prompt order:
            ``tokens``, ``seconds``, ``accepted_tokens``); runs without ``requests`` (errors,
            other loops) are left out.
        names: the engines, in the table's order.
        categories: [prompts] each prompt's category.

    Returns:
        ``[{"category", "engines": {name: {"ratios", "median", "min", "max",
        "tokens_per_pass"}}}]`` in the categories' first-seen order.
    """
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        groups.setdefault(c, []).append(i)
    done = [r for r in runs if len(r.get("requests") or []) == len(categories)]
    rows = []
    for category, members in groups.items():
        # none's speed on the category, per round: what each engine's run is divided by
        plain = {r["round"]: _category_speed(r["requests"], members)
                 for r in done if r["engine"] == "none"}
        cells = {}
        for name in names:
            mine = [r for r in done if r["engine"] == name]
            ratios = [_category_speed(r["requests"], members) / plain[r["round"]]
                      for r in mine if plain.get(r["round"], 0) > 0]
            decoded = sum(r["requests"][i]["tokens"] - 1 for r in mine for i in members)
            passes = decoded - sum(r["requests"][i].get("accepted_tokens", 0)
                                   for r in mine for i in members)
            cells[name] = {"ratios": [round(x, 3) for x in ratios],
                           "median": statistics.median(ratios) if ratios else None,
                           "min": min(ratios) if ratios else None,
                           "max": max(ratios) if ratios else None,
                           "tokens_per_pass": decoded / passes if passes > 0 else None}
        rows.append({"category": category, "engines": cells})
    return rows


# Engine names of this project's methods (benchmarks/methods.py); the rest are vLLM's own.
OURS = ("recap", "token-recycling")


def rivals(name: str, names: list[str]) -> list[str]:
    """The engines ``name`` is counted against: the other family's (RECAP's methods against
    vLLM's ngram and suffix decoding, and the reverse), or every other engine where the run
    has none of the other family. ``none`` never counts."""
    ours = name.startswith(OURS)
    other = [n for n in names if n != "none" and n.startswith(OURS) != ours]
    return other or [n for n in names if n not in (name, "none")]


def leads(rows: list[dict], name: str) -> tuple[int, int]:
    """(categories where ``name``'s median ratio is at or above each of its :func:`rivals`',
    categories with a median for ``name``): issue 14's "every category" count, where RECAP
    tree is to be at or above the best of vLLM's ngram and suffix decoding."""
    won = total = 0
    for row in rows:
        mine = row["engines"].get(name, {}).get("median")
        if mine is None:
            continue
        total += 1
        others = [row["engines"][n]["median"] for n in rivals(name, list(row["engines"]))]
        won += all(mine >= o for o in others if o is not None)
    return won, total


def identical(runs: list[dict], name: str) -> tuple[int, int] | None:
    """(requests whose output equals the same round's ``none`` output, requests compared) of
    ``name`` over its rounds; None where no run recorded its outputs. Greedy float32 outputs
    are the same for every method; in bfloat16 a pass of several tokens rounds differently
    from one-token decoding, so some differ (see README, "About identity in bfloat16")."""
    same = compared = 0
    for r in runs:
        if r["engine"] != name or not r.get("requests"):
            continue
        base = next((b for b in runs if b["engine"] == "none" and b["round"] == r["round"]
                     and b.get("requests")), None)
        if base is None:
            continue
        for mine, ref in zip(r["requests"], base["requests"]):
            if "output_ids" in mine and "output_ids" in ref:
                compared += 1
                same += mine["output_ids"] == ref["output_ids"]
    return (same, compared) if compared else None


def markdown(rows: list[dict], names: list[str],
             identity: dict[str, list[int] | None] | None = None) -> str:
    """The per-category table (median ratio to ``none`` [min-max] and tokens per pass per
    engine), then each speculative engine's count of categories it leads its rivals in, and
    (``identity``: engine -> :func:`identical`) how many of its outputs were ``none``'s."""
    if not rows:
        return ""
    shown = [n for n in names if n != "none"]
    lines = ["## Per category", "",
             "Median over rounds of the category's tokens/s over the same round's `none` "
             "[min-max], and tokens per target pass pooled over rounds.", "",
             "| category | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
    for row in rows:
        cells = []
        for n in shown:
            c = row["engines"][n]
            ratio = ("-" if c["median"] is None else
                     f"{c['median']:.2f}x [{c['min']:.2f}-{c['max']:.2f}]")
            passes = "-" if c["tokens_per_pass"] is None else f"{c['tokens_per_pass']:.2f}"
            cells.append(f"{ratio}, {passes}")
        lines.append(f"| {row['category']} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in shown:
        won, total = leads(rows, n)
        lines.append(f"- {n}: at or above {', '.join(rivals(n, names))} in {won} of "
                     f"{total} categories")
    same = [f"{n} {v[0]}/{v[1]}" for n, v in (identity or {}).items() if v]
    if same:
        lines += ["", "Outputs identical to the same round's `none`, requests over all rounds: "
                  + ", ".join(same) + "."]
    return "\n".join(lines) + "\n"
