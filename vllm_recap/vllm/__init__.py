"""The vLLM adapter: proposer class, runner seams, tree attention, tree verification.

Nothing here is imported by ``import vllm_recap``; vLLM imports
:data:`PROPOSER_PATH` (through its ``custom_class`` speculative method) in the worker.
"""

PROPOSER_PATH = "vllm_recap.vllm.proposer.RecapProposer"
