"""benchmarks.proposer_profile with the seeding floor and time bound set: ab.py FLOOR SECONDS <proposer_profile args>."""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import vllm_recap.vllm.seeding as seeding
seeding.MIN_ROWS_PER_STEP = int(sys.argv[1])
seeding.SEED_SECONDS_PER_STEP = float(sys.argv[2])
from benchmarks import proposer_profile
proposer_profile.main(sys.argv[3:])
