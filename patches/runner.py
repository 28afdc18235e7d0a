"""Seams on vLLM's V1 model runner (``GPUModelRunner``, which the CPU runner inherits).

vLLM calls a custom-class proposer with sampled token ids only. RECAP needs, per step, the
request ids, the logits of every evaluated position, control over tree positions and over the
acceptance of tree drafts. Four methods are wrapped; each wrapper hands over to
:class:`vllm_recap.vllm.proposer.RecapProposer` only when the runner's drafter is one, and
otherwise calls vLLM's method unchanged.

    _update_states            -> proposer.on_update_states (finished / preempted requests)
    _prepare_inputs           -> proposer.begin_step (tree layout, positions)
    _sample                   -> proposer.sample (memory rows, tree acceptance, KV compaction)
    propose_draft_token_ids   -> proposer.propose_batch (observe, commit, propose)
"""
from __future__ import annotations

from vllm_recap.patches import wrap


def _recap(runner):
    from vllm_recap.vllm.proposer import RecapProposer

    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, RecapProposer) else None


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_update_states(original):
        def _update_states(self, scheduler_output):
            recap = _recap(self)
            if recap is not None:
                recap.on_update_states(scheduler_output)
            return original(self, scheduler_output)

        return _update_states

    def make_prepare_inputs(original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            result = original(self, scheduler_output, num_scheduled_tokens)
            recap = _recap(self)
            if recap is not None:
                recap.begin_step(self, scheduler_output)
            return result

        return _prepare_inputs

    def make_sample(original):
        def _sample(self, logits, spec_decode_metadata):
            recap = _recap(self)
            if recap is None:
                return original(self, logits, spec_decode_metadata)
            return recap.sample(self, lambda lg, md: original(self, lg, md), logits,
                                spec_decode_metadata)

        return _sample

    def make_propose(original):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                    hidden_states, *args, **kwargs):
            recap = _recap(self)
            if recap is None:
                return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, *args, **kwargs)
            return recap.propose_batch(self, scheduler_output, sampled_token_ids, hidden_states)

        return propose_draft_token_ids

    wrap(GPUModelRunner, "_update_states", "GPUModelRunner._update_states",
         ["self", "scheduler_output"], make_update_states)
    wrap(GPUModelRunner, "_prepare_inputs", "GPUModelRunner._prepare_inputs",
         ["self", "scheduler_output", "num_scheduled_tokens"], make_prepare_inputs)
    wrap(GPUModelRunner, "_sample", "GPUModelRunner._sample",
         ["self", "logits", "spec_decode_metadata"], make_sample)
    wrap(GPUModelRunner, "propose_draft_token_ids", "GPUModelRunner.propose_draft_token_ids",
         ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states"],
         make_propose)
