"""The conversation cache (engine/cache/prefix_cache.py) against cold runs.

* Through real uvicorn servers and the openai SDK: a 10-turn chat on a server with the cache
  returns on every turn exactly what a server without it returns — greedy and seeded sampling,
  K=0 and K>=1, on the demo model and the tiny dense and MoE checkpoints — including the turns
  after a stop-string cut, an EOS stop, a max_tokens stop and a client that disconnected.
* In the engine: every kind of stop (an EOS accepted inside a draft block, max_tokens,
  cancellation) leaves a snapshot of exactly the tokens committed, which the next turn reuses
  (``cached_tokens``) with a cold run's output; a re-rendered history reuses up to the last
  snapshot before the first differing token; the byte budget holds; a system prompt shared by
  20 chats is stored once; the disk tier resumes after a restart and skips bad files; a client
  cancelling during a 4k-token prefill lets the next request start within one chunk.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from checkpoints import VARIANTS
from fake_engine import LiveServer

from engine.api import GenerationRequest
from sampling.params import SamplingParams
from server.app import create_app
from server.core.chat_format import ChatFormat
from server.settings import ServerSettings

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
TINY_BLOCK = 32
GREEDY = SamplingParams(temperature=0.0)


def load(model: Path, budget: int, block: int, draft: int | None = 2) -> Any:
    from engine.runtime import Engine

    engine = Engine.load(str(model), draft_tokens=draft)
    engine.enable_prefix_cache(budget, block_tokens=block)
    return engine


# -- a 10-turn chat through two real servers ---------------------------------------------------
@pytest.fixture(scope="module", params=["demo", "dense-tied", "moe-tied"])
def servers(request: pytest.FixtureRequest, make_checkpoint: Any):
    name = request.param
    model = DEMO if name == "demo" else make_checkpoint(VARIANTS[name])
    block = 256 if name == "demo" else TINY_BLOCK
    pair = []
    for budget in (64 << 20, 0):  # warm (cached), cold (no cache; the same prefill chunks)
        settings = ServerSettings(model=str(model), served_model_names=["m"])
        app = create_app(lambda b=budget: load(model, b, block), settings)
        pair.append(LiveServer(app).__enter__())
    yield name, pair[0], pair[1]
    for srv in pair:
        srv.stop()


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, messages: list[dict], turn: dict[str, Any]) -> Any:
    extra = {"draft_tokens": turn["k"]}
    if "ignore_eos" in turn:
        extra["ignore_eos"] = turn["ignore_eos"]
    kw: dict[str, Any] = dict(
        model="m",
        messages=messages,
        max_tokens=turn.get("max_tokens", 16),
        extra_body=extra,
    )
    if turn.get("seed") is not None:
        kw.update(temperature=0.8, top_p=0.95, seed=turn["seed"])
        extra["top_k"] = 20
    else:
        kw.update(temperature=0)
    for key in ("stop", "logit_bias"):
        if key in turn:
            kw[key] = turn[key]
    return client.chat.completions.create(**kw)


def _reply(r: Any) -> tuple[str, str, int]:
    c = r.choices[0]
    return c.message.content or "", c.finish_reason, r.usage.completion_tokens


def _metric(srv: LiveServer, key: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def _cancelled(srv: LiveServer) -> float:
    return _metric(srv, 'mtpserve_generations_total{outcome="cancelled"}')


def test_ten_turn_chat_equals_a_cold_server(servers: Any) -> None:
    name, warm_srv, cold_srv = servers
    warm, cold = _client(warm_srv), _client(cold_srv)
    eos = min(warm_srv.app.state.mtp.engine.eos_token_ids)
    turns: list[dict[str, Any]] = [
        {"k": 2},
        {"k": 3, "seed": 11},
        {"k": 0},
        {"k": 3, "stop": "pick"},  # a stop string chosen from the cold output below
        {"k": 2, "seed": 5},  # after a stop-string cut
        {"k": 3, "logit_bias": {str(eos): 6}},  # an EOS stop
        {"k": 3, "max_tokens": 5},  # a max_tokens stop
        {"k": 2, "cancel": True},  # a client that disconnects
        {"k": 0, "seed": 7},  # after the disconnect
        {"k": 2},
    ]
    messages = [{"role": "system", "content": "You write short Python helpers."}]
    prompt_tokens = 0
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": f"Turn {i}: write def f{i}(x) for me."})
        if turn.get("cancel"):
            before = _cancelled(warm_srv)
            stream = warm.chat.completions.create(
                model="m",
                messages=messages,
                # long enough that only the disconnect can end it
                max_tokens=warm_srv.app.state.mtp.engine.context_length - prompt_tokens - 200,
                temperature=0,
                stream=True,
                extra_body={"draft_tokens": 2, "ignore_eos": True},
            )
            partial = ""
            for n, chunk in enumerate(stream):
                partial += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                if n >= 3:  # a few chunks (content or reasoning), then leave
                    break
            stream.close()  # the client goes away mid-generation
            messages.append({"role": "assistant", "content": partial})
            continue
        if turn.get("stop") == "pick":
            text = _reply(_ask(cold, messages, {"k": turn["k"]}))[0]
            spans = [text[j : j + 2] for j in range(3, len(text) - 2)]
            spans = [s for s in spans if s.strip() and "\ufffd" not in s]
            turn = {**turn, "stop": spans[0]} if spans else {"k": turn["k"]}
        w, c = _ask(warm, messages, turn), _ask(cold, messages, turn)
        assert _reply(w) == _reply(c), f"{name}: turn {i} differs from a cold server"
        assert c.usage.prompt_tokens_details.cached_tokens == 0
        cached = w.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (i > 0) and cached < w.usage.prompt_tokens
        prompt_tokens = w.usage.prompt_tokens
        if i == 8:
            assert _cancelled(warm_srv) == before + 1, "the disconnected turn was not cancelled"
        messages.append({"role": "assistant", "content": _reply(w)[0]})
    # the same prompt again, streamed: the final usage chunk counts the whole prompt as cached
    # (its end was snapshotted), and so does the completions endpoint
    chunks = list(
        warm.chat.completions.create(
            model="m",
            messages=messages[:-1],
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    ids = list(range(40, 140))
    for expect in (0, len(ids) - 1):
        r = warm.completions.create(model="m", prompt=ids, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == expect
    # n > 1 prefills once: the later choices restore the first one's prompt snapshot
    before = _metric(warm_srv, "mtpserve_prompt_cache_reused_tokens_total")
    r = warm.completions.create(model="m", prompt=ids[:70], max_tokens=2, temperature=0, n=3)
    reused = _metric(warm_srv, "mtpserve_prompt_cache_reused_tokens_total") - before
    first = 0 if name == "demo" else 2 * TINY_BLOCK  # block ends within the 70 tokens
    assert r.usage.prompt_tokens_details.cached_tokens == first
    assert reused == r.usage.prompt_tokens_details.cached_tokens + 2 * 69
    assert _metric(warm_srv, "mtpserve_prompt_cache_bytes") > 0


# -- engine-level: stops, re-rendering, budget, sharing, disk, cancellation ------------------
@pytest.fixture(scope="module")
def tiny(make_checkpoint: Any) -> Any:
    return load(make_checkpoint(VARIANTS["dense-tied"]), 16 << 20, TINY_BLOCK, draft=3)


def run(engine: Any, prompt: list[int], cached: bool = True, **kw: Any) -> tuple[list[int], Any]:
    """Generate; ``cached=False`` runs with the cache detached (a cold run)."""
    saved = engine.prefix_cache
    if not cached:
        engine.prefix_cache = None
    cancel_after = kw.pop("cancel_after", None)
    trace = kw.pop("trace", None)
    request = GenerationRequest(
        prompt,
        kw.pop("sampling", GREEDY),
        kw.pop("max_tokens", 30),
        stop_token_ids=kw.pop("stop_ids", frozenset()),
        draft_tokens=kw.pop("k", 3),
        snapshot_at=kw.pop("snapshot_at", None),
    )
    events = 0

    def cancelled() -> bool:
        return cancel_after is not None and events >= cancel_after

    out, stats, finish = [], None, None
    try:
        for event in engine.generate(request, cancelled, trace):
            events += 1
            out += event.token_ids
            stats, finish = event.stats, event.finish_reason
    finally:
        engine.prefix_cache = saved
    if saved is not None and saved.writer is not None:
        saved.writer.drain()  # its disk tier written, as a later process would find it
    stats.finish = finish
    return out, stats


def _prompt(seed: int, n: int, vocab: int = 300) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.fast
def test_every_stop_leaves_exactly_the_committed_tokens(tiny: Any) -> None:
    prompt = _prompt(1, 45)
    cycles: list[dict] = []
    full, _ = run(tiny, prompt, cached=False, trace=cycles.append, max_tokens=40)
    # An EOS accepted as a draft with more tokens after it in the same block: make such a
    # draft the stop token (greedy, so the run repeats the same cycles up to it).
    at, stop = 0, None
    for c in cycles:
        if c["accepted"] >= 1 and c["emitted"][0] not in full[:at]:
            stop = c["emitted"][0]
            break
        at += len(c["emitted"])
    assert stop is not None, "no accepted draft in 40 tokens"
    kinds = {
        "eos in a draft block": dict(stop_ids=frozenset({stop}), max_tokens=40),
        "max_tokens": dict(max_tokens=7),
        "cancelled": dict(cancel_after=2),
    }
    for i, (kind, kw) in enumerate(kinds.items()):
        tiny.prefix_cache.clear()
        head = prompt
        trace: list[dict] = []
        out, stats = run(tiny, head, trace=trace.append, **kw)
        if kind == "eos in a draft block":
            assert out[-1] == stop and stats.finish == "stop"
            assert trace[-1]["accepted"] >= 1 and trace[-1]["draft"][0] == stop
        follow = head + out + _prompt(20 + i, 9)
        warm, wstats = run(tiny, follow)
        cold, _ = run(tiny, follow, cached=False)
        assert warm == cold, kind
        # the generation's snapshot holds exactly prompt + returned tokens (minus the last)
        assert wstats.cached_tokens == len(head) + len(out) - 1, kind


def test_seeded_and_plain_turns_equal_cold(tiny: Any) -> None:
    tiny.prefix_cache.clear()
    prompt = _prompt(2, 70)
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=3)
    for k in (0, 3):
        first, _ = run(tiny, prompt, sampling=seeded, k=k)
        follow = prompt + first + _prompt(3, 40)
        warm, stats = run(tiny, follow, sampling=seeded, k=k)
        assert stats.cached_tokens > len(prompt)
        assert warm == run(tiny, follow, cached=False, sampling=seeded, k=k)[0]


def test_a_scored_prompt_restores_nothing_and_equals_a_cold_run(tiny: Any) -> None:
    """A request that scores its prompt (``prompt_logprobs``: completions' echo with logprobs)
    has logits for every prompt position, so it prefills the prompt whole even where the cache
    holds it: the scores, the tokens and the snapshots it leaves equal a cold run's, and the
    scores of a prompt that ends with generated tokens are those tokens' own logprobs."""
    tiny.prefix_cache.clear()
    prompt = _prompt(5, 70)
    first, _ = run(tiny, prompt, max_tokens=8)
    follow = prompt + first

    def scored(cached: bool) -> tuple[list[int], list[Any], Any]:
        saved = tiny.prefix_cache
        if not cached:
            tiny.prefix_cache = None
        request = GenerationRequest(follow, GREEDY, 6, draft_tokens=3, prompt_logprobs=2)
        try:
            events = list(tiny.generate(request))
        finally:
            tiny.prefix_cache = saved
        tokens = [t for e in events for t in e.token_ids]
        return tokens, events[0].prompt_logprobs, events[-1].stats

    assert run(tiny, follow, max_tokens=6)[1].cached_tokens > 0  # the cache holds the prompt
    tokens, scores, stats = scored(cached=True)
    cold_tokens, cold_scores, _ = scored(cached=False)
    assert stats.cached_tokens == 0 and tokens == cold_tokens
    assert [s.token_id for s in scores] == follow[1:] and scores == cold_scores
    assert all(len(s.top) == 2 and s.top[0][1] >= s.logprob for s in scores)
    own = GenerationRequest(prompt, GREEDY, 8, draft_tokens=3, top_logprobs=0)
    generated = [lp for e in tiny.generate(own) for lp in e.logprobs or []]
    assert [lp.token_id for lp in generated] == first
    assert [s.logprob for s in scores[-len(first) :]] == pytest.approx(
        [lp.logprob for lp in generated], abs=2e-3
    )
    # what it left in the cache serves a later turn exactly
    later = follow + _prompt(6, 20)
    assert run(tiny, later)[0] == run(tiny, later, cached=False)[0]


def test_re_rendered_history_reuses_up_to_the_last_snapshot(tiny: Any) -> None:
    """A template that drops the previous reply's <think> block: the next prompt differs from
    the cached turn right after the reply's turn header; reuse stops at the last snapshot
    before that (a block end or the previous prompt's last turn marker)."""
    tiny.prefix_cache.clear()
    tok = tiny.tokenizer
    system = tok.apply_chat_template(
        [{"role": "system", "content": "def helper(x):\n    return x\n" * 6}], tokenize=False
    )
    msgs = [{"role": "user", "content": "write a parser"}]
    text1 = system + tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    p1 = tok.encode(text1, add_special_tokens=False)
    # as the server asks: a snapshot where the prompt's last turn begins
    chat = ChatFormat.of(tok)
    reply, _ = run(tiny, p1, max_tokens=12, snapshot_at=chat.last_turn_start(p1))
    # the next turn, rendered without the reasoning of the previous reply
    text2 = text1[: text1.rindex("<|im_start|>")] + (
        "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    p2 = tok.encode(text2, add_special_tokens=False)
    first_diff = next(i for i, (a, b) in enumerate(zip(p1 + reply, p2, strict=False)) if a != b)
    marker = len(p1) - 1 - p1[::-1].index(tok.convert_tokens_to_ids("<|im_start|>"))
    blocks = [b for b in range(0, first_diff + 1, TINY_BLOCK) if b <= len(p1) - 1]
    expected = max([marker, *blocks])
    assert marker <= first_diff < len(p1)
    warm, stats = run(tiny, p2, max_tokens=12, snapshot_at=chat.last_turn_start(p2))
    assert stats.cached_tokens == expected
    assert warm == run(tiny, p2, cached=False, max_tokens=12)[0]


def _held(cache: Any) -> int:
    """Bytes of every array the cache holds, counted from its trie (each block once)."""
    total = 0
    for block in cache._all_blocks():
        total += block.nbytes
        total += sum(s.nbytes for s in block.snapshots.values() if s.loaded)
    return total


@pytest.mark.fast
def test_budget_is_never_exceeded(make_checkpoint: Any) -> None:
    engine = load(make_checkpoint(VARIANTS["dense-tied"]), 1 << 20, TINY_BLOCK, draft=2)
    cache = engine.prefix_cache
    for i in range(12):
        run(engine, _prompt(100 + i, 90), max_tokens=8, k=2)
        assert cache.bytes_held == _held(cache) <= cache.budget_bytes
    assert cache.counters.evictions > 0 and cache.counters.stored > cache.snapshots


def test_system_prompt_shared_by_20_chats_is_stored_once(tiny: Any) -> None:
    cache = tiny.prefix_cache
    cache.clear()
    system = _prompt(7, 4 * TINY_BLOCK)  # four full blocks
    run(tiny, system + _prompt(200, 5), max_tokens=2)
    one_chat = cache.bytes_held
    shared = sum(b.nbytes for b in cache._all_blocks())
    for i in range(1, 20):
        run(tiny, system + _prompt(200 + i, 5), max_tokens=2)
    assert cache.bytes_held == _held(cache)
    assert len(cache.root.children) == 1  # one path of system-prompt blocks
    private = one_chat - shared
    # 20 chats: the shared blocks once, plus each chat's own snapshots
    assert cache.bytes_held <= shared + 20 * private
    assert cache.bytes_held < 20 * shared


@pytest.mark.fast
def test_disk_tier_resumes_after_restart_and_skips_bad_files(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    model = make_checkpoint(VARIANTS["dense-tied"])
    first = load(model, 16 << 20, TINY_BLOCK)
    first.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
    prompt = _prompt(9, 100)
    out, _ = run(first, prompt, k=2)
    follow = prompt + out + _prompt(10, 20)
    restarted = load(model, 0, TINY_BLOCK)
    restarted.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
    warm, stats = run(restarted, follow, k=2)
    assert stats.cached_tokens == len(prompt) + len(out) - 1
    assert warm == run(restarted, follow, cached=False, k=2)[0]
    # a corrupt file and a foreign one are skipped (logged), never served
    for path in tmp_path.glob("s-*.mtpc"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    (tmp_path / "s-foreign.mtpc").write_bytes(b"not a cache file")
    again = load(model, 0, TINY_BLOCK)
    again.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
    warm, stats = run(again, follow, k=2)
    assert stats.cached_tokens == 0 and again.prefix_cache.counters.disk_rejected >= 1
    assert warm == run(again, follow, cached=False, k=2)[0]


def test_cancel_during_a_4k_prefill_frees_the_worker_within_one_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Order of events, no timing: the long prompt is cancelled while its first chunk runs;
    the next queued request's first forward comes right after that chunk."""
    import engine.cycle.sequence as sequence
    import engine.cycle.speculative as speculative
    from server.core.scheduler import Scheduler

    calls: list[tuple[str, int]] = []
    handles: list[Any] = []
    real = sequence.trunk_hidden

    def traced(trunk: Any, ids: Any, cache: Any, capture: bool) -> Any:
        calls.append(("cycle" if capture else "prefill", ids.shape[1]))
        if len(calls) == 1:
            handles[0].cancel()  # the client disconnects during the first chunk
        return real(trunk, ids, cache, capture)

    sched = Scheduler(lambda: load(DEMO, 64 << 20, 256))
    sched.start()
    engine = sched.wait_ready(120)
    monkeypatch.setattr(sequence, "trunk_hidden", traced)  # the prefill's chunks
    monkeypatch.setattr(speculative, "trunk_hidden", traced)  # a lone row's verify
    long_prompt = _prompt(5, 4000, vocab=8000)
    short = _prompt(6, 20, vocab=8000)

    async def main() -> list[str | None]:
        handles.extend(
            sched.submit(
                [
                    GenerationRequest(long_prompt, GREEDY, 1, draft_tokens=2),
                    GenerationRequest(short, GREEDY, 2, draft_tokens=2),
                ]
            )
        )
        finishes = []
        for h in handles:
            last = None
            async for event in h:
                last = event.finish_reason
            finishes.append(last)
        return finishes

    try:
        finishes = asyncio.run(main())
    finally:
        sched.shutdown()
    assert finishes == ["cancelled", "length"]
    assert engine.prefill_chunk == 256 and len(long_prompt) > 15 * 256
    # the long prompt ran one chunk; the short one's prefill came next
    assert calls[0] == ("prefill", 256) and calls[1] == ("prefill", len(short) - 1)


@pytest.mark.fast
def test_cli_flags_reach_the_settings(tmp_path: Path) -> None:
    import argparse

    from server.serve import add_serve_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--prompt-cache-bytes", "0", "--prompt-cache-dir", str(tmp_path)]
        + ["--prompt-cache-disk-bytes", "1000"]
    )
    settings = settings_from_args(args)
    assert settings.prompt_cache_bytes == 0 and settings.prompt_cache_dir == str(tmp_path)
    assert settings.prompt_cache_disk_bytes == 1000
    assert ServerSettings().prompt_cache_bytes == 1 << 30  # the default the README states


# -- the cache's faults stay the cache's ----------------------------------------------------------


def test_a_snapshot_that_fails_to_load_leaves_no_bytes_behind(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    """Its blocks load, the snapshot's own file fails its checksum: the blocks are let go
    again and the byte count is what the memory holds (nothing), not what was read."""
    model = make_checkpoint(VARIANTS["dense-tied"])
    first = load(model, 0, TINY_BLOCK)
    first.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
    prompt = _prompt(21, 100)
    run(first, prompt, k=2)
    for path in tmp_path.glob("s-*.mtpc"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = load(model, 0, TINY_BLOCK)
    restarted.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
    cache = restarted.prefix_cache
    assert cache.lookup(prompt + [5], need_head=True) is None
    assert cache.counters.disk_rejected >= 1
    assert cache.bytes_held == 0


def test_models_sharing_a_directory_keep_to_their_own_files(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    ours = load(make_checkpoint(VARIANTS["dense-tied"]), 0, TINY_BLOCK)
    ours.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
    run(ours, _prompt(22, 100), k=2)
    ours_files = {p: p.read_bytes() for p in tmp_path.glob("*.mtpc")}
    assert ours_files
    theirs = load(make_checkpoint(VARIANTS["moe-tied"]), 0, TINY_BLOCK)
    # a disk budget the first model's files alone would fill
    small = sum(len(b) for b in ours_files.values())
    theirs.enable_prefix_cache(16 << 20, tmp_path, disk_budget_bytes=small, block_tokens=TINY_BLOCK)
    for seed in range(23, 26):
        run(theirs, _prompt(seed, 100), k=2)
    assert {p: p.read_bytes() for p in ours_files} == ours_files  # untouched
    their_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.mtpc") if p not in ours_files)
    assert 0 < their_bytes <= small


def test_a_full_disk_fails_no_request(
    make_checkpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on every write: the same prompt twice through the server answers both (the
    second from the memory tier), the worker lives on, and the faults are counted."""
    import errno

    from engine.cache import disk_writer

    def full_disk(path: Path, *args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(disk_writer, "_write_file", full_disk)
    model = make_checkpoint(VARIANTS["dense-tied"])

    def loaded() -> Any:
        engine = load(model, 0, TINY_BLOCK)
        engine.enable_prefix_cache(16 << 20, tmp_path, block_tokens=TINY_BLOCK)
        return engine

    settings = ServerSettings(model=str(model), served_model_names=["m"], max_batch=4)
    body = {"model": "m", "prompt": list(range(3, 120)), "max_tokens": 8, "temperature": 0}
    with LiveServer(create_app(loaded, settings)) as srv, httpx.Client(base_url=srv.url) as c:
        answers = [c.post("/v1/completions", json=body) for _ in range(3)]
        assert [r.status_code for r in answers] == [200] * 3, answers[-1].text
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
        assert c.get("/health").json()["status"] == "ok"
        faults = [
            line
            for line in c.get("/metrics").text.splitlines()
            if line.startswith("mtpserve_prompt_cache_errors_total")
        ]
        assert faults and float(faults[0].split()[-1]) >= 1


def test_new_weights_of_the_same_shape_never_restore_old_states(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    """A fine-tune copied over the old weight files (same names, same sizes, and the old
    modification time put back): the disk tier's snapshots of the old weights are not used."""
    import dataclasses
    import os
    import shutil

    original = make_checkpoint(VARIANTS["dense-tied"])
    tuned = make_checkpoint(dataclasses.replace(VARIANTS["dense-tied"], name="tuned", seed=9))
    model = tmp_path / "model"
    shutil.copytree(original, model)
    cache_dir = tmp_path / "cache"
    prompt = _prompt(31, 100)
    first = load(model, 0, TINY_BLOCK)
    first.enable_prefix_cache(16 << 20, cache_dir, block_tokens=TINY_BLOCK)
    run(first, prompt, k=2)
    for path in model.glob("*.safetensors"):
        times = path.stat()
        shutil.copyfile(tuned / path.name, path)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    restarted = load(model, 0, TINY_BLOCK)
    restarted.enable_prefix_cache(16 << 20, cache_dir, block_tokens=TINY_BLOCK)
    warm, stats = run(restarted, prompt, k=2)
    assert stats.cached_tokens == 0
    assert warm == run(restarted, prompt, cached=False, k=2)[0]
    # unchanged weights still resume from the disk tier
    again = load(model, 0, TINY_BLOCK)
    again.enable_prefix_cache(16 << 20, cache_dir, block_tokens=TINY_BLOCK)
    assert run(again, prompt, k=2)[1].cached_tokens > 0
