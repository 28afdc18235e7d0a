"""Runs each benchmark job in a process of its own, so peak RSS is per job and an engine crash
costs one row of the report, not the run.

    python -m benchmarks.harness_worker JOB.json RESULT.json     # one job, as its own process

Two ways to get that process (``--isolation`` of ``benchmarks.run``):

- ``fork`` (default): the orchestrator imports vLLM once (~15 s on this 2-core machine) and
  forks a child per job, which starts its engine at once. It is safe because the parent never
  starts an engine, runs no torch computation and has a single thread when it forks.
- ``spawn``: a fresh ``python -m benchmarks.harness_worker`` per job (pays the import each time).

Either way the child's stdout/stderr (vLLM's logs) go to ``<job>.log`` next to its result, and
it appends a line to ``<job>.progress`` per finished request, which the parent turns into its
progress bar.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.5


def _jsonable(value):
    """json.dumps fallback for numpy scalars and arrays."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, default=_jsonable))
    tmp.replace(path)  # a reader never sees half a file


# Engine-side modules every child imports while starting its engine (~1 s per job when
# preloaded). Not vLLM's spec_decode or RECAP: they import numba, which the parent avoids.
PRELOAD = ("vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.model_loader", "vllm.model_executor.layers.linear")


def preload() -> None:
    """Import what every child needs before forking, so no child pays for it."""
    import importlib

    from vllm import LLM, SamplingParams, TokensPrompt  # noqa: F401

    import benchmarks.harness  # noqa: F401

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # another vLLM layout: the child imports what it needs itself
            pass


def job_identity(job: dict) -> dict:
    """The keys that identify a job's result: name, method, phase, concurrency, repeat and
    the sampling setting's name (``greedy`` for jobs that name none)."""
    out = {k: job[k] for k in ("name", "method", "phase", "concurrency", "repeat")}
    out["sampling"] = (job.get("sampling") or {}).get("name", "greedy")
    return out


def _forked_child(job: dict, result_path: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        from benchmarks.harness import run_job

        write_json(Path(result_path), run_job(job))
    except BaseException:  # noqa: BLE001 - report anything, then leave without parent cleanup
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip the parent's atexit handlers (tqdm, logging) in the child


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_isolated(job: dict, workdir: Path, isolation: str = "fork", timeout_s: float = 3600.0,
                 on_progress: Callable[[int], None] | None = None) -> dict:
    """Runs ``job`` (see benchmarks.harness.run_job) in its own process and returns its result.

    A process that dies without a result (segfault, OOM kill, timeout) yields a result whose
    ``error`` holds the exit status and the tail of its log.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    slug = job["name"].replace("/", "_")
    paths = {k: workdir / f"{slug}.{k}" for k in ("job.json", "result.json", "log", "progress")}
    for p in paths.values():
        p.unlink(missing_ok=True)
    job = {**job, "progress_file": str(paths["progress"])}
    write_json(paths["job.json"], job)
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    if isolation == "fork":
        proc = multiprocessing.get_context("fork").Process(
            target=_forked_child, args=(job, str(paths["result.json"]), str(paths["log"])))
        proc.start()
        alive, kill, exitcode = proc.is_alive, proc.kill, lambda: proc.exitcode
    elif isolation == "spawn":
        with open(paths["log"], "w") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.harness_worker", str(paths["job.json"]),
                 str(paths["result.json"])], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        alive, kill, exitcode = (lambda: popen.poll() is None), popen.kill, lambda: popen.returncode
    else:
        raise ValueError(f"isolation must be 'fork' or 'spawn', got {isolation!r}")
    seen, timed_out = 0, False
    while alive():
        time.sleep(POLL_S)
        seen = _report_progress(paths["progress"], seen, on_progress)
        if time.perf_counter() - t0 > timeout_s:
            kill()
            timed_out = True
            break
    if isolation == "fork":
        proc.join()
    else:
        popen.wait()
    _report_progress(paths["progress"], seen, on_progress)
    if paths["result.json"].exists() and not timed_out:
        result = json.loads(paths["result.json"].read_text())
    else:
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit status {exitcode()}"
        result = job_identity(job)
        result.update(requests=[], error=f"worker process died without a result ({why}); "
                                         f"log tail:\n{_tail(paths['log'])}")
    result["process_s"] = time.perf_counter() - t0
    result["log"] = str(paths["log"])
    return result


def _report_progress(path: Path, seen: int, on_progress: Callable[[int], None] | None) -> int:
    try:
        count = path.read_text().count("\n")
    except OSError:
        return seen
    if on_progress is not None and count > seen:
        on_progress(count - seen)
    return max(count, seen)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from benchmarks.harness import run_job

    write_json(Path(argv[1]), run_job(json.loads(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
