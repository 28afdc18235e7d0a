"""The real-server soak at a small size: `benchmarks/soak.py` itself, not a second implementation.

Two `vllm serve` processes (SmolLM2, float32, RECAP and no speculation), every request kind of
the soak twice, in four rounds; the same pass criteria as the long run (servers alive, no HTTP
error, dropped streams aborted, greedy identical to the reference, proposer idle with no live
request after each round, idle RSS growth within the reference's). About 3 minutes here,
most of it the two servers' start-up (~45-65 s on 2 cores).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from benchmarks.soak import KINDS, SoakConfig, make_requests, run_soak

pytestmark = pytest.mark.engine

# Every kind in the first half of the rounds (make_requests takes each kind first), drawn kinds
# in the second, so the memory check's baseline (the first half's highest idle RSS) comes after
# every code path has run once: with each kind once in two rounds, the second round's first
# use of its kinds (allocator and cache warm-up, not a leak: flat over six rounds here) read
# as growth, +72 MiB on one CI machine. A short length limit keeps the requests that run to it
# cheap; bounded answers otherwise.
SHORT = SoakConfig(requests=2 * len(KINDS), rounds=4, concurrency=8, seed=0, max_model_len=192,
                   max_tokens_cap=24, start_timeout_s=240, idle_timeout_s=60,
                   request_timeout_s=240)


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def test_soak_workload_is_a_function_of_the_seed(smollm2):
    tok = _tokenizer(smollm2)
    first, again = make_requests(SHORT, tok), make_requests(SHORT, tok)
    assert [(q.kind, q.endpoint, q.body, q.cut_after) for q in first] == \
           [(q.kind, q.endpoint, q.body, q.cut_after) for q in again]
    assert {q.kind for q in first} == {k.name for k in KINDS}
    near = [q for q in first if q.kind == "near_limit"]
    assert all(SHORT.max_model_len - 48 <= len(q.body["prompt"]) < SHORT.max_model_len
               for q in near)
    # Every kind has run before the memory baseline (the end of the first half of the rounds).
    assert {q.kind for q in first if q.round < SHORT.rounds // 2} == {k.name for k in KINDS}
    other = make_requests(dataclasses.replace(SHORT, seed=1), tok)
    assert [q.body for q in other] != [q.body for q in first]


def test_soak_short(smollm2, tmp_path):
    result = run_soak(SHORT, tmp_path)
    failed = [c for c in result["checks"] if not c["passed"]]
    recap_log = (tmp_path / "recap.log").read_text(errors="replace")
    assert not failed, (
        "soak failed: " + "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
        + f"\nmismatches: {result['comparison']['details']}"
        + f"\nerrors: {result['recap']['errors']}\nRECAP server log tail:\n{recap_log[-4000:]}")
    outcomes = result["recap"]["outcomes"]
    by_kind = {q.kind: outcomes[q.index] for q in result["requests"]}
    # The soak exercised what it claims: a stream was dropped by the client, the requests sent
    # to the length limit reached it, every choice of n=2 came back.
    assert by_kind["stream_cut"].cut
    assert {c["finish_reason"] for c in by_kind["chat_to_limit"].choices} == {"length"}
    assert len(by_kind["n2_top_k1"].choices) == len(by_kind["sampled_n2"].choices) == 2
    assert result["comparison"]["compared"] == sum(q.compared for q in result["requests"])


def test_recap_log_lines_show_under_vllm_logging_config():
    """RECAP's 'metrics' and 'idle' lines must reach vLLM's log handler (they were logged to
    a 'vllm_recap' logger that vLLM's logging config leaves without one: invisible under
    `vllm serve`)."""
    # What every vLLM process does at start (api server, engine core, worker): configure vLLM's
    # logging with defaults, then the proposer logs its idle line.
    script = textwrap.dedent("""
        import logging
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())
        from vllm_recap.vllm.metrics import log_idle
        logging.getLogger("vllm.soak").info("a vLLM line")
        log_idle({"requests": 0, "context_rows": 0, "u_tables": 1, "u_bytes": 2**20})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "a vLLM line" in out, out[-3000:]  # vLLM's own line is shown ...
    assert "RECAP idle: request-local state freed" in out, (
        "the 'vllm_recap' logger's INFO line is not shown where vLLM's are:\n" + out[-3000:])
