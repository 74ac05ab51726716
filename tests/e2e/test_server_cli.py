"""``mtpserve serve`` as a user runs it, the docs' examples run as written, and settings.

One real server process (``python -m mtpserve serve``, started as the ``mtpserve`` command starts)
on a tiny checkpoint serves every curl, OpenAI-SDK and Anthropic-SDK snippet of docs/SERVER.md
(all three APIs), with only the port changed — so the documented examples are known to work.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fake_engine import wait_healthy

from engine.allocator import jemalloc_path
from server.serve import add_serve_arguments, settings_from_args
from server.settings import ServerSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "SERVER.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_process(tiny_checkpoint: Path):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mtpserve",
        "serve",
        "--model",
        str(tiny_checkpoint),
        "--port",
        str(port),
        "--served-model-name",
        "qwen3.5-demo",
        "--draft-tokens",
        "2",
        "--log-level",
        "warning",
    ]
    # The environment (MTPSERVE_CACHE from conftest included) is inherited as is.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(
            url,
            lambda: f"server exited: {proc.stdout.read()}" if proc.poll() is not None else None,
            timeout=120,
        )
        yield proc, url, port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def served(served_process: tuple[subprocess.Popen, str, int]) -> tuple[str, int]:
    _, url, port = served_process
    return url, port


def test_the_command_runs_under_jemalloc_where_the_machine_has_it(
    served_process: tuple[subprocess.Popen, str, int],
) -> None:
    """The server re-executed itself with jemalloc preloaded (engine.allocator): same pid, the
    library mapped into it. Without the library (no apt at install) it keeps glibc's malloc."""
    proc, _, _ = served_process
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc: not Linux")
    library = jemalloc_path()
    if library is None:
        pytest.skip("no jemalloc on this machine (make install could not install libjemalloc2)")
    mapped = {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    assert os.path.realpath(library) in {os.path.realpath(p) for p in mapped}


def doc_blocks(lang: str) -> list[str]:
    text = DOCS.read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.mark.fast
def test_docs_curl_examples_work_as_written(served: tuple[str, int]) -> None:
    url, port = served
    blocks = [b for b in doc_blocks("bash") if "curl" in b]
    assert len(blocks) >= 8
    for block in blocks:
        script = block.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, (block, out.stderr)
        assert not re.search(r'"error":\s*\{', out.stdout), (block, out.stdout)  # null is fine
        assert out.stdout.strip(), block
        if '"stream": true' in block and "/v1/messages" in block:
            assert "event: message_stop" in out.stdout
        elif '"stream": true' in block and "/v1/responses" in block:
            assert "event: response.completed" in out.stdout or "response.incomplete" in out.stdout
        elif '"stream": true' in block:
            assert out.stdout.rstrip().endswith("data: [DONE]")


def test_docs_python_examples_work_as_written(served: tuple[str, int]) -> None:
    url, port = served
    blocks = doc_blocks("python")
    assert len(blocks) >= 6
    for block in blocks:
        code = block.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert out.returncode == 0, (block, out.stderr)


def test_serve_process_answers_models_and_metrics(served: tuple[str, int]) -> None:
    url, _ = served
    models = httpx.get(url + "/v1/models").json()
    assert "qwen3.5-demo" in [m["id"] for m in models["data"]]
    assert "mtpserve_requests_total" in httpx.get(url + "/metrics").text


# ------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------
def parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


@pytest.mark.fast
def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text('port = 9100\nmax_queue = 3\npreset = "greedy"\n[sampling]\ntop_k = 5\n')
    monkeypatch.delenv("MTPSERVE_PORT", raising=False)
    s = settings_from_args(parse(["--config", str(cfg), "--model", "m"]))
    assert (s.port, s.max_queue, s.model, s.host) == (9100, 3, "m", "127.0.0.1")
    layer = s.sampling_overrides()
    assert (layer.temperature, layer.top_k) == (0.0, 5)  # preset, then [sampling]
    monkeypatch.setenv("MTPSERVE_PORT", "9200")
    monkeypatch.setenv("MTPSERVE_API_KEY", "from-env")
    s = settings_from_args(parse(["--config", str(cfg)]))
    assert s.port == 9200 and s.api_key.get_secret_value() == "from-env"
    s = settings_from_args(
        parse(["--config", str(cfg), "--port", "9300", "--draft-tokens", "auto"])
    )
    assert s.port == 9300 and s.draft_tokens is None
    assert (
        settings_from_args(parse(["--config", str(cfg), "--draft-tokens", "1"])).draft_tokens == 1
    )


@pytest.mark.fast
def test_config_typos_fail_loudly(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("prot = 80\n")
    with pytest.raises(ValueError, match="prot"):
        load_settings(cfg)
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")


@pytest.mark.fast
def test_repository_config_loads() -> None:
    s = load_settings(ROOT / "configs" / "server.toml")
    assert s.host == "127.0.0.1" and s.api_key is None


@pytest.mark.fast
def test_model_names() -> None:
    s = ServerSettings(model="/x/models/demo", served_model_names=["a"])
    assert s.model_names("demo") == ["demo", "a", "/x/models/demo"]


def test_serve_logs_start_up_at_its_log_level(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mtpserve serve` (whose top-level CLI configures logging at WARNING first) logs the
    loader's and auto K's INFO lines at the default --log-level info."""
    import logging

    import uvicorn

    from mtpserve.cli import main

    root = logging.getLogger()
    saved = root.level, root.handlers[:]
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    monkeypatch.setattr("server.app.create_app", lambda factory, settings: None)
    try:
        root.handlers.clear()  # as in a fresh process: the top-level basicConfig takes effect
        assert main(["serve", "--model", str(tiny_checkpoint), "--port", "1"]) == 0
        assert logging.getLogger("mtpserve.loader").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_a_model_that_is_not_there_is_one_line_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mtpserve serve --model <missing folder>` says so in one line and exits with status 2
    before the server starts, instead of a traceback out of the server's start-up."""
    import uvicorn

    from mtpserve.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: pytest.fail("the server started"))
    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
