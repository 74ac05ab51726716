"""Soak the server: many requests side by side, hostile ones and disconnects mixed in, resident
memory over time, and every innocent request's output against its output alone.

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

Every ``--hostile-every``-th request is hostile, the kinds in turn: a schema no JSON completes
(``{"$ref": "#"}``: 400 before it is queued), one that dead-ends after a few tokens (400 for
that request alone), a body beyond the 8 MiB limit (413), ``NaN`` / ``Infinity`` / ``1e999``
in the JSON (400), a cross-site ``text/plain`` post (403), 20 000 completion prompts (400
before tokenizing) and a non-streaming client that hangs up mid-generation. The conversation
cache's disk tier sits on a full filesystem (a 64 KiB tmpfs filled up, mounted when run as
root; ``--cache-dir`` names another): every write fails with ENOSPC. Innocent requests are
greedy or seeded; after the run each one that completed is sent again alone, and its text must
be the same. The report's ``checks`` must all hold (the exit status is 1 otherwise): no 5xx,
each hostile request answered as expected, every innocent output equal to its output alone,
the server healthy at the end, and resident memory at rest, less what the conversation cache
holds, within ``--max-rss-growth`` of the first sample.
Not a test: a make target (``make soak``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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


def innocent_body(i: int) -> dict:
    """Request ``i`` of the innocent traffic: greedy or seeded, so its text is reproducible."""
    rng = random.Random(i)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": rng.choice(PROMPTS) + f" ({i})"}],
        "max_tokens": rng.choice([8, 24, 48, 96]),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": i % 2**31,  # warm-up requests have negative indices
        "draft_tokens": rng.choice([None, None, 0, 2, 4]),
        "chat_template_kwargs": {"enable_thinking": False},
    }
    return {k: v for k, v in body.items() if v is not None}


async def one(
    client: httpx.AsyncClient, i: int, args: argparse.Namespace
) -> tuple[str, str | None]:
    """Send request ``i``: (its outcome, its text when it is an innocent request that finished)."""
    if args.hostile_every and i % args.hostile_every == args.hostile_every - 1:
        kind = HOSTILE[(i // args.hostile_every) % len(HOSTILE)]
        return await hostile(client, kind, i), None
    body = innocent_body(i)
    stream = i % 2 == 0
    hang_up = stream and i % args.disconnect_every == 0
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                return f"http {r.status_code}", None
            return "ok", r.json()["choices"][0]["message"]["content"]
        async with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            chunks, text = 0, []
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                if hang_up and chunks >= 2:
                    return "disconnected", None
                event = json.loads(line[6:])
                if "error" in event:
                    return "stream error", None
                for choice in event.get("choices", []):
                    text.append(choice["delta"].get("content") or "")
            return (
                ("ok", "".join(text)) if r.status_code == 200 else (f"http {r.status_code}", None)
            )
    except httpx.HTTPError as exc:
        return f"error {type(exc).__name__}", None


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


#: hostile kind -> the status it must get (None: the client hangs up, nothing to check)
HOSTILE: list[str] = [
    "unsatisfiable schema",
    "dead-end schema",
    "huge body",
    "non-finite numbers",
    "cross-site post",
    "too many prompts",
    "hang-up",
]
EXPECTED = {
    "unsatisfiable schema": 400,
    "dead-end schema": 400,
    "huge body": 413,
    "non-finite numbers": 400,
    "cross-site post": 403,
    "too many prompts": 400,
}


async def hostile(client: httpx.AsyncClient, kind: str, i: int) -> str:
    """One hostile request; ``"<kind>: <status>"`` (or ``"<kind>: hung up"``)."""
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Reply in JSON ({i})"}],
        "max_tokens": 64,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    json_type = {"content-type": "application/json"}
    try:
        if kind == "unsatisfiable schema":
            body = chat | {"response_format": _schema_format({"$ref": "#"})}
            r = await client.post("/v1/chat/completions", json=body)
        elif kind == "dead-end schema":
            forever = {
                "type": "object",
                "properties": {"a": {"$ref": "#/properties/a"}},
                "required": ["a"],
            }
            body = chat | {"response_format": _schema_format(forever)}
            r = await client.post("/v1/chat/completions", json=body)
        elif kind == "huge body":
            body = chat | {"messages": [{"role": "user", "content": "x" * (9 << 20)}]}
            r = await client.post("/v1/chat/completions", json=body)
        elif kind == "non-finite numbers":
            number = ["NaN", "Infinity", "1e999"][i % 3]
            raw = json.dumps(chat | {"temperature": 0.5}).replace("0.5", number)
            r = await client.post("/v1/chat/completions", content=raw, headers=json_type)
        elif kind == "cross-site post":
            headers = {"content-type": "text/plain", "origin": "https://evil.example"}
            r = await client.post("/v1/chat/completions", content=json.dumps(chat), headers=headers)
        elif kind == "too many prompts":
            body = {"model": "m", "prompt": ["again"] * 20_000, "max_tokens": 1}
            r = await client.post("/v1/completions", json=body)
        else:  # hang-up: a non-streaming client gone before its reply
            body = chat | {"max_tokens": 256, "ignore_eos": True}
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 0.5)
            return f"{kind}: hung up"
    except httpx.HTTPError as exc:
        return f"{kind}: error {type(exc).__name__}"
    return f"{kind}: {r.status_code}"


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict:
    """Rounds of ``--sample-every`` requests from ``--concurrency`` clients. Resident memory is
    sampled twice per round: in flight (when the round's middle request completes: the
    working set of the requests running then included) and at rest (after the round, once
    the server has no request running or waiting: what it holds between bursts)."""
    outcomes: dict[str, int] = {}
    texts: dict[int, str] = {}
    in_flight: list[tuple[int, float, int]] = []
    #: at rest, less the bytes the conversation cache holds (which grow to its budget by design)
    beside_cache: list[tuple[int, float, int]] = []
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
                    outcome, text = await one(client, i, args)
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    if text is not None:
                        texts[i] = text
                    done += 1
                    if done == middle and done >= 0:
                        in_flight.append((done, time.monotonic() - t0, rss_kib(pid)))

            await asyncio.gather(*(worker(queue, middle) for _ in range(args.concurrency)))
            if done >= 0:
                await _until_idle(client)
                at_rest.append((done, time.monotonic() - t0, rss_kib(pid)))
                cached = await _cache_bytes(client)
                beside_cache.append((done, time.monotonic() - t0, rss_kib(pid) - cached // 1024))
        metrics = (await client.get("/metrics")).text
        seconds = time.monotonic() - t0
        # every innocent request that finished, again alone: the same text
        mismatched = []
        for i, text in sorted(texts.items()):
            r = await client.post("/v1/chat/completions", json=innocent_body(i))
            if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != text:
                mismatched.append(i)
        healthy = (await client.get("/health")).status_code == 200
    totals = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(
            (
                "mtpserve_generations_total",
                "mtpserve_generation_tokens_total",
                "mtpserve_prompt_cache_bytes",
                "mtpserve_prompt_cache_errors",
            )
        )
    }
    rest = _series(beside_cache)
    wrong = {}
    for outcome, n in outcomes.items():
        kind, _, status = outcome.partition(": ")
        if kind in EXPECTED and status != str(EXPECTED[kind]):
            wrong[outcome] = n
    checks = {
        "no_5xx": not any(o.rsplit(" ", 1)[-1][:1] == "5" for o in outcomes),
        "no_stream_errors": "stream error" not in outcomes,
        "hostile_answered_as_expected": not wrong,
        "innocent_equal_alone": not mismatched,
        "healthy_at_end": healthy,
        "rss_flat": rest["growth"] <= args.max_rss_growth,
    }
    return {
        "requests": args.requests,
        "warmup_requests": args.warmup,
        "concurrency": args.concurrency,
        "seconds": seconds,
        "outcomes": outcomes,
        "innocent_compared": len(texts),
        "innocent_mismatched": mismatched,
        "hostile_wrong": wrong,
        "checks": checks,
        "at_rest": _series(at_rest),
        "at_rest_less_prompt_cache": rest,
        "in_flight": _series(in_flight),
        "metrics": totals,
    }


async def _cache_bytes(client: httpx.AsyncClient) -> int:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("mtpserve_prompt_cache_bytes "):
            return int(float(line.split()[1]))
    return 0


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
    parser.add_argument("--hostile-every", type=int, default=5, help="0: no hostile requests")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="the disk tier's folder (default: a full 64 KiB tmpfs when run as root, else none)",
    )
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args()
    with full_disk(args.cache_dir) as cache_dir:
        return run(args, cache_dir)


@contextlib.contextmanager
def full_disk(chosen: str | None) -> Iterator[str | None]:
    """``chosen``, else a 64 KiB tmpfs filled to the last byte (root only), else None."""
    if chosen is not None or os.geteuid() != 0:
        yield chosen
        return
    folder = tempfile.mkdtemp(prefix="mtpserve-soak-full-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", folder], capture_output=True
    )
    if mounted.returncode != 0:
        os.rmdir(folder)
        yield None
        return
    try:
        with contextlib.suppress(OSError), open(Path(folder) / "filler", "wb", buffering=0) as f:
            while True:  # until ENOSPC
                f.write(b"\0" * 512)
        yield folder
    finally:
        subprocess.run(["umount", folder], check=False)
        os.rmdir(folder)


def run(args: argparse.Namespace, cache_dir: str | None) -> int:
    port = free_port()
    cache = ["--prompt-cache-dir", cache_dir] if cache_dir else []
    server = subprocess.Popen(
        [sys.executable, "-m", "mtpserve", "serve", "--model", args.model, "--port",
         str(port), "--served-model-name", "m", "--log-level", "warning",
         "--prompt-cache-bytes", args.prompt_cache_bytes, *cache],
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
        report["cache_dir"] = cache_dir or "none (memory only)"
        report["checks"]["server_alive"] = server.poll() is None
    finally:
        server.terminate()
        server.wait(30)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
