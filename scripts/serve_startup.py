"""`mtpserve serve` as a user starts it: from launch to /health, and its first sampled request.

    python scripts/serve_startup.py runs/shapes/qwen3.5-0.8B [--max-tokens 1]

Starts `mtpserve serve` (auto K, the checkpoint's own sampler, a fresh cost cache, the prompt
cache off so that a repeated request prefills again), polls /health, then sends the same
completion request twice and prints one JSON object: seconds from launch to the "weights
loaded" log line and to /health answering, and each request's time to its first streamed
chunk and to its end. With ``--max-tokens 1`` a request is its prefill plus the one cycle that
yields the first token (random-weight checkpoints decode to text that streams as empty
chunks, so the end is what is timed); the first request's time over the second's is what it
spent on measurement or compilation. The server's log goes to stderr, timed from launch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)  # the first ten:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for /health")
    args = parser.parse_args()

    port = free_port()
    env = dict(os.environ, MTPSERVE_CACHE=tempfile.mkdtemp(prefix="mtpserve-cache-"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "mtpserve", "serve", "--model", args.model]
    command += ["--port", str(port), "--prompt-cache-bytes", "0"]
    t0 = time.monotonic()
    server = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    marks: dict[str, float] = {}

    def relay() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            at = time.monotonic() - t0
            print(f"{at:7.2f}s {line.rstrip()}", file=sys.stderr)
            if "weights loaded" in line:
                marks["weights_loaded"] = at

    threading.Thread(target=relay, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                print(f"serve exited with status {server.returncode}", file=sys.stderr)
                return 1
            if time.monotonic() - t0 > args.timeout:
                print("no /health within the timeout", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        ready = time.monotonic() - t0
        name = httpx.get(base + "/v1/models").json()["data"][0]["id"]

        def request() -> dict[str, float | None]:
            body = {"model": name, "prompt": PROMPT, "max_tokens": args.max_tokens}
            t = time.perf_counter()
            first = None
            with httpx.stream(
                "POST", base + "/v1/completions", json=body | {"stream": True}, timeout=None
            ) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter() - t
            return {"first_chunk": first, "end": time.perf_counter() - t}

        first, again = request(), request()
    finally:
        server.terminate()
        server.wait(60)
    loaded = marks.get("weights_loaded")
    out = {
        "model": args.model,
        "weights_loaded_seconds": loaded,
        "health_seconds": ready,
        "ready_after_weights_seconds": None if loaded is None else ready - loaded,
        "first_request": first,
        "again": again,
        "first_request_extra_seconds": first["end"] - again["end"],
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
