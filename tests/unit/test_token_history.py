"""TokenHistory: penalties read from the history kept between steps equal penalties read from
vLLM's token lists afresh, step after step, whatever happens to the lists."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.vllm.memory_rows import memory_state
from vllm_recap.vllm.records import RequestBook, RequestRecord
from vllm_recap.vllm.token_history import TokenHistory
from vllm_recap.vllm.tree_sampling import RequestSampling, penalise_candidates

pytestmark = pytest.mark.unit

VOCAB = 30
TOKEN = st.integers(0, VOCAB - 1)


def _direct(prompt, output, cand):
    """In prompt / output counts, the plain way."""
    out = [t for t in output if t >= 0]
    return (np.isin(cand, np.asarray(prompt, np.int64)),
            np.vectorize(out.count, otypes=[np.int64])(cand))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_history_penalties_equal_fresh_penalties_step_after_step(data):
    """One request's lists evolve as in an engine -- tokens committed a few per step, async
    placeholders (-1) appended and later filled in, now and then the output cut back or
    started over (a preemption) and the prompt replaced -- and at every step the history's
    answers and ``penalise_candidates`` with it equal the fresh computation bit for bit."""
    prompt = data.draw(st.lists(TOKEN, min_size=1, max_size=20))
    output: list[int] = []
    history = TokenHistory()
    pen = dict(repetition_penalty=data.draw(st.sampled_from([1.05, 1.3, 0.8])),
               frequency_penalty=data.draw(st.sampled_from([0.0, 0.4, -0.6])),
               presence_penalty=data.draw(st.sampled_from([0.0, 0.5])))
    for _ in range(data.draw(st.integers(1, 12))):
        event = data.draw(st.sampled_from(["commit"] * 6 + ["placeholder", "fill", "cut",
                                                            "restart", "new_prompt"]))
        if event == "commit":
            output.extend(data.draw(st.lists(TOKEN, min_size=1, max_size=4)))
        elif event == "placeholder":
            output.extend([-1] * data.draw(st.integers(1, 2)))
        elif event == "fill" and -1 in output:
            output[output.index(-1)] = data.draw(TOKEN)
        elif event == "cut" and output:
            del output[data.draw(st.integers(0, len(output) - 1)):]
        elif event == "restart":
            output[:] = data.draw(st.lists(TOKEN, max_size=5))  # in place, as vLLM
        elif event == "new_prompt":
            prompt = data.draw(st.lists(TOKEN, min_size=1, max_size=20))
        m, k = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 6))
        cand = np.asarray(data.draw(st.lists(TOKEN, min_size=m * k, max_size=m * k)),
                          np.int64).reshape(m, k)
        history.sync(prompt, output)
        want_in, want_count = _direct(prompt, output, cand)
        assert np.array_equal(np.isin(cand, history.prompt_tokens), want_in)
        assert history.prompt_tokens.tolist() == sorted(set(prompt))
        assert np.array_equal(history.output_counts(cand), want_count)

        values = np.asarray(data.draw(st.lists(st.floats(-30, 30, width=32), min_size=m * k,
                                               max_size=m * k)), np.float32).reshape(m, k)
        paths = [data.draw(st.lists(TOKEN, max_size=3)) for _ in range(m)]
        fresh = RequestSampling(list(prompt), list(output), temperature=0.0, **pen)
        kept = replace(fresh, history=history)
        owner = np.zeros(m, np.int64)
        assert np.array_equal(penalise_candidates(values, cand, owner, paths, [kept]),
                              penalise_candidates(values, cand, owner, paths, [fresh]))


def test_a_tail_rewritten_in_place_is_counted_again():
    """vLLM cuts an output's tail in place (a failed KV load, an optimistic async extend) and
    appends again: a list of the same length ending in the same token but with other tokens
    before it must not keep the old counts."""
    history, output = TokenHistory(), [5, 6, 7]
    history.sync([1], output)
    del output[1:]
    output.extend([8, 7])
    history.sync([1], output)
    assert history.output_counts(np.array([5, 6, 7, 8])).tolist() == [1, 0, 1, 1]


def test_from_params_and_memory_state_sync_the_history():
    """Both ways a step reads a request's state bring its history up to date."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05)
    prompt, output = [3, 4, 5], [7, 7]
    history = TokenHistory()
    rs = RequestSampling.from_params(params, prompt, output, history=history)
    assert rs.history is history
    cand = np.array([[3, 7, 9]])
    assert history.prompt_tokens.tolist() == [3, 4, 5]
    assert history.output_counts(cand).tolist() == [[0, 2, 0]]
    output.append(9)
    state = memory_state(params, prompt, output, history)
    assert state is not None and state.history is history and state.temperature == 0.0
    assert history.output_counts(cand).tolist() == [[0, 2, 1]]
    # a request without penalties keeps raw rows: no state, nothing synced
    assert memory_state(SamplingParams(temperature=0.0), prompt, output + [3], history) is None
    assert history.output_counts(cand).tolist() == [[0, 2, 1]]


def test_history_lives_and_dies_with_the_request_record():
    """The history is request-local state: a finished or preempted request's record (and so
    its history) is dropped; a resumed one starts a fresh history."""
    from vllm_recap.core.config import RecapConfig
    from vllm_recap.core.drafter import Drafter

    book = RequestBook(Drafter(RecapConfig(), vocab_size=VOCAB))
    record = book.get("a")
    assert isinstance(record, RequestRecord) and isinstance(record.history, TokenHistory)
    record.history.sync([1, 2], [3])
    book.stop("a", keep_salt=True)  # preempted
    assert book.get("a").history is not record.history
    assert book.get("a").history.output_counts(np.array([3])).tolist() == [0]
    book.stop("a", keep_salt=False)  # finished
    assert "a" not in book
