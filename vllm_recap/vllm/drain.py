"""Whether the batch drains, and which of its requests the remaining run waits for.

A batch drains when requests finish and nobody takes their places: the end of an offline
``LLM.generate`` call, the last requests of a benchmark, a server between bursts. The engine
then runs until its longest request is done, and drafts of the other requests shorten
nothing (see :class:`~vllm_recap.core.budget.Drain`). The worker cannot see the scheduler's
waiting queue, but it sees the batch: when the batch shrinks, the scheduler had nobody to
take the finished requests' places (it admits waiting requests in the same step). A request
arriving into a batch that did not shrink means requests are waiting again.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from vllm_recap.core.budget import Drain


class DrainWatch:
    """Follows the batch from step to step: ``draining`` since it last shrank, until a
    request arrives into a batch that did not shrink."""

    def __init__(self) -> None:
        self.draining = False
        self._size = 0

    def update(self, running: set[str], arrived: bool) -> bool:
        """This step's requests, and whether any of them is new. Returns whether the batch
        shrank (the longest request may have changed)."""
        shrank = len(running) < self._size
        if shrank:
            self.draining = True
        elif arrived:
            self.draining = False
        self._size = len(running)
        return shrank


def remaining_tokens(params: Any, num_tokens: int, num_prompt_tokens: int,
                     max_model_len: int) -> int:
    """Most tokens a request may still commit: up to its ``max_tokens`` and the model's
    length (a stop token may end it sooner; nothing tells when)."""
    left = max_model_len - num_tokens
    max_tokens = getattr(params, "max_tokens", None)
    if max_tokens is not None:
        left = min(left, max_tokens - (num_tokens - num_prompt_tokens))
    return left


def longest_requests(decoding: Sequence[int], remaining: Sequence[int],
                     prefilling: Sequence[int]) -> tuple[list[int], Drain]:
    """The decoding requests the draining run waits for, and how to price their drafts.

    Args:
        decoding: batch rows of the requests that decode (may draft) next step.
        remaining: [B] remaining tokens of every batch row (`remaining_tokens`).
        prefilling: batch rows still in prefill (in flight, but no drafts this step).

    Returns:
        The decoding rows with the most remaining tokens (empty when a prefilling request
        has as many: then no draft shortens the run), and the :class:`Drain` to price them.
    """
    most = max((remaining[i] for i in (*decoding, *prefilling)), default=0)
    longest = [i for i in decoding if remaining[i] == most]
    if any(remaining[i] >= most for i in prefilling):
        longest = []
    others = [remaining[i] for i in (*decoding, *prefilling) if remaining[i] < most]
    slack = most - max(others) if others else math.inf
    return longest, Drain(float(slack), len(decoding))
