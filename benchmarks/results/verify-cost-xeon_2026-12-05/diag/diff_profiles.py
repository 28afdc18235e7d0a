"""Per function, a tree step's time less a chain step's (cProfile, per step), from the two
profiles profile_tree_steps.py wrote.

    python diff_profiles.py CHAIN_STEPS TREE_STEPS [DIR]   # step counts it printed
"""
import pstats, sys
DIR = sys.argv[3] if len(sys.argv) > 3 else "."
def load(tag):
    st = pstats.Stats(f"{DIR}/{tag}.prof")
    return st.stats
c, t = load("chain"), load("tree")
nc, nt = float(sys.argv[1]), float(sys.argv[2])
rows = []
keys = set(c) | set(t)
for k in keys:
    ct = c.get(k, (0,0,0,0,{}))
    tt = t.get(k, (0,0,0,0,{}))
    # tottime per step, cumtime per step
    rows.append(((tt[2]/nt - ct[2]/nc)*1e3, (tt[3]/nt - ct[3]/nc)*1e3, tt[1]/nt, ct[1]/nc, f"{k[0].split('site-packages/')[-1]}:{k[1]}:{k[2]}"))
rows.sort(key=lambda r: -r[0])
print("tottime diff ms/step, cum diff, calls/step tree, chain")
for r in rows[:30]:
    print(f"{r[0]:7.3f} {r[1]:7.3f} {r[2]:6.1f} {r[3]:6.1f} {r[4]}")
print("...sum of positive tottime diffs", sum(r[0] for r in rows if r[0]>0), "neg", sum(r[0] for r in rows if r[0]<0))
