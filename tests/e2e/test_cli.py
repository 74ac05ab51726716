"""The `mtpserve generate` contract that tests and benchmarks rely on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtpserve", "generate", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.fast
def test_json_and_trace_contract(tiny_checkpoint: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    out = generate(
        "--model",
        str(tiny_checkpoint),
        "--prompt",
        "def add(a, b):",
        "--max-tokens",
        "30",
        "--temperature",
        "0",
        "--draft-tokens",
        "3",
        "--ignore-eos",
        "--json",
        "--trace",
        str(trace),
        "--n",
        "2",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"prompt_token_ids", "choices", "stats"}
    assert len(result["choices"]) == 2
    for choice in result["choices"]:
        assert set(choice) >= {"token_ids", "text", "finish_reason"}
        assert len(choice["token_ids"]) == 30 and choice["finish_reason"] == "length"
    stats = result["stats"]
    for key in (
        "draft_tokens",
        "proposed",
        "accepted",
        "acceptance_rate",
        "accepted_per_position",
        "cycles",
        "prompt_tps",
        "generation_tps",
        "peak_memory_bytes",
    ):
        assert key in stats
    assert stats["draft_tokens"] == 3 and len(stats["accepted_per_position"]) == 3
    assert stats["peak_memory_bytes"] > 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {line["choice"] for line in lines} == {0, 1}
    assert sum(1 for line in lines if line["choice"] == 0) == stats["cycles"] // 2
    prompt, generated = result["prompt_token_ids"], result["choices"][0]["token_ids"]
    for line in (ln for ln in lines if ln["choice"] == 0):
        c = line["context_len"]
        assert (prompt + generated)[c : c + len(line["emitted"])] == line["emitted"]
        assert set(line) == {"choice", "context_len", "draft", "accepted", "emitted"}


def test_bad_sampler_value_is_a_clear_error(tiny_checkpoint: Path) -> None:
    out = generate("--model", str(tiny_checkpoint), "--prompt", "x", "--top-p", "1.5")
    assert out.returncode == 2 and "top_p" in out.stderr and "Traceback" not in out.stderr


def test_chat_prompt_uses_the_template(tiny_checkpoint: Path) -> None:
    out = generate(
        "--model",
        str(tiny_checkpoint),
        "--prompt",
        "hello",
        "--chat",
        "--no-thinking",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    prompt = tokenizer.decode(json.loads(out.stdout)["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.endswith("<think>\n\n</think>\n\n")


@pytest.mark.fast
def test_draft_tokens_outside_the_range_is_an_error_at_start(capsys) -> None:
    """`--draft-tokens 12` fails when the command starts (naming the range), for every command
    that takes it, instead of starting and then failing every request."""
    import pytest

    from engine.api import MAX_DRAFT_TOKENS
    from mtpserve.cli import build_parser, main

    wanted = f"0..{MAX_DRAFT_TOKENS}"
    for argv in (
        ["generate", "--prompt", "x", "--draft-tokens", "12"],
        ["bench", "--draft-tokens", "0,2,12"],
        ["generate", "--prompt", "x", "--draft-tokens", "two"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
        assert wanted in capsys.readouterr().err
    # serve: flags, environment and config file all go through the same check.
    assert main(["serve", "--draft-tokens", "12"]) == 2
    assert wanted in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--prompt", "x", "--draft-tokens", "auto"])


@pytest.mark.fast
def test_a_model_that_is_not_there_is_one_line(tmp_path: Path, capsys) -> None:
    """`mtpserve generate` and `bench` with a --model that is not there: one line naming it and
    exit status 2, not a traceback (`serve`: tests/e2e/test_server_cli.py)."""
    from mtpserve.cli import main

    missing = str(tmp_path / "missing")
    for argv in (["generate", "--prompt", "x"], ["bench", "--max-tokens", "4"]):
        assert main([*argv, "--model", missing]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and missing in err and "Traceback" not in err


@pytest.mark.fast
def test_jemalloc_is_preloaded_once_and_can_be_declined(monkeypatch) -> None:
    """engine.allocator: the re-executed environment puts jemalloc first in LD_PRELOAD and keeps
    what was there, with huge pages in MALLOC_CONF ahead of the user's own options (so theirs
    win), and the re-executed process puts both back for its children; a process that already
    preloads it is not re-executed again (no loop); MTPSERVE_MALLOC=system keeps the system's
    malloc."""
    from engine.allocator import jemalloc_path, preload_environment, restore_environment

    started = {"LD_PRELOAD": "/lib/other.so", "MALLOC_CONF": "narenas:2", "HOME": "/h"}
    env = preload_environment("/lib/je.so", dict(started))
    assert env is not None and env["LD_PRELOAD"] == "/lib/je.so /lib/other.so"
    assert env["MALLOC_CONF"] == "thp:always,narenas:2"
    assert env["HOME"] == "/h"
    restore_environment(env)  # what the re-executed process does: children start as before
    assert env == started
    assert preload_environment("/lib/je.so", {"LD_PRELOAD": "/lib/other.so:/lib/je.so"}) is None
    env = preload_environment("/lib/je.so", {})
    assert env is not None and env["LD_PRELOAD"] == "/lib/je.so"
    assert env["MALLOC_CONF"] == "thp:always"
    restore_environment(env)
    assert env == {}
    monkeypatch.setenv("MTPSERVE_MALLOC", "system")
    assert jemalloc_path() is None


def test_the_command_keeps_its_arguments_and_exit_status_across_the_reexec() -> None:
    """``python -m mtpserve`` re-executes itself under jemalloc where the machine has it; the
    arguments reach the command line unchanged and its exit status is the process's."""
    bad = subprocess.run(
        [sys.executable, "-m", "mtpserve", "generate", "--draft-tokens", "x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "--draft-tokens" in bad.stderr


def test_the_reexecuted_process_runs_under_jemalloc_and_its_children_do_not() -> None:
    """The process that re-executed itself has jemalloc mapped, advising its mappings for huge
    pages (jemalloc's own ``opt.thp``); its environment, which programs it starts inherit, is
    the one it was started with."""
    import os

    import pytest

    from engine.allocator import jemalloc_path

    if jemalloc_path() is None:
        pytest.skip("no jemalloc on this machine (make install could not install libjemalloc2)")
    code = (
        "from engine.allocator import malloc_in_use, reexec_under_jemalloc\n"
        "reexec_under_jemalloc()\n"
        "import ctypes, os, subprocess, sys\n"
        "from engine.allocator import jemalloc_mallctl\n"
        'child = \'import os; print(repr(os.environ.get("LD_PRELOAD")), '
        'repr(os.environ.get("MALLOC_CONF")))\'\n'
        "thp, size = ctypes.c_char_p(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_char_p))\n"
        "jemalloc_mallctl()(b'opt.thp', ctypes.byref(thp), ctypes.byref(size), None, 0)\n"
        "print(malloc_in_use(), thp.value.decode())\n"
        "sys.stdout.flush()\n"
        "subprocess.run([sys.executable, '-c', child])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    mapped, child = out.stdout.split("\n")[:2]
    assert "libjemalloc" in mapped and mapped.endswith(" always")
    assert child == "None None"
