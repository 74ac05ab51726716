"""mtpserve and llama.cpp side by side on the same checkpoint, prompts and prompt token ids.

Steps (each skipped when its output exists; everything lives in the git-ignored ``--work``
folder, nothing of llama.cpp is committed):

1. ``fetch``: the llama-cpp-python sdist from PyPI (``pip download --no-binary``), which vendors
   llama.cpp's sources, unpacked.
2. ``build``: cmake builds ``llama-server`` and ``llama-bench`` from the vendored sources: CPU
   (Metal on macOS), static, no OpenSSL, no web UI and no prebuilt UI download, no
   tests/examples — nothing is downloaded during the build.
3. ``convert``: llama.cpp's own ``convert_hf_to_gguf.py`` (it keeps the MTP head) writes f32
   and bf16 GGUFs. It imports torch, so it runs with ``--convert-python`` (an interpreter that
   has torch, numpy, sentencepiece and transformers) or else in its own venv
   (``--work``/convert-venv) with the converter's pinned requirements, whose CPU torch comes
   from download.pytorch.org.
4. ``run``: one llama-server per (dtype, threads, draft count) — 1 thread and every core —
   and the mtpserve engine in this process (fp32). For every prompt of ``--prompts`` all
   settings run once, in turn (interleaved, so the machine's load drifts over all of them
   alike): plain and MTP at each draft count, greedy and sampled. Greedy token ids are
   compared between the tools.

Writes ``--out``/compare_llamacpp.json and .md (a table: tokens/s, acceptance, the speed-up over
each tool's own plain decoding, greedy equality). Not part of ``make test``; run with
``make compare-llamacpp``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SDIST = "llama-cpp-python"
VERSION = "0.3.36"


def sh(cmd: list[str], log: Path | None = None, **kw: Any) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    if log is None:
        subprocess.run(cmd, check=True, **kw)
        return
    with log.open("w") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, **kw)


def fetch(work: Path) -> Path:
    source = work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if source.exists():
        return source
    archive = work / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        sh([*pip, f"{SDIST}=={VERSION}", "-d", str(work)])
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return source


def build(work: Path, source: Path, jobs: int) -> Path:
    server = work / "build" / "bin" / "llama-server"
    if server.exists() and server.with_name("llama-bench").exists():
        return server
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_OPENSSL=OFF",  # no HTTPS, so no OpenSSL
        "-DLLAMA_BUILD_UI=OFF",  # no npm build of the web UI
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # and no download of a prebuilt one
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
    ]
    flags.append("-DGGML_METAL=ON" if platform.system() == "Darwin" else "-DGGML_METAL=OFF")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build_dir = work / "build"
    sh(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *flags], work / "cmake.log")
    sh(
        # llama-bench: scripts/compare_costs.py times llama.cpp's batches with it
        ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", "llama-server"]
        + ["llama-bench"],
        work / "build.log",
    )
    return server


def convert(
    work: Path, source: Path, model: Path, dtypes: list[str], python: Path | None
) -> dict[str, Path]:
    venv = work / "convert-venv"
    if python is None:
        python = venv / "bin" / "python"
    if not python.exists():
        sh([sys.executable, "-m", "venv", str(venv)])
        requirements = source / "requirements" / "requirements-convert_hf_to_gguf.txt"
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        try:
            sh([*pip, "-r", str(requirements)])
        except subprocess.CalledProcessError:
            # the pinned CPU torch lives on download.pytorch.org; take what the index has
            sh([*pip, "torch", "numpy", "sentencepiece", "transformers==4.57.6", "protobuf<5"])
        sh(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "-e",
                str(source / "gguf-py"),
            ]
        )
    out = {}
    for dtype in dtypes:
        path = work / f"{model.name}-{dtype}.gguf"
        if not path.exists():
            script = source / "convert_hf_to_gguf.py"
            args = [str(model), "--outtype", dtype, "--outfile", str(path)]
            cmd = [str(python), "-c", CONVERT_WITH_QWEN35_PRETOKENIZER, str(script), *args]
            # the vendored gguf-py, matching the converter
            env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
            sh(cmd, work / f"convert-{dtype}.log", env=env)
        out[dtype] = path
    return out


#: Runs llama.cpp's converter unchanged, except that a tokenizer whose pre-tokenizer hash it does
#: not list (the demo model's 8k BPE: Qwen's split regex over a smaller vocabulary) is declared
#: Qwen3.5's ("qwen35") instead of aborting. Prompts reach llama-server as token ids, so
#: llama.cpp's own tokenization never decides what either tool is given.
CONVERT_WITH_QWEN35_PRETOKENIZER = """
import runpy, sys
script = sys.argv.pop(1)
sys.path.insert(0, script.rsplit("/", 1)[0])
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "qwen35"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


class LlamaServer:
    """One llama-server process: a GGUF at a thread count and a draft count (0: plain decoding,
    no speculation configured; K: MTP drafting up to K tokens, every time — no minimum and no
    confidence cut, as mtpserve's fixed K)."""

    def __init__(self, binary: Path, gguf: Path, threads: int, draft: int, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1", "--no-warmup"]
        if draft:
            cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(draft)]
            cmd += ["--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"llama-server did not start; see {log}")

    def complete(self, ids: list[int], max_tokens: int, sampler: dict[str, Any]) -> dict[str, Any]:
        body = {
            "prompt": ids,
            "n_predict": max_tokens,
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
            **sampler,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out["timings"]
        return {
            "tokens": out["tokens"],
            "tps": t["predicted_per_second"],
            "proposed": t.get("draft_n", 0),
            "accepted": t.get("draft_n_accepted", 0),
        }

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def llama_sampler(params: Any) -> dict[str, Any]:
    if params.greedy:
        return {"temperature": 0.0, "top_k": 1, "seed": 0}
    return {
        "temperature": params.temperature,
        "top_k": params.top_k or 0,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "seed": params.seed or 0,
        # vLLM/HF order, as mtpserve's truncate
        "samplers": ["penalties", "temperature", "top_k", "top_p", "min_p"],
    }


def run(args: argparse.Namespace, server: Path | None, ggufs: dict[str, Path]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import engine  # noqa: F401  (fast BLAS before mlx)
    from engine.api import GenerationRequest
    from engine.bench.prompts import load_prompts
    from engine.bench.speed import parse_samplers
    from engine.runtime import Engine

    ours = Engine.load(args.model, dtype="float32")
    prompts = load_prompts(Path(args.prompts), ours.tokenizer, args.limit)
    samplers = parse_samplers(args.sampler, ours)
    drafts = [int(k) for k in args.draft_tokens.split(",")]
    threads = sorted({1, os.cpu_count() or 1})
    servers = {
        (dtype, t, k): LlamaServer(server, path, t, k, args.work / f"server-{dtype}-{t}-{k}.log")
        for dtype, path in ggufs.items()
        for t in threads
        for k in drafts
    }
    settings: list[tuple[str, Any, str, Any]] = []  # (tool, config, sampler, draft)
    for name in samplers:
        settings += [("mtpserve", "f32", name, k) for k in [*drafts, "auto"]]
        settings += [("llama.cpp", cfg, name, cfg[2]) for cfg in servers]
    rows: dict[str, dict[str, Any]] = {}
    greedy_ids: dict[tuple[str, str], dict[str, list[int]]] = {}
    try:
        for n, prompt in enumerate(prompts):
            # rotate the order per prompt so no setting always runs first after a pause
            order = settings[n % len(settings) :] + settings[: n % len(settings)]
            for tool, cfg, name, k in order:
                params = samplers[name]
                if tool == "mtpserve":
                    request = GenerationRequest(
                        prompt["ids"],
                        params,
                        args.max_tokens,
                        draft_tokens=None if k == "auto" else k,
                        ignore_eos=True,
                    )
                    tokens: list[int] = []
                    for event in ours.generate(request):
                        tokens += event.token_ids
                    st = event.stats
                    result = {
                        "tokens": tokens,
                        "tps": st.completion_tokens / st.generation_seconds,
                        "proposed": st.proposed,
                        "accepted": st.accepted,
                    }
                    label = "mtpserve f32"
                else:
                    result = servers[cfg].complete(
                        prompt["ids"], args.max_tokens, llama_sampler(params)
                    )
                    label = f"llama.cpp {cfg[0]}, {cfg[1]} thread{'s' if cfg[1] > 1 else ''}"
                key = f"{label} | {name} | {'plain' if k == 0 else f'K={k}'}"
                row = rows.setdefault(key, {"tps": [], "proposed": 0, "accepted": 0})
                row["tps"].append(result["tps"])
                row["proposed"] += result["proposed"]
                row["accepted"] += result["accepted"]
                if params.greedy:
                    greedy_ids.setdefault((label, str(k)), {})[prompt["id"]] = result["tokens"]
            print(f"prompt {n + 1}/{len(prompts)} done", flush=True)
    finally:
        for s in servers.values():
            s.close()
    reference = greedy_ids.get(("mtpserve f32", "0"), {})
    equal = {
        f"{label} {k}": sum(ids == reference.get(pid) for pid, ids in by_prompt.items())
        for (label, k), by_prompt in greedy_ids.items()
    }
    return {
        "rows": {
            key: {
                "tokens_per_s": statistics.mean(r["tps"]),
                "acceptance": r["accepted"] / r["proposed"] if r["proposed"] else None,
            }
            for key, r in rows.items()
        },
        "greedy_equal_to_mtpserve_plain": equal,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "threads": threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| tool / config | sampler | draft | tokens/s | vs own plain | acceptance |",
        "|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    for key, r in rows.items():
        label, sampler, draft = key.split(" | ")
        plain = rows.get(f"{label} | {sampler} | plain", r)["tokens_per_s"]
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(
            f"| {label} | {sampler} | {draft} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / plain:.2f}x | {acc} |"
        )
    lines.append("")
    lines.append(
        f"Greedy outputs equal to mtpserve's plain greedy output (prompts of {result['prompts']}):"
    )
    for name, n in result["greedy_equal_to_mtpserve_plain"].items():
        lines.append(f"- {name}: {n}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    p.add_argument("--prompts", default=str(ROOT / "configs" / "bench_prompts.jsonl"))
    p.add_argument("--limit", type=int, default=5, help="first N prompts")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--draft-tokens", default="0,1,2,3,4")
    p.add_argument("--sampler", default="greedy,preset:qwen")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--work", type=Path, default=ROOT / ".llamacpp")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--convert-python", type=Path, default=None, help="a Python with torch")
    p.add_argument("--steps", default="fetch,build,convert,run")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    steps = set(args.steps.split(","))
    dtypes = [d for d in args.dtypes.split(",") if d]  # none: mtpserve's side only
    source = fetch(args.work) if dtypes else args.work
    server = None
    if dtypes and steps & {"build", "run"}:
        server = build(args.work, source, args.jobs)
    ggufs = {}
    if dtypes and steps & {"convert", "run"}:
        ggufs = convert(args.work, source, Path(args.model), dtypes, args.convert_python)
    if "run" not in steps:
        return 0
    result = run(args, server, ggufs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_llamacpp.json").write_text(json.dumps(result, indent=2))
    (args.out / "compare_llamacpp.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    from engine.allocator import reexec_under_jemalloc

    reexec_under_jemalloc()  # timed as the mtpserve command runs (MTPSERVE_MALLOC=system: glibc)
    raise SystemExit(main())
