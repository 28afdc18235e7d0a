"""RECAP core: memories, fusion, tree builder, suffix automaton, verification. No vllm/torch.

The public surface, engine-independent (numpy + numba only):

    RecapConfig, DraftMode, FusionMode, Policy,    configuration (config.py)
    TreeShape, SuffixMode, SharedIndexMode
    Drafter, warmup                                lifecycle API keyed by request id (drafter.py)
    DraftTree, tree_depths, ancestor_mask          the flat tree type (tree.py)
    verify_greedy                                  reference greedy tree verification (verify.py)
    fuse, row_confidence                           eqs. 4-6 as a pure function (fusion.py)
    SuffixAutomaton                                continuation lookup (suffix.py)
    SharedIndex                                    earlier outputs as continuations (index.py)
    SourceCalibration                              one acceptance scale per node source
                                                   (calibration.py)
"""

from vllm_recap.core.config import (
    BudgetPolicy,
    DraftMode,
    FusionMode,
    Policy,
    RecapConfig,
    SharedIndexMode,
    SuffixMode,
    TreeShape,
)
from vllm_recap.core.calibration import SourceCalibration
from vllm_recap.core.drafter import Drafter, warmup
from vllm_recap.core.fusion import fuse, row_confidence
from vllm_recap.core.index import SharedIndex
from vllm_recap.core.suffix import SuffixAutomaton
from vllm_recap.core.tree import DraftTree, ancestor_mask, tree_depths
from vllm_recap.core.verify import verify_greedy

__all__ = [
    "BudgetPolicy",
    "DraftMode",
    "DraftTree",
    "Drafter",
    "FusionMode",
    "Policy",
    "RecapConfig",
    "SharedIndex",
    "SharedIndexMode",
    "SourceCalibration",
    "SuffixAutomaton",
    "SuffixMode",
    "TreeShape",
    "ancestor_mask",
    "fuse",
    "row_confidence",
    "tree_depths",
    "verify_greedy",
    "warmup",
]
