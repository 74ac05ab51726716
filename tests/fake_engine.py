"""Test doubles for the server tests: a FakeEngine with the real Engine's surface, and a live
uvicorn server on loopback.

Why a fake engine besides the real one: the real tiny checkpoint is random, so it never writes
a tool call, reasoning or a chosen multi-byte string. The fake replies with scripted text when the
prompt contains a trigger word (and deterministic pseudo-random tokens otherwise), fails on
demand, can be slowed down, and records what it was asked — so the HTTP layer's parsing,
streaming, cancellation and error paths are testable exactly. It mimics the real engine's event
stream: several tokens per "cycle", the EOS id included in the last event, ``cancelled()`` polled
once per cycle, draft statistics in ``stats``.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import uvicorn

from engine.api import GenerationEvent, GenerationRequest, GenerationStats, TokenLogprob
from sampling.params import SamplingOverrides, SamplingParamError

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Hello, world! héllo → 世界 🙂 naïve café. The weather in Paris is sunny today.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "Let me think about this step by step. The answer is 42.",
] * 4

#: prompt trigger -> scripted reply (the EOS id is appended)
SCRIPTS: dict[str, str] = {
    "TRIGGER_REASON": "The user greets me. I should answer.\n</think>\n\nHello there!",
    "TRIGGER_TOOL": (
        "I need the weather.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    "TRIGGER_TWO_TOOLS": (
        "Two cities.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    ),
    "TRIGGER_UNICODE": "héllo → 世界 🙂 naïve café",
    "TRIGGER_STOP": "one two three STOP four five",
    "TRIGGER_PLAIN": "The answer is 42.",
    # a number past the range of a double, as a model may write one
    "TRIGGER_HUGE_NUMBER": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n1e999\n</parameter>\n</function>\n</tool_call>"
    ),
}


@lru_cache(maxsize=1)
def tokenizer_dir() -> Path:
    """A tiny Qwen-style tokenizer folder, built once per test process."""
    import tempfile

    from engine.model.tokenizer_build import build_tokenizer

    out = Path(tempfile.mkdtemp(prefix="mtpserve-tok-"))
    build_tokenizer(CORPUS, 400, out)
    return out


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


class OneAtATime:
    """The engine's batch interface (``BatchDecoder``: ``add``, ``step``, ``drop``) over a test
    double's ``generate``: one row at a time, one event per step."""

    capacity = 1

    def __init__(self, generate: Callable[..., Iterator[GenerationEvent]]) -> None:
        self.generate = generate
        self.rows: dict[Any, Iterator[GenerationEvent]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: Any) -> bool:
        return key in self.rows

    def add(self, key: Any, request: GenerationRequest, cancelled: Callable[[], bool]) -> None:
        self.rows[key] = iter(self.generate(request, cancelled=cancelled))

    def drop(self, key: Any) -> None:
        events = self.rows.pop(key, None)
        if events is not None and hasattr(events, "close"):
            events.close()

    def step(self) -> list[tuple[Any, GenerationEvent | BaseException]]:
        out: list[tuple[Any, GenerationEvent | BaseException]] = []
        for key, events in list(self.rows.items()):
            try:
                out.append((key, next(events)))
            except StopIteration:
                del self.rows[key]
            except Exception as exc:
                del self.rows[key]
                out.append((key, exc))
        return out


class FakeEngine:
    """Same attributes and ``generate`` contract as ``engine.runtime.Engine``."""

    def __init__(
        self,
        tokenizer: Any | None = None,
        *,
        model_id: str = "fake-model",
        context_length: int = 4096,
        draft_tokens: int | None = 2,
        cycle_delay: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        self.model_id = model_id
        self.model_dir = tokenizer_dir()
        self.vocab_size = len(self.tokenizer) + 16  # padded head, as in Qwen checkpoints
        self.context_length = context_length
        ids = self.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        self.eos_token_ids = frozenset(ids)
        self.im_end = ids[0]
        self.sampling_defaults = SamplingOverrides(temperature=1.0, top_k=20, top_p=0.95)
        self.default_draft_tokens = draft_tokens
        self.cycle_delay = cycle_delay
        #: reported as ``stats.cached_tokens`` (what a conversation cache would have restored)
        self.cached_tokens = 0
        self.requests: list[GenerationRequest] = []
        self.threads: set[int] = set()
        self.active = 0
        self.max_active = 0
        self.cancel_seen: list[int] = []  # tokens emitted before a cancel was noticed
        self._clean = [
            i
            for i in range(len(self.tokenizer))
            if i not in self.tokenizer.all_special_ids
            and "\ufffd" not in self.tokenizer.decode([i])
            and "<" not in self.tokenizer.decode([i])
            and self.tokenizer.decode([i]).isprintable()
        ]

    # ------------------------------------------------------------------------------------
    def _reply(self, request: GenerationRequest, prompt: str) -> list[int]:
        # The trigger written last wins, so a later turn of a conversation gets its own reply.
        found = [(prompt.rfind(t), text) for t, text in SCRIPTS.items() if t in prompt]
        if found:
            text = max(found, key=lambda f: f[0])[1]
            return self.tokenizer.encode(text, add_special_tokens=False) + [self.im_end]
        s = request.sampling
        if s.greedy:
            rng = random.Random(hash(tuple(request.prompt_ids)))
        elif s.seed is not None:
            rng = random.Random(f"{s.seed}:{tuple(request.prompt_ids)}")
        else:
            rng = random.Random()
        # No EOS: runs to max_tokens (unless it hits a long run; keep it simple).
        return [rng.choice(self._clean) for _ in range(request.max_tokens)]

    def batch(self, capacity: int) -> OneAtATime:
        return OneAtATime(self.generate)

    def generate(
        self, request: GenerationRequest, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationEvent]:
        self.threads.add(threading.get_ident())
        self.requests.append(request)
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        prompt = self.tokenizer.decode(request.prompt_ids)
        if "TRIGGER_BAD_PARAM" in prompt:
            raise SamplingParamError("top_k", "the fake engine rejects this request")
        if "TRIGGER_CRASH_NOW" in prompt:
            raise RuntimeError("fake engine crashed before the first token")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            yield from self._decode(request, prompt, cancelled)
        finally:
            self.active -= 1

    def _decode(
        self, request: GenerationRequest, prompt: str, cancelled: Callable[[], bool]
    ) -> Iterator[GenerationEvent]:
        reply = self._reply(request, prompt)
        k = request.draft_tokens if isinstance(request.draft_tokens, int) else 2
        stats = GenerationStats(
            prompt_tokens=len(request.prompt_ids), cached_tokens=self.cached_tokens, draft_tokens=k
        )
        stop_ids = frozenset() if request.ignore_eos else request.stop_token_ids
        slow = "TRIGGER_SLOW" in prompt
        pos = 0
        generated = 0
        while True:
            if cancelled():
                self.cancel_seen.append(generated)
                yield GenerationEvent([], finish_reason="cancelled", stats=stats)
                return
            if "TRIGGER_CRASH_LATER" in prompt and stats.cycles == 3:
                raise RuntimeError("fake engine crashed mid-stream")
            if self.cycle_delay or slow:
                time.sleep(self.cycle_delay or 0.02)
            accepted = (pos * 7 + 3) % (k + 1) if k else 0
            step = reply[pos : pos + accepted + 1]
            pos += len(step)
            stats.cycles += 1
            stats.proposed += k
            finish = None
            keep = []
            for token in step:
                if generated >= request.max_tokens:
                    break
                keep.append(token)
                generated += 1
                if token in stop_ids:
                    finish = "stop"
                    break
            if finish is None and generated >= request.max_tokens:
                finish = "length"
            if finish is None and pos >= len(reply):
                finish = "length"
            stats.completion_tokens = generated
            logprobs = None
            if request.top_logprobs is not None:
                logprobs = [
                    TokenLogprob(
                        t,
                        -0.25,
                        [(t, -0.25)]
                        + [
                            (self._clean[j], -2.0 - j)
                            for j in range(max(0, request.top_logprobs - 1))
                        ],
                    )
                    for t in keep
                ]
            drafts = min(accepted, len(step) - 1)  # the last token of a cycle is the trunk's
            drafted = [j < drafts for j in range(len(keep))]
            stats.accepted += sum(drafted)  # as the engine counts: drafts that were emitted
            yield GenerationEvent(keep, logprobs, finish, stats, drafted, k)
            if finish is not None:
                return


def wait_healthy(url: str, exited: Callable[[], str | None], timeout: float) -> None:
    """Poll ``url``/health until it answers 200. ``exited()`` returns why the server process
    (or a rank of it) is gone, else None: start-up failed, so raise at once with that."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if (why := exited()) is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy in {timeout:.0f} s")
        time.sleep(0.2)


def metric(http: Any, name: str) -> float:
    """Sum of all samples of ``name`` in a live server's /metrics (``http``: an httpx client on
    it; labels are ignored unless part of ``name``)."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class LiveServer:
    """A real uvicorn server for ``app`` on 127.0.0.1 with a free port, in a daemon thread."""

    def __init__(self, app: Any, *, startup_timeout: float = 120.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
