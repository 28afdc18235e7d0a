"""Summarises the DEBUG logs of this folder (logs/*.txt.gz): per run, budget decisions,
drafted ones, forced declines, idle-mode switches, and for the drafted steps the measured /
estimated seconds and the accepted / expected drafts.

    python benchmarks/results/budget-debug-log-xeon_2026-12-05/diag/summarize.py
"""
import gzip
import re
import statistics
import sys
from pathlib import Path

OUTCOME = re.compile(r"outcome: (\d+) nodes? as (\w+) estimated ([\d.]+) ms for \+([\d.]+) "
                     r"tokens, ran ([\d.]+) ms for \+(\d+)")


def summary(path: Path) -> str:
    lines = gzip.open(path, "rt").read().splitlines()[1:]  # line 1: the warm-up's last outcome
    decisions = [l for l in lines if "RECAP budget (" in l]
    drafted = sum(": chose " in l and "chose no drafts" not in l for l in decisions)
    forced = sum("no price" in l for l in decisions)
    idle_on = sum("idle mode on" in l for l in lines)
    out = [OUTCOME.search(l).groups() for l in lines if OUTCOME.search(l)]
    ratios = sorted(float(o[4]) / float(o[2]) for o in out)
    q = lambda f: ratios[int(f * (len(ratios) - 1))] if ratios else float("nan")
    expected = sum(float(o[3]) for o in out)
    accepted = sum(int(o[5]) for o in out)
    wall = next((l.split()[-1] for l in lines if l.startswith("WALL")), "?")
    return (f"| {path.name[:-7]} | {wall[:5]} | {len(decisions)} | {drafted} | {forced} | {idle_on} "
            f"| {len(out)} | {q(.5):.2f} [{q(.25):.2f}-{q(.75):.2f}] | {accepted} / {expected:.0f} "
            f"= {accepted / max(expected, 1e-9):.2f} |")


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "logs")
    print("| run | wall s | decisions | drafted | forced declines | idle switches on | "
          "outcomes | measured / estimated s, median [IQR] | accepted / expected drafts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in sorted(folder.glob("*.txt.gz")):
        print(summary(p))
