"""Closed-loop load: keep ``concurrency`` requests in flight until every prompt has been served.

A new request is submitted the moment one finishes (a closed loop, like a fixed pool of users
each waiting for its answer before asking again). With concurrency 1 this is plain batch-1
decoding, one prompt at a time, and each request's time is its own; the benchmark uses the
same loop for both so batch 1 and load are measured the same way.

The loop knows nothing of vLLM: it gets ``submit`` and ``step`` callables (see
``benchmarks.harness_worker`` for the vLLM ones), so its bookkeeping is unit-tested with a fake
engine.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Finished:
    """One served request: which prompt, what it produced, when it was submitted and done."""

    index: int
    output_ids: list[int]
    start: float
    end: float

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class LoopStats:
    """Figures of the whole loop.

    Attributes:
        wall_s: first submit to last finish.
        steps: engine steps taken.
        max_in_flight: most requests in flight at once (< concurrency if prompts ran out).
        mean_in_flight: requests in flight per engine step, averaged over steps.
    """

    wall_s: float
    steps: int
    max_in_flight: int
    mean_in_flight: float


def closed_loop(
    num_requests: int,
    concurrency: int,
    submit: Callable[[int], str],
    step: Callable[[], Iterable[tuple[str, list[int]]]],
    *,
    clock: Callable[[], float] = time.perf_counter,
    before_submit: Callable[[int], None] | None = None,
    after_finish: Callable[[Finished], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> tuple[list[Finished], LoopStats]:
    """Serves prompts 0 .. num_requests-1 in order with at most ``concurrency`` in flight.

    Args:
        submit: starts prompt i, returns its request id.
        step: runs one engine step, returns (request id, output token ids) of the requests
            that finished in it.
        before_submit / after_finish: hooks outside the timed span of a request (e.g. reading
            counters per request at concurrency 1).
        after_step: hook after each engine step (e.g. sampling proposer memory sizes).

    Returns:
        The finished requests in prompt order, and the loop's figures.

    Raises:
        RuntimeError: the engine reports a request id that is not in flight.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    done: dict[int, Finished] = {}
    in_flight: dict[str, tuple[int, float]] = {}
    next_index, steps, occupancy, max_in_flight = 0, 0, 0, 0
    while next_index < num_requests or in_flight:
        while next_index < num_requests and len(in_flight) < concurrency:
            if before_submit is not None:
                before_submit(next_index)
            start = clock()
            in_flight[submit(next_index)] = (next_index, start)
            next_index += 1
        max_in_flight = max(max_in_flight, len(in_flight))
        occupancy += len(in_flight)
        finished = list(step())
        steps += 1
        end = clock()
        for req_id, output_ids in finished:
            if req_id not in in_flight:
                raise RuntimeError(f"engine finished request {req_id!r}, which is not in flight "
                                   f"({sorted(in_flight)})")
            index, start = in_flight.pop(req_id)
            done[index] = Finished(index, list(output_ids), start, end)
            if after_finish is not None:
                after_finish(done[index])
        if after_step is not None:
            after_step()
    wall = max(f.end for f in done.values()) - min(f.start for f in done.values()) if done else 0.0
    stats = LoopStats(wall, steps, max_in_flight, occupancy / steps if steps else 0.0)
    return [done[i] for i in range(num_requests)], stats
