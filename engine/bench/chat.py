"""``mtpserve bench-chat``: time to first token per turn of a long chat, with and without the
conversation cache (engine/cache/prefix_cache.py), in the same run, then after a restart that
resumes from the cache's disk tier.

The chat: the first user message pastes a long source file, later turns ask short follow-ups
with a snippet each, so the prompt grows past the model's context budget by the last turn
(a paste-then-discuss chat, as chat UIs and coding agents send). Every turn resends the whole
history rendered by the checkpoint's chat template (Qwen's drops earlier replies' thinking).
Per turn the same prompt runs once with the cache detached (a cold prefill of everything) and
once with it; the replies are checked equal. TTFT is the engine's: from ``generate`` to the
first token event (prefill + the first cycle), with no HTTP in between.

Also measured, because the cache's block is the prefill chunk: prefill speed of one long
prompt at several chunk sizes, and what one snapshot costs next to a block's KV.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.api import DEMO_MODEL, GenerationRequest
from engine.runtime import Engine, chat_prompt_ids
from sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
#: deterministic text from this checkout for the chat's messages (a folder, not named files,
#: so that moving code between its modules never leaves the bench without text)
SOURCES = sorted((ROOT / "engine" / "cycle").glob("*.py"))


def _texts(first_chars: int, turn_chars: int, turns: int) -> list[str]:
    text = "\n".join(p.read_text() for p in SOURCES)
    out = [text[:first_chars]]
    at = first_chars
    for _ in range(turns - 1):
        out.append(text[at : at + turn_chars])
        at += turn_chars
    return out


def _reply_start(tok: Any, messages: list[dict[str, str]], prompt: list[int]) -> int | None:
    """Where ``prompt``'s generation prompt begins (None if the history is not its prefix): the
    last turn's start the server asks the conversation cache to snapshot, found without knowing
    the chat format (the engine never imports the server's)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    history = tok.encode(text, add_special_tokens=False)
    return len(history) if prompt[: len(history)] == history else None


def _ttft(
    engine: Engine, prompt: list[int], max_tokens: int, k: int, snapshot_at: int | None = None
) -> tuple[float, list[int]]:
    request = GenerationRequest(
        prompt,
        SamplingParams(temperature=0.0),
        max_tokens,
        stop_token_ids=engine.eos_token_ids,
        draft_tokens=k,
        snapshot_at=snapshot_at,
    )
    t0 = time.perf_counter()
    first = None
    out: list[int] = []
    for event in engine.generate(request):
        if first is None and event.token_ids:
            first = time.perf_counter() - t0
        out += event.token_ids
    return first or 0.0, out


def run_chat(args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine.load(args.model, draft_tokens=args.draft_tokens)
    tok = engine.tokenizer
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="mtpserve-chat-cache-"))
    if cache_dir.exists():
        shutil.rmtree(cache_dir)
    engine.enable_prefix_cache(args.cache_bytes, cache_dir)
    cache = engine.prefix_cache
    texts = _texts(args.first_chars, args.turn_chars, args.turns)
    # warm-up: compile the decode blocks outside the measurements
    _ttft(engine, tok.encode("def warm(up):\n    pass\n"), 4, args.draft_tokens)
    cache.clear()
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful Python reviewer."}
    ]
    rows = []
    before_last = cache_dir.with_name(cache_dir.name + "-before-last-turn")
    for i, text in enumerate(texts):
        if i == len(texts) - 1:  # what a server restarted before the last turn finds on disk
            shutil.rmtree(before_last, ignore_errors=True)
            shutil.copytree(cache_dir, before_last)
        ask = "Review this file:\n" if i == 0 else "And this part:\n"
        messages.append({"role": "user", "content": ask + text})
        prompt = chat_prompt_ids(tok, messages)
        at = _reply_start(tok, messages, prompt)
        engine.prefix_cache = None
        cold, cold_out = _ttft(engine, prompt, args.max_tokens, args.draft_tokens)
        engine.prefix_cache = cache
        before = cache.counters.reused_tokens
        warm, warm_out = _ttft(engine, prompt, args.max_tokens, args.draft_tokens, at)
        reused = cache.counters.reused_tokens - before
        if warm_out != cold_out:
            raise RuntimeError(f"turn {i + 1}: the cached reply differs from the cold one")
        reply = tok.decode(warm_out, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": len(prompt),
                "cached_tokens": reused,
                "ttft_cold_s": cold,
                "ttft_cached_s": warm,
                "speedup": cold / warm if warm else 0.0,
            }
        )
        print(
            f"turn {i + 1:2d}: prompt {len(prompt):5d}  cached {reused:5d}  "
            f"cold {cold * 1000:8.1f} ms  cached {warm * 1000:8.1f} ms  {cold / warm:6.1f}x",
            flush=True,
        )
    held = cache.bytes_held
    # A restart: a new engine whose cache starts empty in memory and finds the disk tier.
    last_prompt = chat_prompt_ids(tok, messages[:-1])
    del engine, cache
    restarted = Engine.load(args.model, draft_tokens=args.draft_tokens)
    _ttft(restarted, tok.encode("def warm(up):\n    pass\n"), 4, args.draft_tokens)
    cold, cold_out = _ttft(restarted, last_prompt, args.max_tokens, args.draft_tokens)
    # the disk tier as it was after turn N-1: the last turn resumes a chat of the old server
    restarted.enable_prefix_cache(args.cache_bytes, before_last)
    disk_cache = restarted.prefix_cache
    at = _reply_start(tok, messages[:-1], last_prompt)
    warm, warm_out = _ttft(restarted, last_prompt, args.max_tokens, args.draft_tokens, at)
    if warm_out != cold_out:
        raise RuntimeError("the reply restored from disk differs from the cold one")
    restart = {
        "prompt_tokens": len(last_prompt),
        "cached_tokens": disk_cache.counters.reused_tokens,
        "ttft_cold_s": cold,
        "ttft_disk_s": warm,
        "speedup": cold / warm if warm else 0.0,
        "disk_loads": disk_cache.counters.disk_loads,
    }
    print(
        f"restart, last turn from disk: cached {restart['cached_tokens']}  cold "
        f"{cold * 1000:.1f} ms  disk {warm * 1000:.1f} ms  {restart['speedup']:.1f}x",
        flush=True,
    )
    return {"turns": rows, "restart": restart, "bytes_held": held}


def chunk_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Cold prefill speed of one long prompt per chunk size (the cache's block size)."""
    engine = Engine.load(args.model, draft_tokens=args.draft_tokens)
    text = "\n".join(p.read_text() for p in SOURCES)
    prompt = engine.tokenizer.encode(text)[: args.sweep_tokens]
    times: dict[int, list[float]] = {chunk: [] for chunk in args.chunks}
    for _ in range(args.repeats):  # interleaved rounds: a load change hits every size alike
        for chunk in args.chunks:
            engine.prefill_chunk = chunk
            times[chunk].append(_ttft(engine, prompt, 1, 0)[0])
    out = []
    for chunk, seen in times.items():
        best = min(seen)
        out.append({"chunk": chunk, "prefill_s": best, "tokens_per_s": len(prompt) / best})
        print(f"chunk {chunk:4d}: {len(prompt)} tokens in {best * 1000:.0f} ms (best)", flush=True)
    engine.enable_prefix_cache(1 << 30, block_tokens=256)
    _ttft(engine, prompt[:600], 1, 2)
    cache = engine.prefix_cache
    snap = next(s for b in cache._all_blocks() for s in b.snapshots.values())
    gdn = sum(
        a.nbytes for i, pair in enumerate(snap.layers) if not cache.is_attention[i] for a in pair
    )
    block = next(b for b in cache._all_blocks() if b.kv is not None)
    sizes = {"gdn_snapshot_bytes": gdn, "kv_bytes_per_token": block.nbytes / cache.block_tokens}
    print(f"one GDN snapshot {gdn} bytes; KV + head KV {sizes['kv_bytes_per_token']:.0f} B/token")
    return [*out, sizes]


def cmd_bench_chat(args: argparse.Namespace) -> int:
    args.chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    if args.one_thread:
        # On a machine shared with other jobs, BLIS's threads spin against them and a prefill
        # on "every core" ran 10x slower than on one (engine.blas.all_cores is a no-op now).
        import engine.blas

        engine.blas._set_threads = None
    result: dict[str, Any] = {"command": "mtpserve " + " ".join(sys.argv[1:])}
    if args.chunks:
        result["chunk_sweep"] = chunk_sweep(args)
    result.update(run_chat(args))
    speedups = [r["speedup"] for r in result["turns"]]
    result["median_speedup"] = statistics.median(speedups)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        turns = [r["turn"] for r in result["turns"]]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(turns, [r["ttft_cold_s"] * 1000 for r in result["turns"]], "o-", label="no cache")
        ax.plot(turns, [r["ttft_cached_s"] * 1000 for r in result["turns"]], "o-", label="cache")
        ax.set_xlabel("turn")
        ax.set_ylabel("time to first token (ms)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "chat_ttft.png", dpi=100)
    except ImportError:
        pass
    return 0


def register(sub: Any) -> None:

    p = sub.add_parser("bench-chat", help="TTFT per turn of a long chat, with/without the cache")
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--first-chars", type=int, default=7200, help="the first message's paste")
    p.add_argument("--turn-chars", type=int, default=300, help="each later message's snippet")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cache-bytes", type=int, default=1 << 30)
    p.add_argument("--cache-dir", default=None, help="disk tier (default: a fresh temp folder)")
    p.add_argument("--chunks", default="128,256,512", help="chunk sizes to sweep ('' to skip)")
    p.add_argument("--sweep-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--one-thread", action="store_true", help="prefill on one BLAS thread (a shared machine)"
    )
    p.add_argument("--out", default="bench-results")
    p.set_defaults(func=cmd_bench_chat)
