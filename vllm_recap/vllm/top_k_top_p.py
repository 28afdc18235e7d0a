"""vLLM's top-k + top-p filter for tree rows, without sorting the vocabulary where it can.

vLLM's CPU filter (``apply_top_k_top_p_pytorch``) sorts every row over the whole vocabulary
when a request sets top-p: ~2-3 ms a row of 49k on this project's 2-core CPU, so a tree of 17
nodes under Qwen2.5's text settings (T 0.7, top_k 20, top_p 0.8) paid ~30 ms of sorting per
pass -- more than the pass. With top-k set, only the k largest logits can survive, and the
result is decided by those: :func:`top_k_top_p` takes them with ``topk`` and replays vLLM's
rules on them. It is exact: where the small computation could disagree with vLLM's (a tie at
the top-k threshold or across the top-p cut, which vLLM resolves by its sort order; a
cumulative probability within rounding of the cut; a non-finite logit among them), the row
goes through vLLM's own function instead.

vLLM's rules, for one row sorted ascending (``apply_top_k_top_p_pytorch``):

- top-k: every logit below the k-th largest is masked (ties at the threshold all survive);
- top-p: softmax over the survivors, cumulative sum from the smallest; a survivor whose
  cumulative sum is ``<= 1 - p`` is masked, the largest never;
- the result is the row with masked entries at ``-inf`` and the others unchanged.
"""
from __future__ import annotations

import torch

# A cumulative probability within CUT_MARGIN of the cut is left to vLLM: its sum runs over the
# whole row in another order, so the last bits may differ (float32 over <= 1024 terms: < 1e-4).
# One value for both replays of vLLM's rules: this one in torch, the sampled tree rows'
# compiled one.
from vllm_recap.core.candidates import CUT_MARGIN

# Rows take the small path up to this top-k (beyond it ``topk`` is no cheaper than sorting).
MAX_SMALL_K = 1024
# Columns taken past a row's k, to see a tie at its threshold whole.
TIE_COLUMNS = 8


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` of these rows, bit for bit.

    Args:
        logits: [M, V] float32 (temperature applied); may be modified in place, like vLLM's.
        k: [M] int top-k per row (V: none), or None.
        p: [M] float32 top-p per row (1: none), or None.

    Returns:
        [M, V] float32, the filtered logits (``-inf`` where masked).
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    if k is None or p is None or logits.device.type != "cpu" or _vllm_uses_triton():
        return apply_top_k_top_p(logits, k, p)  # no sort to save, or not vLLM's CPU rules
    vocab = logits.shape[1]
    small = (k < vocab) & (k <= MAX_SMALL_K)
    if not bool(small.any()):
        return apply_top_k_top_p(logits, k, p)
    rows = torch.nonzero(small).view(-1)
    kept, exact = _small_rows(logits.index_select(0, rows), k[rows].to(torch.long), p[rows])
    # In place, as vLLM's: the decided rows and the rest are disjoint, and ``logits[rest]``
    # reads a copy of the rest.
    logits[rows[exact]] = kept[exact]
    rest = torch.nonzero(~small).view(-1)
    if not bool(exact.all()):
        rest = torch.cat([rest, rows[~exact]])
    if rest.numel():
        logits[rest] = apply_top_k_top_p(logits[rest], k[rest], p[rest])
    return logits


def _small_rows(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter from each row's k + ``TIE_COLUMNS`` largest logits.

    Args:
        x: [M, V] float32 rows; k: [M] int64 in 1..MAX_SMALL_K (< V); p: [M] float32.

    Returns:
        filtered [M, V] float32 (only meaningful where exact) and exact [M] bool.
    """
    vocab = x.shape[1]
    # A few columns past the largest k: ties at a row's threshold all survive in vLLM, and
    # they are decided here too when the whole tie is among the columns taken.
    width = min(int(k.max()) + TIE_COLUMNS, vocab)
    vals, ids = x.topk(width, dim=-1)  # [M, W] descending
    rest = vals[:, -1] if width < vocab else torch.full_like(vals[:, 0], float("-inf"))
    keep, exact = filter_sorted(vals, k, p, rest)
    out = torch.full_like(x, float("-inf"))
    out.scatter_(1, ids, vals.masked_fill(~keep, float("-inf")))
    return out, exact


def filter_sorted(vals: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None,
                  rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's top-k + top-p rules on each row's largest logits.

    Args:
        vals: [M, W] float32, each row's W largest logits, descending (W >= k).
        k: [M] int64 top-k per row (1..W).
        p: [M] float32 top-p per row, or None: top-k only (as vLLM with no top-p tensor; with
            one, a row of p = 1 still loses survivors whose probability rounds to 0).
        rest: [M] float32, an upper bound of every logit of the row not among ``vals``
            (-inf: none): a row is decided only when the whole vocabulary's survivors are
            among ``vals``.

    Returns:
        keep [M, W] bool (the columns vLLM leaves unmasked) and exact [M] bool (the row is
        decided here; elsewhere ``keep`` means nothing).
    """
    col = torch.arange(vals.shape[1]).unsqueeze(0)
    kth = vals.gather(1, k.unsqueeze(1) - 1)  # [M, 1] the threshold: the k-th largest
    survive = vals >= kth  # [M, W]
    # Left to vLLM: a tie running past the columns taken, and rows whose survivors include
    # -inf (fewer than k finite logits).
    exact = torch.isfinite(kth).view(-1) & (rest < kth.view(-1))
    if p is None:
        return survive, exact
    masked = vals.masked_fill(~survive, float("-inf"))
    probs = masked.softmax(dim=-1)
    # vLLM's ascending cumulative sum, read in descending order: at column j, the mass of
    # columns j..k-1 (itself and every smaller survivor).
    tail = probs.flip(1).cumsum(1).flip(1)
    cut = (1 - p).unsqueeze(1)
    drop = survive & (tail <= cut) & (col > 0)
    near = survive & (col > 0) & ((tail - cut).abs() <= CUT_MARGIN)
    exact &= ~near.any(1)
    # A tie across the cut: vLLM's sort order decides which of the equal logits goes.
    edge = drop[:, :-1] != drop[:, 1:]  # [M, W-1], between columns j and j+1
    exact &= ~(edge & survive[:, 1:] & (vals[:, :-1] == vals[:, 1:])).any(1)
    return survive & ~drop, exact


def _vllm_uses_triton() -> bool:
    from vllm.v1.sample.ops import topk_topp_sampler

    return bool(getattr(topk_topp_sampler, "HAS_TRITON", False))
