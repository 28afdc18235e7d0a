"""benchmarks.proposer_profile logging every seeding step (prompt rows, their seconds, the step's own LM-head rows,
the joined call's seconds, the own rows' estimate) to a JSON file:
log_seeding_calls.py FLOOR SECONDS OUT.json <proposer_profile args> (run with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
import sys, json, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import vllm_recap.vllm.seeding as seeding
import vllm_recap.vllm.driver as driver
seeding.MIN_ROWS_PER_STEP = int(sys.argv[1])
seeding.SEED_SECONDS_PER_STEP = float(sys.argv[2])
log = []; cur = {}
orig = seeding.PromptSeeder.observe
def observe(self, rows, seconds):
    log.append((rows, seconds, cur.get("n"), cur.get("call"), cur.get("own")))
    return orig(self, rows, seconds)
seeding.PromptSeeder.observe = observe
olog = driver.StepDriver._logits
def _logits(self, h):
    cur["n"] = h.shape[0]
    t = time.perf_counter(); out = olog(self, h); cur["call"] = time.perf_counter() - t
    cur["own"] = self.lm_head.estimate(h.shape[0])
    return out
driver.StepDriver._logits = _logits
from benchmarks import proposer_profile
try:
    proposer_profile.main(sys.argv[4:])
finally:
    json.dump(log, open(sys.argv[3], "w"))
