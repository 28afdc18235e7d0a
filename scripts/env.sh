# Environment for running vLLM on a CPU-only machine; sourced by scripts/main.sh and test.sh.
export VLLM_CPU_NUM_OF_RESERVED_CPU=0   # vLLM otherwise keeps one of two cores idle
export VLLM_TARGET_DEVICE=cpu           # no accelerator here
export HF_HUB_OFFLINE=1                 # no model hub: every model comes from a local folder
export TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1            # no network; don't try to report usage
export DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false     # avoids fork warnings/deadlocks with vLLM's processes
