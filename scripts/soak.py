"""Soak the server: many requests side by side, disconnects mixed in, resident memory over time.

    python scripts/soak.py [--requests 500] [--concurrency 8] [--model models/qwen3.5-demo]

Starts ``mtpserve serve`` on a free port (the demo model by default), sends ``--requests`` chat
requests from ``--concurrency`` clients (streaming and not, greedy and sampled, automatic and
fixed K, varied lengths), and every ``--disconnect-every``-th streaming client hangs up after
its first chunks. First ``--warmup`` requests of the same traffic run unmeasured (each new batch
size and draft length compiles its blocks once), then the server's resident memory (VmRSS) is
sampled for every round of ``--sample-every`` requests, in flight and at rest (``soak``).
Prints a JSON report: both RSS series and their change over the measured requests, outcomes by
kind (warm-up included), and the server's /metrics totals, the conversation cache's bytes
among them. The conversation cache keeps every conversation's state up to its byte budget
(``--prompt-cache-bytes``, 1 GiB by default, here 64 MiB unless ``--prompt-cache-bytes`` is
given) and memory grows with it until the budget is reached: what must stay flat is the rest.
Not a test: a make target (``make soak``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer briefly.",
    "List three prime numbers.",
    "Explain what a hash map is in one paragraph.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish.",
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(client: httpx.AsyncClient, i: int, args: argparse.Namespace) -> str:
    rng = random.Random(i)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": rng.choice(PROMPTS) + f" ({i})"}],
        "max_tokens": rng.choice([8, 24, 48, 96]),
        "temperature": rng.choice([0.0, 0.7]),
        "draft_tokens": rng.choice([None, None, 0, 2, 4]),
        "chat_template_kwargs": {"enable_thinking": False},
    }
    body = {k: v for k, v in body.items() if v is not None}
    stream = i % 2 == 0
    hang_up = stream and i % args.disconnect_every == 0
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            return "ok" if r.status_code == 200 else f"http {r.status_code}"
        async with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: {")
                if hang_up and chunks >= 2:
                    return "disconnected"
            return "ok" if r.status_code == 200 else f"http {r.status_code}"
    except httpx.HTTPError as exc:
        return f"error {type(exc).__name__}"


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict:
    """Rounds of ``--sample-every`` requests from ``--concurrency`` clients. Resident memory is
    sampled twice per round: in flight (when the round's middle request completes: the
    working set of the requests running then included) and at rest (after the round, once
    the server has no request running or waiting: what it holds between bursts)."""
    outcomes: dict[str, int] = {}
    in_flight: list[tuple[int, float, int]] = []
    at_rest: list[tuple[int, float, int]] = []
    t0 = time.monotonic()
    done = -args.warmup
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        # warm-up: the same kind of traffic first, so that the measured requests find the
        # shapes they run compiled (each new batch size x draft length compiles its blocks once)
        for first in range(-args.warmup, args.requests, args.sample_every):
            queue = list(range(first, min(first + args.sample_every, args.requests)))
            middle = first + len(queue) // 2

            async def worker(queue: list[int], middle: int) -> None:
                nonlocal done
                while queue:
                    i = queue.pop(0)
                    outcome = await one(client, i, args)
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    done += 1
                    if done == middle and done >= 0:
                        in_flight.append((done, time.monotonic() - t0, rss_kib(pid)))

            await asyncio.gather(*(worker(queue, middle) for _ in range(args.concurrency)))
            if done >= 0:
                await _until_idle(client)
                at_rest.append((done, time.monotonic() - t0, rss_kib(pid)))
        metrics = (await client.get("/metrics")).text
    totals = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(
            (
                "mtpserve_generations_total",
                "mtpserve_generation_tokens_total",
                "mtpserve_prompt_cache_bytes",
            )
        )
    }
    return {
        "requests": args.requests,
        "warmup_requests": args.warmup,
        "concurrency": args.concurrency,
        "seconds": time.monotonic() - t0,
        "outcomes": outcomes,
        "at_rest": _series(at_rest),
        "in_flight": _series(in_flight),
        "metrics": totals,
    }


async def _until_idle(client: httpx.AsyncClient) -> None:
    """Wait until the server has no generation running or queued (then it has released what
    the last requests held: engine.model.memory.release_between_requests)."""
    while True:
        text = (await client.get("/metrics")).text
        busy = sum(
            float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(("mtpserve_running ", "mtpserve_queue_depth "))
        )
        if busy == 0:
            await asyncio.sleep(0.2)  # the worker thread releases right after its last row
            return
        await asyncio.sleep(0.05)


def _series(samples: list[tuple[int, float, int]]) -> dict:
    """RSS samples (MiB) with the change from the first to the last, the peak over the first,
    and the least-squares trend over the measured requests (as a fraction of the first)."""
    mib = [kib / 1024 for _, _, kib in samples]
    n = [float(done) for done, _, _ in samples]
    mean_n, mean_m = sum(n) / len(n), sum(mib) / len(mib)
    spread = sum((x - mean_n) ** 2 for x in n) or 1.0
    slope = sum((x - mean_n) * (y - mean_m) for x, y in zip(n, mib, strict=True)) / spread
    return {
        "rss_mib": [
            (d, round(t, 1), round(m, 1)) for (d, t, _), m in zip(samples, mib, strict=True)
        ],
        "first_mib": round(mib[0], 1),
        "last_mib": round(mib[-1], 1),
        "peak_mib": round(max(mib), 1),
        "growth": round(mib[-1] / mib[0] - 1, 4),
        "peak_over_first": round(max(mib) / mib[0] - 1, 4),
        "trend_over_run": round(slope * (n[-1] - n[0]) / mib[0], 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=500, help="requests before measuring")
    parser.add_argument("--disconnect-every", type=int, default=6)
    parser.add_argument("--sample-every", type=int, default=25)
    parser.add_argument("--prompt-cache-bytes", default=str(64 << 20))
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mtpserve", "serve", "--model", args.model, "--port",
         str(port), "--served-model-name", "m", "--log-level", "warning",
         "--prompt-cache-bytes", args.prompt_cache_bytes],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        report = asyncio.run(soak(url, server.pid, args))
    finally:
        server.terminate()
        server.wait(30)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
