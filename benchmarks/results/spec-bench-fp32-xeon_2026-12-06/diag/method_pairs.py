"""Method against method per prompt (median seconds over repeats), geo-mean per category:
independent of the `none` baseline's runs."""
import json, math, sys, collections, statistics
d = json.load(open(sys.argv[1]))
sec = collections.defaultdict(lambda: collections.defaultdict(list))
cat = {}
for j in d['jobs']:
    if j['phase'] != 'spec_bench' or j['concurrency'] != 1: continue
    for r in j['requests']:
        sec[j['method']][r['prompt_id']].append(r['seconds']); cat[r['prompt_id']] = r['category']
med = {m: {p: statistics.median(v) for p, v in ps.items()} for m, ps in sec.items()}
def geo(xs): return math.exp(sum(map(math.log, xs)) / len(xs))
a = sys.argv[2]; others = sys.argv[3].split(',')
cats = list(dict.fromkeys(cat[p] for p in med[a]))
print("| category | " + " | ".join(f"{a} / {o}" for o in others) + " |")
print("|---|" + "---|" * len(others))
for c in cats + ['all']:
    ps = [p for p in med[a] if c == 'all' or cat[p] == c]
    cells = [geo([med[o][p] / med[a][p] for p in ps]) for o in others]
    print(f"| {c} | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
