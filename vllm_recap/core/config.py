"""RECAP configuration: every knob of the algorithm, its default and its allowed range.

One frozen dataclass, validated in one place (`RecapConfig.validate`, called on construction).
Policies and ablations are enums, resolved here, so no hot path ever compares strings.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Token ids are packed 21 bits each into one int64 key for the context memories (3 x 21 = 63
# bits), so the vocabulary must stay below 2**21 (2,097,152; the largest current vocabularies
# are ~262k).
MAX_VOCAB_SIZE = 1 << 21

# Deepest draft level anything supports: the bound of `max_depth`, the length of the discount
# table, and the size of the per-depth arrays of the budget calibration and the metrics.
MAX_DEPTH = 64


class FusionMode(enum.Enum):
    """How the rows found for a context (G, C, U; most specific first) are mixed (eqs. 4-6)."""

    PRIORS_ENTROPY = "priors_entropy"
    """Paper default: w_j proportional to prior_j * exp(-H(P_j))."""
    BACKOFF = "backoff"
    """Ablation: use only the most specific available row."""
    UNIFORM = "uniform"
    """Ablation: equal weights 1/r over the r available rows."""
    PRIORS_FIXED = "priors_fixed"
    """Ablation: w_j proportional to prior_j (no entropy confidence)."""


class Policy(enum.Enum):
    """Which proposer runs on the shared memory/tree/verify machinery."""

    RECAP = "recap"
    """G/C/U memories, fusion, best-first tree, suffix insertion."""
    TOKEN_RECYCLING = "token_recycling"
    """Baseline (Luo et al. 2024): persistent top-K adjacency (U only) and a static 80-node
    template filled breadth-first. Ignores fusion, tree_shape, use_context_memories and the
    suffix knobs."""


class TreeShape(enum.Enum):
    """Tree construction for the RECAP policy."""

    BEST_FIRST = "best_first"
    """Paper default: priority-queue expansion under the node budget."""
    FIXED = "fixed"
    """Ablation ("best-first vs fixed tree"): the Token Recycling static template, filled with
    RECAP's fused q instead of the raw adjacency rows."""


class DraftMode(enum.Enum):
    """What an engine verifies per step."""

    TREE = "tree"
    """The whole draft tree, verified in one pass with tree attention (greedy requests)."""
    CHAIN = "chain"
    """Only the best path of the tree (the suffix path where it scores higher), verified as a
    chain by the engine's own rejection sampler. Sampled requests always get this."""


class SuffixMode(enum.Enum):
    """How continuations of earlier text enter a RECAP best-first tree."""

    EVIDENCE = "evidence"
    """Default: continuations are grown best-first from the suffix automata's transitions --
    every distinct token that followed an earlier occurrence of the matched context, counted
    -- so there can be several, and they run as deep as their estimated probability of
    acceptance holds (longer matched contexts, longer continuations), up to suffix_len nodes
    on top of the node budget. Memory candidates grow from continuation nodes too."""
    EARLIEST = "earliest"
    """Ablation (the original insertion): one continuation of at most suffix_len tokens from
    the earliest earlier occurrence of the longest repeated suffix, merged after the budget
    with the suffix_prior score floor. The shared index is not used."""


class SharedIndexMode(enum.Enum):
    """What finished requests leave in the shared continuation index (per cache_salt)."""

    OUTPUTS = "outputs"
    """Default: each finished request's output becomes a continuation source for later
    requests of its partition."""
    OUTPUTS_AND_PROMPTS = "outputs_and_prompts"
    """Prompt and output, as one document."""
    OFF = "off"
    """Ablation: no shared index; continuations come from the request's own text only."""


class BudgetPolicy(enum.Enum):
    """How many tree nodes each step verifies."""

    ADAPTIVE = "adaptive"
    """Per step, the count (up to node_budget) that maximises expected committed tokens per
    second, from step costs measured on this machine and acceptance calibrated online
    (vllm_recap/core/budget.py). Includes 0, so it stops speculating where that is faster."""
    FIXED = "fixed"
    """Always node_budget (still capped by batch_node_budget)."""


_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "fusion": FusionMode,
    "policy": Policy,
    "tree_shape": TreeShape,
    "draft_mode": DraftMode,
    "budget_policy": BudgetPolicy,
    "suffix_mode": SuffixMode,
    "shared_index": SharedIndexMode,
}
_TUPLE_FIELDS = ("priors", "depth_discounts")


@dataclass(frozen=True)
class RecapConfig:
    """All RECAP knobs. Defaults are the paper's scale (K = 8, depth 10, 63 nodes).

    Construct directly, or with `from_dict` from plain JSON-like values (enums by their string
    value, tuples as lists). Invalid values raise ValueError naming the field, the value and
    the allowed range.
    """

    top_k: int = 8
    """K: ids (and probabilities) kept per memory row, and the maximum width of a tree node.
    Must equal the K of the rows the engine passes to `Drafter.observe`. Range [1, 64]."""

    max_depth: int = 10
    """Deepest level of a memory node (root = depth 0). Continuations (suffix_mode evidence)
    may reach level max(max_depth, suffix_len). Range [1, MAX_DEPTH = 64]."""

    node_budget: int = 63
    """Memory draft nodes per tree, root excluded, continuations not counted;
    `Drafter.propose` may override it per call. 0: continuations only with suffix_mode
    evidence and the adaptive budget policy (no draft in the other suffix modes, with
    suffix_len 0, or with the fixed policy, which verifies node_budget nodes in all). For
    TOKEN_RECYCLING and the FIXED tree it truncates the 80-node template (set 80 for the full
    template). Range [0, 1024]."""

    suffix_len: int = 16
    """Continuation nodes per tree on top of the node budget (all continuations together;
    with suffix_mode earliest, the length of the one continuation). 0 turns continuations
    off. vLLM's num_speculative_tokens defaults to node_budget + suffix_len. Range [0, 64]."""

    suffix_min_match: int = 1
    """Shortest matched context (tokens) a continuation is drafted from. Range [1, 1024]."""

    suffix_min_prob: float = 0.1
    """suffix_mode evidence: a continuation node is drafted only while its estimated
    probability of acceptance (its whole path's) is at least this. Lower = more, longer and
    riskier continuations. Range [0, 1]."""

    suffix_prior: float = 0.3
    """suffix_mode earliest only: score floor for suffix nodes: a suffix node scores
    parent_score * d(depth) * max(q(z | parent context), suffix_prior), where q is 0 if z is not
    among the parent's fused candidates. A node shared with the tree keeps the larger of both
    scores, so the best chain follows the suffix branch where it scores higher. Range (0, 1]."""

    suffix_mode: SuffixMode = SuffixMode.EVIDENCE
    """How continuations enter the tree; see SuffixMode (earliest = the original insertion,
    for ablations). Used by the RECAP policy with tree_shape best_first; the FIXED template
    always uses the earliest-occurrence insertion."""

    shared_index: SharedIndexMode = SharedIndexMode.OUTPUTS
    """What finished requests leave for later ones of the same cache_salt; see
    SharedIndexMode. Used with suffix_mode evidence."""

    shared_index_tokens: int = 32768
    """Corpus cap of each partition's shared index (tokens); past it the oldest documents
    are dropped until half is left. At most max_partitions partitions (least recently used
    evicted), each about 244 bytes per token at the cap: ~8 MB at the default.
    Range [64, 16777216]."""

    calibrated_scores: bool = True
    """Score every node (memory, continuation, shared index) by its estimated probability of
    acceptance, calibrated online per source from what verification accepts, and lay trees
    out best node first. False = ablation: the calibration stays at its priors (memory nodes
    d(depth) * q, as in the paper). With suffix_mode earliest, trees are the original ones
    either way."""

    priors: tuple[float, ...] = (0.70, 0.20, 0.10)
    """Specificity priors a_j by rank among the *available* rows (most specific first).
    Exactly 3 values, each in (0, 1]."""

    depth_discounts: tuple[float, ...] = (0.68, 0.63, 0.50, 0.43, 0.40, 0.38)
    """d(depth) for depths 1, 2, ...; the last value repeats for deeper levels (see
    `discount_table`). 1 to MAX_DEPTH = 64 values, each in (0, 1]."""

    persistent_unigram: bool = True
    """U survives requests (one table per salt partition). False = ablation "U reset per
    request": each request gets a fresh private U."""

    fusion: FusionMode = FusionMode.PRIORS_ENTROPY
    """Row mixing rule; see FusionMode."""

    policy: Policy = Policy.RECAP
    """Proposer; see Policy."""

    tree_shape: TreeShape = TreeShape.BEST_FIRST
    """RECAP tree construction; see TreeShape."""

    use_context_memories: bool = True
    """Use the request-local C (2-token) and G (3-token) memories. False = ablation "unigram
    only" (RECAP with U alone)."""

    max_context_rows: int = 8192
    """Per-request cap on C + G rows; the oldest-inserted row is evicted when full. Storage
    grows on demand from 256 rows; at the cap it costs about (16 K + 32) bytes per row (rows
    live inline in a hash table kept at most half full, plus an 8-byte eviction ring), i.e.
    ~1.3 MB per request at the default 8192 rows and K = 8. Range [16, 16777216]."""

    max_partitions: int = 16
    """Most persistent U tables kept (one per partition: cache_salt, and in the vLLM adapter
    one per salt for its structured-output requests; least recently used evicted). Each is
    a dense [vocab, K] table: vocab * (8 K + 4) bytes, ~3.3 MB for vocab 49152 at K = 8.
    Range [1, 4096]."""

    draft_mode: DraftMode = DraftMode.TREE
    """Verify the whole tree (TREE) or its best path only (CHAIN); see DraftMode."""

    budget_policy: BudgetPolicy = BudgetPolicy.ADAPTIVE
    """Nodes verified per step: ADAPTIVE (measured cost vs calibrated gain) or FIXED."""

    prompt_seed_rows: int = 256
    """Prompt positions per request whose top-K rows seed the memories at prefill (the first
    occurrence of each distinct prompt token, in order); each costs one extra LM-head row in
    the prefill step. 0 = no seeding. The vLLM adapter's CPU default is 0 (see
    ``vllm_recap.vllm.options.DEVICE_DEFAULTS``). Range [0, 65536]."""

    batch_node_budget: int = 0
    """Draft nodes per engine step across all decoding requests: each request gets
    min(node_budget, batch_node_budget // decoding requests), so verification cost stays
    bounded as the batch grows. 0 = no batch limit. Range [0, 1048576]."""

    memory_nodes_up_to: int = 0
    """Steps with more decoding requests than this draft no memory nodes: continuations
    only, as node_budget 0 (adaptive budget policy only; the fixed policy ignores it).
    Memory nodes are the least precise drafts, and from a few requests on a 2-core CPU's step
    is compute-bound: a draft row costs about what a token is worth divided by the batch.
    0 = memory nodes at every batch size. Range [0, 1048576]."""

    def __post_init__(self) -> None:
        # Accept enum values given by name/value and sequences given as lists, so that
        # `RecapConfig(fusion="uniform")` and JSON round trips work; then validate once.
        for name, enum_type in _ENUM_FIELDS.items():
            object.__setattr__(self, name, _coerce_enum(name, getattr(self, name), enum_type))
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """Checks every field; raises ValueError naming the field, the value and the range."""
        _check_int("top_k", self.top_k, 1, 64)
        _check_int("max_depth", self.max_depth, 1, MAX_DEPTH)
        _check_int("node_budget", self.node_budget, 0, 1024)
        _check_int("suffix_len", self.suffix_len, 0, 64)
        _check_int("suffix_min_match", self.suffix_min_match, 1, 1024)
        _check_float("suffix_min_prob", self.suffix_min_prob, 0.0, 1.0, low_open=False)
        _check_float("suffix_prior", self.suffix_prior, 0.0, 1.0, low_open=True)
        _check_int("shared_index_tokens", self.shared_index_tokens, 64, 1 << 24)
        _check_bool("calibrated_scores", self.calibrated_scores)
        _check_floats("priors", self.priors, 3, 3)
        _check_floats("depth_discounts", self.depth_discounts, 1, MAX_DEPTH)
        _check_bool("persistent_unigram", self.persistent_unigram)
        _check_bool("use_context_memories", self.use_context_memories)
        _check_int("max_context_rows", self.max_context_rows, 16, 1 << 24)
        _check_int("max_partitions", self.max_partitions, 1, 4096)
        _check_int("prompt_seed_rows", self.prompt_seed_rows, 0, 1 << 16)
        _check_int("batch_node_budget", self.batch_node_budget, 0, 1 << 20)
        _check_int("memory_nodes_up_to", self.memory_nodes_up_to, 0, 1 << 20)
        for name, enum_type in _ENUM_FIELDS.items():
            if not isinstance(getattr(self, name), enum_type):
                raise ValueError(
                    f"RecapConfig.{name} = {getattr(self, name)!r} is invalid: allowed values "
                    f"are {[m.value for m in enum_type]}"
                )

    @classmethod
    def field_names(cls) -> list[str]:
        """Public field names (the keys `from_dict` accepts)."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecapConfig:
        """Builds a config from plain values; unknown keys raise ValueError listing valid ones.

        Args:
            d: field name -> value. Enums may be given by value or name, case-insensitive
                (``"uniform"``, ``"TOKEN_RECYCLING"``); tuples may be lists.
        """
        if not isinstance(d, dict):
            raise ValueError(f"RecapConfig.from_dict expects a dict, got {type(d).__name__}")
        valid = cls.field_names()
        unknown = sorted(k for k in d if k not in valid)
        if unknown:
            raise ValueError(f"unknown RecapConfig key(s) {unknown}; valid keys are {valid}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (enums as their string value, tuples as lists)."""
        out: dict[str, Any] = {}
        for name in self.field_names():
            value = getattr(self, name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out


def discount_table(depth_discounts: Sequence[float]) -> np.ndarray:
    """The depth discount d(depth) of every level, as the builders and the budget use it.

    Args:
        depth_discounts: `RecapConfig.depth_discounts`, d(1), d(2), ... (1 to MAX_DEPTH values).

    Returns:
        [MAX_DEPTH + 1] float64 indexed by depth: entry 0 (the root) is 1.0, entry d >= 1 is
        depth_discounts[d - 1], the last configured value repeating for deeper levels.
    """
    table = np.empty(MAX_DEPTH + 1, np.float64)
    table[0] = 1.0
    n = len(depth_discounts)
    for d in range(1, MAX_DEPTH + 1):
        table[d] = depth_discounts[min(d, n) - 1]
    return table


def _coerce_enum(name: str, value: Any, enum_type: type[enum.Enum]) -> Any:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        for member in enum_type:
            if value.lower() in (member.value, member.name.lower()):
                return member
    raise ValueError(
        f"RecapConfig.{name} = {value!r} is invalid: allowed values are "
        f"{[m.value for m in enum_type]}"
    )


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    # bool is an int subclass; `top_k=True` is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(
            f"RecapConfig.{name} = {value!r} is out of range: must be an int in [{low}, {high}]"
        )


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(
            f"RecapConfig.{name} = {value!r} is out of range: must be a float in "
            f"{bracket}{low}, {high}]"
        )


def _check_floats(name: str, value: Any, min_len: int, max_len: int) -> None:
    ok = isinstance(value, tuple) and min_len <= len(value) <= max_len
    if ok:
        ok = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and 0.0 < v <= 1.0
            for v in value
        )
    if not ok:
        count = f"{min_len}" if min_len == max_len else f"{min_len} to {max_len}"
        raise ValueError(
            f"RecapConfig.{name} = {value!r} is out of range: must be {count} floats, "
            f"each in (0, 1]"
        )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"RecapConfig.{name} = {value!r} is invalid: must be a bool (True/False)")
