"""vllm-recap: RECAP speculative decoding (training-free, draft-model-free) as a vLLM plugin.

``vllm_recap.core`` is the engine-independent algorithm (numpy/numba only);
``vllm_recap.vllm`` adapts it to vLLM. Importing this package imports neither.
"""

__version__ = "0.1.0"
