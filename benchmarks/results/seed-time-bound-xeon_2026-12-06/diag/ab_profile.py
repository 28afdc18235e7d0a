"""benchmarks.proposer_profile with the seeding time bound on ("new") or off ("old")."""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import vllm_recap.vllm.seeding as seeding
if sys.argv[1] == "old":
    seeding.SEED_SECONDS_PER_STEP = None
from benchmarks import proposer_profile
proposer_profile.main(sys.argv[2:])
