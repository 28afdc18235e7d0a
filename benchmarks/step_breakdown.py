"""Where a run's wall time went, by kind of engine step (``benchmarks.interleave --steps``).

Across runs the host's speed drifts by +-10% within minutes (the same engine ran 124 and 161
tokens/s in two runs of one session at concurrency 4), the size of what a drafting decision
changes under load. Within one run most of the drift cancels: a run's drafted steps against
its own idle steps, both at the full batch, show what drafting bought in that run -- with a
caveat: RECAP drafts where its memories offer likely drafts, so its drafted steps also run on
other parts of the answers than its idle ones (in the first c=4 run the ratio still spread
0.86-1.26 over four runs).

Step kinds (``kind``): ``arrival`` (the step prefills a new request's first chunk), and for
decode steps: ``drafted`` (it verified draft tokens), ``declined`` (RECAP did its per-step
work but verified no drafts: the budget declined, or a probe), ``idle`` (RECAP skipped its
work) -- ``decode`` for engines without RECAP's records. A step's wall time is the time to
the next step's start (the run's end for the last one).
"""
from __future__ import annotations

import statistics

KINDS = ("arrival", "drafted", "declined", "idle", "decode")


def kind(step: dict) -> str:
    """The kind of one step record (see the module docstring)."""
    if step.get("arrivals", 0) > 0:
        return "arrival"
    if "idle" not in step:
        return "decode"
    if step.get("drafts", 0) > 0:
        return "drafted"
    return "idle" if step["idle"] else "declined"


def walls(steps: list[dict]) -> list[tuple[dict, float]]:
    """(step, seconds) per step; ``steps`` ends with the run's end marker (``{"t": end}``)."""
    return [(s, nxt["t"] - s["t"]) for s, nxt in zip(steps, steps[1:])]


def run_kinds(steps: list[dict]) -> dict[str, dict]:
    """Per kind of one run: steps, seconds, committed tokens (None where not recorded),
    and the same for its full-batch steps (the most requests any decode step ran)."""
    timed = walls(steps)
    full = max((s["reqs"] for s, _ in timed if kind(s) != "arrival"), default=0)
    out: dict[str, dict] = {}
    for s, seconds in timed:
        k = kind(s)
        row = out.setdefault(k, {"steps": 0, "seconds": 0.0, "committed": 0, "full_steps": 0,
                                 "full_seconds": 0.0, "full_committed": 0, "known": True})
        row["steps"] += 1
        row["seconds"] += seconds
        row["known"] &= "committed" in s
        row["committed"] += s.get("committed", 0)
        if s["reqs"] == full:
            row["full_steps"] += 1
            row["full_seconds"] += seconds
            row["full_committed"] += s.get("committed", 0)
    for row in out.values():
        if not row.pop("known"):
            row["committed"] = row["full_committed"] = None
    return out


def drafted_over_idle(kinds: dict[str, dict]) -> float | None:
    """Tokens per second of a run's full-batch drafted steps over its full-batch idle steps
    (None without both, or without committed counts)."""
    d, i = kinds.get("drafted"), kinds.get("idle")
    if not d or not i or not d["full_seconds"] or not i["full_seconds"]:
        return None
    if d["full_committed"] is None or not i["full_committed"]:  # unknown, or none idle
        return None
    return (d["full_committed"] / d["full_seconds"]) / (i["full_committed"] / i["full_seconds"])


def phase_seconds(steps: list[dict]) -> tuple[float, float]:
    """(arrival, decode) seconds of one run: its arrival steps' and all its other steps'."""
    timed = walls(steps)
    arrival = sum(sec for s, sec in timed if kind(s) == "arrival")
    return arrival, sum(sec for _, sec in timed) - arrival


def drain_seconds(steps: list[dict]) -> float:
    """Seconds of one run after its last arrival step: the drain, where nobody takes a
    finished request's place and the run lasts as long as its longest request (the phase
    RECAP's budget prices by the steps drafts take off that request)."""
    timed = walls(steps)
    last = max((i for i, (s, _) in enumerate(timed) if kind(s) == "arrival"), default=-1)
    return sum(sec for _, sec in timed[last + 1:])


def decode_ratios(runs: list[dict], name: str, baseline: str = "none") -> list[float]:
    """Per round, the baseline's decode-phase seconds over the engine's (rounds where both
    recorded steps). Every engine decodes the same tokens and prefills the same prompts, so
    this is the run's speed ratio with the arrival steps taken out: at concurrency 16 those
    are half the wall time and the first one alone took either ~0.5 s or ~1.2-1.6 s for the
    same 1,300 prompt tokens, whatever the engine (26 Spec-Bench prompts, bf16 SmolLM2),
    which swamped what drafting changed. Tokens that arrival steps decode for running
    requests are left in the arrival phase, so the ratio is approximate."""
    base = {r["round"]: r for r in runs if r.get("engine") == baseline and r.get("steps")}
    out = []
    for r in runs:
        if r.get("engine") == name and r.get("steps") and r.get("round") in base:
            mine = phase_seconds(r["steps"])[1]
            if mine > 0:
                out.append(phase_seconds(base[r["round"]]["steps"])[1] / mine)
    return out


def breakdown(runs: list[dict], names: list[str]) -> list[dict]:
    """Per engine and kind, over the engine's runs that recorded steps: steps per run, share
    of the wall time, median ms per step over runs, tokens per step; and per engine the
    per-run ratios :func:`drafted_over_idle` and :func:`decode_ratios`."""
    rows = []
    for name in names:
        mine = [r for r in runs if r.get("engine") == name and r.get("steps")]
        if not mine:
            continue
        per_run = [run_kinds(r["steps"]) for r in mine]
        total = sum(r["wall_s"] for r in mine)
        kinds = []
        for k in KINDS:
            got = [p[k] for p in per_run if k in p]
            if not got:
                continue
            committed = [g["committed"] for g in got]
            kinds.append({
                "kind": k, "steps_per_run": sum(g["steps"] for g in got) / len(mine),
                "wall_share": sum(g["seconds"] for g in got) / total,
                "ms_per_step": statistics.median(1e3 * g["seconds"] / g["steps"] for g in got),
                "tokens_per_step": (None if None in committed else
                                    sum(committed) / sum(g["steps"] for g in got))})
        ratios = [drafted_over_idle(p) for p in per_run]
        rows.append({"engine": name, "runs": len(mine), "kinds": kinds,
                     "drafted_over_idle": [None if x is None else round(x, 3) for x in ratios],
                     "decode_ratio": [round(x, 3) for x in decode_ratios(runs, name)],
                     "arrival_s": [round(p["arrival"]["seconds"] if "arrival" in p else 0.0, 3)
                                   for p in per_run],
                     "drain_s": [round(drain_seconds(r["steps"]), 3) for r in mine],
                     "drafting": drafting([r.get("drafting") for r in mine])})
    return rows


def drafting(counters: list[dict | None]) -> dict | None:
    """vLLM's speculative counters over an engine's runs (each the timed run's delta): draft
    tokens per run, accepted tokens per draft token, draft tokens per drafted request-step
    (vLLM counts a request's drafts in a step as one draft). None without drafts."""
    got = [c for c in counters if c]
    tokens = sum(c["draft_tokens"] for c in got)
    if not tokens:
        return None
    return {"draft_tokens_per_run": tokens / len(got),
            "accepted_per_draft_token": sum(c["accepted_tokens"] for c in got) / tokens,
            "draft_tokens_per_draft": tokens / max(1, sum(c["drafts"] for c in got))}


def markdown(rows: list[dict]) -> str:
    """The breakdown as a markdown section ('' when no run recorded steps)."""
    if not rows:
        return ""
    lines = ["## Steps by kind", "",
             "Share of each engine's wall time (all its runs), steps per run, median ms per "
             "step over runs, tokens committed per step. `drafted / idle` = tokens/s of a run's "
             "full-batch drafted steps over its own full-batch idle steps (drift cancels "
             "within a run, but RECAP drafts where its memories offer likely drafts, so the two kinds "
             "also run on different parts of the answers; see benchmarks/step_breakdown.py).", "",
             "| engine | kind | steps/run | wall share | ms/step | tokens/step |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        for k in row["kinds"]:
            tps = "-" if k["tokens_per_step"] is None else f"{k['tokens_per_step']:.2f}"
            lines.append(f"| {row['engine']} | {k['kind']} | {k['steps_per_run']:.0f} | "
                         f"{100 * k['wall_share']:.0f}% | {k['ms_per_step']:.1f} | {tps} |")
    lines += ["", "| engine | drafted / idle per run |", "|---|---|"]
    for row in rows:
        ratios = [r for r in row["drafted_over_idle"] if r is not None]
        if ratios:
            lines.append(f"| {row['engine']} | {', '.join(f'{r:.2f}' for r in ratios)} "
                         f"(median {statistics.median(ratios):.2f}) |")
    lines += ["", "Decode phase (every step but arrivals): `none`'s seconds over the engine's, "
              "per round -- the speed ratio without the prefill bursts, whose wall time varies "
              "most (see `decode_ratios`); each run's arrival-step seconds; and each run's "
              "drain seconds (after its last arrival, see `drain_seconds`).", "",
              "| engine | decode-phase ratio per round | arrival seconds per run | "
              "drain seconds per run |", "|---|---|---|---|"]
    for row in rows:
        ratios = row.get("decode_ratio") or []
        shown = (f"{', '.join(f'{r:.2f}' for r in ratios)} "
                 f"(median {statistics.median(ratios):.2f})") if ratios else "-"
        lines.append(f"| {row['engine']} | {shown} | "
                     f"{', '.join(f'{a:.2f}' for a in row.get('arrival_s', []))} | "
                     f"{', '.join(f'{a:.2f}' for a in row.get('drain_s', []))} |")
    lines += ["", "vLLM's speculative counters over the timed runs (a request's drafts in one "
              "step count as one draft):", "",
              "| engine | draft tokens per run | accepted per draft token | "
              "draft tokens per draft |", "|---|---|---|---|"]
    for row in rows:
        d = row.get("drafting")
        if d:
            lines.append(f"| {row['engine']} | {d['draft_tokens_per_run']:.0f} | "
                         f"{d['accepted_per_draft_token']:.3f} | "
                         f"{d['draft_tokens_per_draft']:.2f} |")
    return "\n".join(lines) + "\n"
