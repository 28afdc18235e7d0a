"""RECAP core: memories, fusion, tree builder, suffix automaton, verification. No vllm/torch.

The public surface, engine-independent (numpy + numba only):

    RecapConfig, DraftMode, FusionMode, Policy,    configuration (config.py)
    TreeShape
    Drafter, warmup                                lifecycle API keyed by request id (drafter.py)
    DraftTree, tree_structure                      the flat tree type (tree.py)
    verify_greedy                                  reference greedy tree verification (verify.py)
    fuse, row_confidence                           eqs. 4-6 as a pure function (fusion.py)
    SuffixAutomaton                                continuation lookup (suffix.py)
    topk_rows_from_logits                          rows from full logits (memory.py)
"""

from vllm_recap.core.config import (
    BudgetPolicy,
    DraftMode,
    FusionMode,
    Policy,
    RecapConfig,
    TreeShape,
)
from vllm_recap.core.drafter import Drafter, warmup
from vllm_recap.core.fusion import fuse, row_confidence
from vllm_recap.core.memory import topk_rows_from_logits
from vllm_recap.core.suffix import SuffixAutomaton
from vllm_recap.core.tree import DraftTree, tree_structure
from vllm_recap.core.verify import verify_greedy

__all__ = [
    "BudgetPolicy",
    "DraftMode",
    "DraftTree",
    "Drafter",
    "FusionMode",
    "Policy",
    "RecapConfig",
    "SuffixAutomaton",
    "TreeShape",
    "fuse",
    "row_confidence",
    "topk_rows_from_logits",
    "tree_structure",
    "verify_greedy",
    "warmup",
]
