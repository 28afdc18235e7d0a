"""The speculative methods the benchmark compares, as vLLM ``speculative_config`` dicts.

Every method is a name (what ``--methods`` takes), its config and one line saying what it is.
Groups (``core``, ``budgets``, ``ablations``) name the sets the report is built around.

Where the peers' settings come from:

- ``ngram``: vLLM's documented n-gram example (docs/features/speculative_decoding/n_gram.md):
  ``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}``.
- ``suffix``: vLLM's documented suffix-decoding example
  (docs/features/speculative_decoding/suffix.md: "It is suggested to use a high number such as
  16 or 32 (default)", with ``{"method": "suffix", "num_speculative_tokens": 32}``); the
  other ``suffix_decoding_*`` knobs keep vLLM's defaults (max tree depth 24, max spec factor
  1.0, min token prob 0.1). It needs arctic-inference (benchmarks/SUFFIX_BUILD.md).
- ``token-recycling``: the Token Recycling policy on RECAP's machinery (design.md, section 2).
  Its 80-node template is truncated to the same node budget as ``recap-tree`` (the CPU default,
  16, filled in by vllm_recap.vllm.options) and runs on the same adaptive budget policy, so the
  comparison isolates the policy (U-only memory + static template vs G/C/U fusion +
  best-first), not the budget. ``token-recycling-80`` is the paper's setting (full template,
  always verified) for reference.
"""
from __future__ import annotations

from dataclasses import dataclass

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 32}

# Ablations run at one FIXED node budget, so a variant cannot win or lose by the adaptive
# controller choosing a different tree size; 16 is the CPU default budget.
ABLATION_BUDGET = 16
ABLATION_REFERENCE = f"recap-tree-b{ABLATION_BUDGET}"


@dataclass(frozen=True)
class Method:
    """One benchmarked method: ``config`` is vLLM's ``speculative_config`` (None: no speculation)."""

    name: str
    config: dict | None
    about: str


@dataclass(frozen=True)
class Ablation:
    """A RECAP variant at the ablation budget and the row of the paper's table it mirrors.

    ``paper_gain`` is the paper's improvement of the full configuration over this variant
    (design.md, section 1), shown next to ours.
    """

    method: str
    knob: dict
    paper_row: str
    paper_gain: str


def _recap(**knobs) -> dict:
    return {"method": "recap", **knobs}


def _fixed(budget: int, **knobs) -> dict:
    return _recap(budget_policy="fixed", node_budget=budget, **knobs)


ABLATIONS: list[Ablation] = [
    Ablation("abl-fixed-tree", {"tree_shape": "fixed"}, "best-first vs fixed tree", "+4.9%"),
    Ablation("abl-unigram-only", {"use_context_memories": False},
             "3-token backoff (G/C/U) vs unigram only", "+3.0%"),
    Ablation("abl-fusion-uniform", {"fusion": "uniform"}, "prior fusion vs uniform", "+2.8%"),
    Ablation("abl-priors-fixed", {"fusion": "priors_fixed"},
             "entropy confidence vs fixed priors", "+0.7-1.1%"),
    Ablation("abl-reset-unigram", {"persistent_unigram": False},
             "persistent vs reset-per-request U", "+5.4%"),
    Ablation("abl-no-suffix", {"suffix_len": 0}, "suffix insertion on vs off", "+0.6%"),
]
# Not one of the paper's rows: the most specific row only, no mixing (FusionMode.BACKOFF).
# And prompt seeding, whose rows cost LM-head work (~28 ms per ~170-token prompt in bf16 on a
# 2-core CPU, 38-75 ms a request in float32 on an AVX2-only one) against 0-0.7% fewer passes:
# off by default on a CPU since 2026-12-07, so the ablation turns it on (the CUDA default).
EXTRA_ABLATIONS = [Ablation("abl-backoff-only", {"fusion": "backoff"},
                            "fusion vs most-specific row only", "-"),
                   Ablation("abl-seed", {"prompt_seed_rows": 256},
                            "prompt seeding off (CPU default) vs on", "-")]
# The continuation additions (evidence-scaled continuations, the shared index across requests,
# one calibrated score), each switched off alone at the ablation budget.
CONTINUATION_ABLATIONS = [
    Ablation("abl-suffix-earliest", {"suffix_mode": "earliest", "suffix_len": 4},
             "evidence continuations vs one 4-token earliest-occurrence continuation", "-"),
    Ablation("abl-no-shared-index", {"shared_index": "off"},
             "shared continuation index across requests on vs off", "-"),
    Ablation("abl-uncalibrated", {"calibrated_scores": False},
             "online-calibrated node scores vs priors only", "-"),
]
# RECAP's tree before the continuation additions (adaptive budget, as recap-tree).
CLASSIC = {"suffix_mode": "earliest", "suffix_len": 4, "shared_index": "off",
           "calibrated_scores": False}

_ALL: list[Method] = [
    Method("none", None, "no speculation (the baseline every speedup is paired against)"),
    Method("ngram", NGRAM, "vLLM n-gram prompt lookup, documented example settings"),
    Method("suffix", SUFFIX, "vLLM suffix decoding (Arctic Inference), documented settings"),
    Method("token-recycling", _recap(policy="token_recycling"),
           "Token Recycling: U-only adjacency + static template, same budget/policy as recap-tree"),
    Method("recap-chain", _recap(draft_mode="chain"), "RECAP single path (best chain of the tree)"),
    Method("recap-tree", _recap(), "RECAP tree, CPU defaults (node budget 16, adaptive)"),
    Method("recap-tree-no-seed", _recap(prompt_seed_rows=0),
           "RECAP tree without prompt seeding (the CPU default since 2026-12-07; on a device "
           "the defaults seed)"),
    Method("recap-tree-seed", _recap(prompt_seed_rows=256),
           "RECAP tree, CPU defaults plus prompt seeding (256 rows, the CUDA default): what "
           "seeding buys and costs on a CPU"),
    Method("recap-nodraft", _fixed(0, suffix_len=0, num_speculative_tokens=1),
           "RECAP that never drafts: its fixed per-step cost (rows, memories) on vLLM's "
           "speculative path, the floor of what an idle controller costs"),
    Method("recap-continuations", _recap(node_budget=0),
           "RECAP tree of continuations only (no memory nodes; adaptive): what the memory "
           "nodes add or cost, e.g. under load"),
    Method("recap-tree-mem3", _recap(memory_nodes_up_to=3),
           "RECAP tree, memory nodes only in steps of at most 3 decoding requests "
           "(continuations only above): the default against continuations only under load"),
    Method("recap-tree-s32", _recap(suffix_len=32),
           "RECAP tree with continuations of up to 32 nodes on top of the node budget (default "
           "16), as suffix decoding's 32-token drafts"),
    Method("recap-tree-classic", _recap(**CLASSIC),
           "RECAP tree without the continuation additions (4-token earliest continuation, no "
           "shared index, uncalibrated scores), adaptive"),
    Method("token-recycling-80", _fixed(80, policy="token_recycling"),
           "Token Recycling as in its paper: full 80-node template, always verified"),
    *[Method(f"recap-tree-b{b}", _fixed(b), f"RECAP tree, fixed budget of {b} nodes")
      for b in (4, 8, 16, 32)],
    # The best chain of the same fixed-budget tree: tree verification's own gain at one budget
    # (8, 16); and the first one or two nodes of the best chain, continuations included,
    # drafted every step (1, 2): what short drafts return under load against the adaptive
    # budget, which declines or idles in most steps at concurrency 4.
    *[Method(f"recap-chain-b{b}", _fixed(b, draft_mode="chain"),
             f"RECAP single path, the best chain of a fixed {b}-node tree") for b in (1, 2, 8, 16)],
    # Short fixed chains from the memories alone (no continuations), drafted every step: the
    # precision of RECAP's first one or two nodes under load, next to suffix decoding's.
    *[Method(f"recap-chain-m{b}", _fixed(b, draft_mode="chain", suffix_len=0),
             f"RECAP single path of {b} memory node(s) every step, no continuations")
      for b in (1, 2)],
    *[Method(a.method, _fixed(ABLATION_BUDGET, **a.knob), f"ablation: {a.paper_row}")
      for a in ABLATIONS + EXTRA_ABLATIONS + CONTINUATION_ABLATIONS],
]
METHODS: dict[str, Method] = {m.name: m for m in _ALL}

GROUPS: dict[str, list[str]] = {
    "core": ["none", "ngram", "suffix", "token-recycling", "recap-chain", "recap-tree"],
    # The earlier issue's table: fixed budgets side by side with the baselines.
    "budgets": ["none", "ngram", "recap-chain", "recap-tree-b4", "recap-tree-b8",
                "recap-tree-b16", "recap-tree-b32", "token-recycling"],
    "ablations": [a.method for a in ABLATIONS],
    "continuations": [a.method for a in CONTINUATION_ABLATIONS],
}


def expand(spec: str) -> list[str]:
    """Method names from a comma list of names and group names, in order, without repeats.

    Raises:
        ValueError: an unknown name (the message lists the known names and groups).
    """
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        for name in GROUPS.get(item, [item]):
            if name not in METHODS:
                raise ValueError(f"Unknown method {name!r}; known methods: {', '.join(METHODS)}; "
                                 f"groups: {', '.join(GROUPS)}")
            if name not in names:
                names.append(name)
    return names


def method_config(name: str) -> dict | None:
    """The speculative_config for a method name (a copy); ValueError listing the known names."""
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}; known methods: {', '.join(METHODS)}")
    config = METHODS[name].config
    return dict(config) if config is not None else None


def ablation(name: str) -> Ablation | None:
    """The ablation row of a method name, None for other methods."""
    return next((a for a in ABLATIONS + EXTRA_ABLATIONS + CONTINUATION_ABLATIONS
                 if a.method == name), None)
