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
   and the mtpserve engine in this process in each of those weight types. For every prompt
   of ``--prompts`` all settings run once, in turn (interleaved, so the machine's load drifts
   over all of them alike): plain and MTP at each draft count, greedy and sampled. Greedy
   token ids are compared between the tools.

Writes ``--out``/compare_llamacpp.json and .md (a table: tokens/s, acceptance, the speed-up over
each tool's own plain decoding, greedy equality). Not part of ``make test``; run with
``make compare-llamacpp``.

With ``--shape-model CHECKPOINT`` (``make compare-llamacpp SHAPE=runs/shapes/qwen3.5-0.8B``)
it compares plain decoding at a full-size shape instead of the steps above. The 0.8B
checkpoint has random weights and Qwen3.5-0.8B's exact shapes, MTP head included (acceptance
means nothing there, costs do); it is made by ``python scripts/make_shapes.py 0.8B`` (into the
git-ignored runs/shapes/qwen3.5-0.8B). Fetch and build as above, then per weight format:

- F32 and BF16 GGUFs by the converter (its f32 file also feeds the quantizer), Q8_0 and Q4_0 by
  ``llama-quantize`` (its default recipe: Q4_0 keeps the tied output matrix at Q6_K); against
  them mtpserve loads the checkpoint in float32 and in bfloat16, and its 8-bit and 4-bit
  (group 64) folders written by ``mtpserve convert`` (mlx-lm's affine quantization, the
  embedding too; ``--work``/<name>-mlx-<bits>bit).
- llama.cpp's decode tokens/s from ``llama-bench -p 0 -n 64 -t T -o json``, mtpserve's from its
  plain steps (K=0, greedy, EOS ignored, 64 tokens after a short prompt) with the product
  kernel on T threads; for every T of ``--plain-threads`` (2,1), ``--rounds`` (5) rounds, each
  format's two tools one after the other (which goes first alternates), so drift hits both.
- Prompt processing, beside each decode run: llama.cpp's ``llama-bench -p P -n 0`` against
  mtpserve's prefill of a P-token prompt through the trunk (``Engine.new_sequence`` without
  the head: llama.cpp's graph leaves its MTP layers out of a prompt too; chunks of 128, the
  kernel's products), P = ``--prompt-tokens`` (512; 0 skips it). llama.cpp's AMX path for
  repacked Q8_0/Q4_0 weights crashed in prompt processing on an AMX CPU (a segfault in
  ``ggml_backend_amx_mul_mat``); where its run fails it runs again with ``--repack 0`` and the
  table says so.
- The bytes of weights a token reads on each side: every weight but the MTP head's (and, where
  the embedding is not the output matrix, the embedding's), as stored.

Writes ``--out``/compare_llamacpp_shape.json and .md (tokens/s with the runs' range, the
ratio, MB read per token and what that is in GB/s), with the commit and the machine.
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


#: what ``build`` makes: the server (``run``), the benchmark (``plain``, compare_costs.py) and
#: the quantizer (``plain``'s Q8_0/Q4_0)
TOOLS = ("llama-server", "llama-bench", "llama-quantize")


def build(work: Path, source: Path, jobs: int) -> Path:
    server = work / "build" / "bin" / "llama-server"
    if all(server.with_name(tool).exists() for tool in TOOLS):
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
        ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS],
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
        requirements = work / "convert-requirements.txt"
        requirements.write_text("\n".join(pinned_requirements(source)) + "\n")
        sh([str(python), "-m", "pip", "install", "--quiet", "-r", str(requirements)])
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


def pinned_requirements(source: Path) -> list[str]:
    """The converter's pinned requirements (its ``-r`` includes followed), without the extra
    index they name: its CPU torch lives on download.pytorch.org, which need not be reachable,
    so the same torch version comes from the package index (there its Linux build brings CUDA's
    libraries along, a few GB, unused here)."""

    def read(path: Path) -> list[str]:
        lines = []
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if line.startswith("-r"):
                lines += read(path.parent / line[2:].strip())
            elif line and not line.startswith("-"):
                lines.append(line)
        return lines

    return read(source / "requirements" / "requirements-convert_hf_to_gguf.txt")


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
    from engine.bench.speed import parse_samplers, request_params
    from engine.runtime import Engine

    # mtpserve in each weight type llama.cpp runs (the native kernel reads bf16 as stored)
    engines = {
        dtype: Engine.load(args.model, dtype={"f32": "float32", "bf16": "bfloat16"}[dtype])
        for dtype in (args.dtypes.split(",") if args.dtypes else ["f32"])
        if dtype in ("f32", "bf16")
    } or {"f32": Engine.load(args.model, dtype="float32")}
    first = next(iter(engines.values()))
    prompts = load_prompts(Path(args.prompts), first.tokenizer, args.limit)
    samplers = parse_samplers(args.sampler, first)
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
        settings += [("mtpserve", dtype, name, k) for dtype in engines for k in [*drafts, "auto"]]
        settings += [("llama.cpp", cfg, name, cfg[2]) for cfg in servers]
    rows: dict[str, dict[str, Any]] = {}
    greedy_ids: dict[tuple[str, str], dict[str, list[int]]] = {}
    try:
        for n, prompt in enumerate(prompts):
            # rotate the order per prompt so no setting always runs first after a pause
            order = settings[n % len(settings) :] + settings[: n % len(settings)]
            for tool, cfg, name, k in order:
                # seeded per prompt, as `make bench` seeds its sampled rows: each tool's text
                # repeats from run to run, and mtpserve's automatic K follows its seeded plan
                params = request_params(name, samplers[name], 1000 + n)
                if tool == "mtpserve":
                    request = GenerationRequest(
                        prompt["ids"],
                        params,
                        args.max_tokens,
                        draft_tokens=None if k == "auto" else k,
                        ignore_eos=True,
                    )
                    tokens: list[int] = []
                    for event in engines[cfg].generate(request):
                        tokens += event.token_ids
                    st = event.stats
                    result = {
                        "tokens": tokens,
                        "tps": st.completion_tokens / st.generation_seconds,
                        "proposed": st.proposed,
                        "accepted": st.accepted,
                    }
                    label = f"mtpserve {cfg}"
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


# -- plain decoding at a full-size shape (step ``plain``) ---------------------------------------

#: ``plain``: per weight format, llama.cpp's GGUF type and mtpserve's weights: the dtype the
#: checkpoint is loaded in, or the bits of ``mtpserve convert``'s mlx affine quantization
PLAIN_FORMATS: dict[str, tuple[str, str, int | None]] = {
    "f32": ("F32", "float32", None),
    "bf16": ("BF16", "bfloat16", None),
    "q8": ("Q8_0", "auto", 8),
    "q4": ("Q4_0", "auto", 4),
}
GROUP_SIZE = 64
#: mtpserve's prompt before the timed tokens (llama-bench's ``-p 0`` decodes from an empty
#: context; mtpserve needs a prompt): any ids, greedy, EOS ignored
PLAIN_PROMPT = [17, 220, 1008, 42, 5, 900, 31, 64]


def quantize_gguf(work: Path, f32: Path, kind: str, jobs: int) -> Path:
    """llama-quantize's ``kind`` of the f32 GGUF, its default recipe for that type (Q4_0 keeps
    the output matrix, here the tied embedding, at Q6_K as every Q4_0 GGUF has it)."""
    path = f32.with_name(f32.name.replace("-f32.gguf", f"-{kind.lower()}.gguf"))
    if not path.exists():
        tool = work / "build" / "bin" / "llama-quantize"
        sh([str(tool), str(f32), str(path), kind, str(jobs)], work / f"quantize-{kind}.log")
    return path


def mlx_quantized(work: Path, model: Path, bits: int) -> Path:
    """``mtpserve convert`` of the checkpoint: mlx-lm's affine quantization of every linear and
    the embedding at ``bits``, group 64 (the MTP head too; plain decoding does not read it)."""
    out = work / f"{model.name}-mlx-{bits}bit"
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "mtpserve", "convert", "--model", str(model)]
        cmd += ["--out", str(out), "--bits", str(bits), "--head-bits", str(bits)]
        cmd += ["--group-size", str(GROUP_SIZE)]
        sh(cmd, work / f"mlx-convert-{bits}bit.log", cwd=ROOT)
    return out


def gguf_read_bytes(source: Path, path: Path) -> int:
    """Bytes of the weights a decoded token reads in llama.cpp: every tensor but the MTP
    layers' (the last ``nextn_predict_layers`` blocks) and, beside a separate output matrix,
    the embedding (one row a token)."""
    sys.path.insert(0, str(source / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.get_field(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    first_mtp = field(f"{arch}.block_count") - field(f"{arch}.nextn_predict_layers", 0)
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= first_mtp:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(t.n_bytes)
    return total


def mtpserve_read_bytes(engine: Any) -> int:
    """Bytes of the weights a plain step reads in mtpserve: the trunk's parameters (quantized:
    codes, scales and biases) without the MTP head's and, beside a separate ``lm_head``, the
    embedding's (one row a token)."""
    from mlx.utils import tree_flatten

    trunk = engine.trunk
    tied = trunk.args.tie_word_embeddings
    return sum(
        a.nbytes
        for name, a in tree_flatten(trunk.parameters())
        if not name.startswith("mtp.") and (tied or not name.startswith("model.embed_tokens."))
    )


def llama_bench(
    binary: Path, gguf: Path, threads: int, reps: int, decode: int = 0, prompt: int = 0
) -> tuple[list[float], str, bool]:
    """Tokens/s of each of ``reps`` runs of ``llama-bench -p prompt -n decode`` (one of them
    0), the llama.cpp commit it was built from, and whether it ran with ``--repack 0`` (after
    the default run failed: the AMX path for repacked weights crashed in prompt processing)."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(decode)]
    cmd += ["-t", str(threads), "-r", str(reps), "-o", "json"]
    for extra in ([], ["--repack", "0"]):
        done = subprocess.run(cmd + extra, capture_output=True, text=True)
        if done.returncode == 0:
            (test,) = json.loads(done.stdout)
            samples = [float(ts) for ts in test["samples_ts"]]
            return samples, str(test.get("build_commit", "?")), bool(extra)
    raise RuntimeError(f"llama-bench failed (rc {done.returncode}): {done.stderr[-400:]}")


def mtpserve_prefill_tps(engine: Any, tokens: int) -> float:
    """Prompt tokens/s of mtpserve's prefill of ``tokens`` positions through the trunk, outside
    the conversation cache (the prompt's last id, one more, is the first decode step's)."""
    from sampling.params import SamplingParams

    vocab = engine.trunk.args.vocab_size
    ids = [(PLAIN_PROMPT[i % len(PLAIN_PROMPT)] + 7 * i) % vocab for i in range(tokens + 1)]
    start = time.perf_counter()
    engine.new_sequence(ids, SamplingParams(temperature=0.0), draft=False)
    return tokens / (time.perf_counter() - start)


def mtpserve_plain_tps(engine: Any, tokens: int) -> float:
    """Decode tokens/s of mtpserve's plain steps (K=0, greedy): ``tokens`` tokens after the
    first one (the prompt's), timed from that first token to the last."""
    from engine.api import GenerationRequest
    from sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    request = GenerationRequest(PLAIN_PROMPT, greedy, tokens + 1, draft_tokens=0, ignore_eos=True)
    first, n = None, 0
    for event in engine.generate(request):
        now = time.perf_counter()
        if first is None:
            first = now
            continue
        n += len(event.token_ids)
    assert first is not None and n == tokens, (n, tokens)
    return n / (now - first)


def plain(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    """Plain decoding at the shape of ``--shape-model``, each weight format against its
    counterpart, both tools on the same threads, measured in turn (llama.cpp, mtpserve,
    llama.cpp, ...; which goes first alternates by round) so the machine's drift hits both."""
    sys.path.insert(0, str(ROOT))
    import engine  # noqa: F401  (fast BLAS before mlx)
    from engine.bench.machine import cpu_name
    from engine.model import products
    from engine.runtime import Engine

    commit = subprocess.run(  # the code measured, should HEAD move during the run
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    model = Path(args.shape_model)
    formats = [f for f in args.plain_formats.split(",") if f]
    threads = [int(t) for t in args.plain_threads.split(",")]
    need = {"bf16"} & set(formats) | ({"f32"} if set(formats) - {"bf16"} else set())
    ggufs = convert(args.work, source, model, sorted(need), args.convert_python)
    bench = args.work / "build" / "bin" / "llama-bench"
    sides: dict[str, dict[str, Any]] = {}
    for name in formats:
        kind, dtype, bits = PLAIN_FORMATS[name]
        if bits is None:
            gguf = ggufs[name]
        else:
            gguf = quantize_gguf(args.work, ggufs["f32"], kind, args.jobs)
        folder = model if bits is None else mlx_quantized(args.work, model, bits)
        ours = Engine.load(str(folder), draft_tokens=0, dtype=dtype)
        mtpserve_plain_tps(ours, 4)  # warm-up: the first steps compile
        if args.prompt_tokens:
            mtpserve_prefill_tps(ours, min(args.prompt_tokens, 64))
        sides[name] = {
            "gguf": gguf,
            "engine": ours,
            "llama.cpp": {"weights": kind, "read_bytes": gguf_read_bytes(source, gguf)},
            "mtpserve": {
                "weights": dtype if bits is None else f"mlx {bits}-bit, group {GROUP_SIZE}",
                "read_bytes": mtpserve_read_bytes(ours),
            },
        }
    native = products.native()
    # "products: native kernel, <isa>" without the pool's size, which each row sets
    kernel = products.description().rsplit(",", 1)[0] if native else products.description()
    samples: dict[tuple[str, int, str], list[float]] = {}
    prompt_samples: dict[tuple[str, int, str], list[float]] = {}
    unpacked: set[str] = set()  # formats whose llama.cpp prompt runs took --repack 0
    llama_commit = "?"
    for r in range(args.rounds):
        for t in threads:
            if native is not None:
                native.set_threads(t)
            for name in formats:
                side = sides[name]
                tools = ["llama.cpp", "mtpserve"][:: -1 if r % 2 else 1]
                for tool in tools:
                    # decoding, then the prompt (when asked for), each tool's runs in a row
                    for what, store, tokens in (
                        ("", samples, args.plain_tokens),
                        (" prompt", prompt_samples, args.prompt_tokens),
                    ):
                        if not tokens:
                            continue
                        if tool == "mtpserve":
                            measure = mtpserve_prefill_tps if what else mtpserve_plain_tps
                            tps = [measure(side["engine"], tokens) for _ in range(args.reps)]
                        else:
                            run = {"prompt": tokens} if what else {"decode": tokens}
                            tps, llama_commit, repack_off = llama_bench(
                                bench, side["gguf"], t, args.reps, **run
                            )
                            if repack_off and what:
                                unpacked.add(name)
                        store.setdefault((name, t, tool), []).extend(tps)
                        print(f"round {r + 1} {name} {t}t {tool}{what}: {tps}", flush=True)
    rows = []
    for name in formats:
        for t in threads:
            row: dict[str, Any] = {"format": name, "threads": t}
            for tool in ("llama.cpp", "mtpserve"):
                row[tool] = {**sides[name][tool], "samples": samples[(name, t, tool)]}
            if args.prompt_tokens:
                prompt = {
                    tool: prompt_samples[(name, t, tool)] for tool in ("llama.cpp", "mtpserve")
                }
                row["prompt"] = {
                    **prompt,
                    "ratio": statistics.mean(prompt["mtpserve"])
                    / statistics.mean(prompt["llama.cpp"]),
                    "ratio_best": max(prompt["mtpserve"]) / max(prompt["llama.cpp"]),
                    "llama_cpp_repack_off": name in unpacked,
                }
            rows.append(summarize(row))
    return {
        "model": str(model),
        "rows": rows,
        "tokens": args.plain_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "reps": args.reps,
        "products": kernel,
        "llama_cpp": f"llama.cpp {llama_commit} (llama-cpp-python {VERSION}'s vendored sources)",
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()}",
        "commit": commit,
    }


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    """A row's figures from its runs: mean and best tokens/s of each tool, their ratios, and
    the read bandwidth of the best run. On a machine shared with other jobs a run that lost a
    core to them is slow (llama.cpp's threads wait for each other at every operation, so its
    2-thread runs fall furthest), so the best run is the closer to what the tool does alone."""
    for tool in ("llama.cpp", "mtpserve"):
        side = row[tool]
        side["tokens_per_s"] = statistics.mean(side["samples"])
        side["best_tokens_per_s"] = max(side["samples"])
        side["read_gb_per_s"] = side["read_bytes"] * side["best_tokens_per_s"] / 1e9
    for key, field in (("ratio", "tokens_per_s"), ("ratio_best", "best_tokens_per_s")):
        row[key] = row["mtpserve"][field] / row["llama.cpp"][field]
    return row


def plain_table(result: dict[str, Any]) -> str:
    n = len(result["rows"][0]["llama.cpp"]["samples"]) if result["rows"] else 0
    lines = [
        f"Plain greedy decoding at the shape of `{Path(result['model']).name}`: llama.cpp's "
        f"`llama-bench -p 0 -n {result['tokens']}` against mtpserve's plain steps (K=0, "
        f"{result['tokens']} tokens after an {len(PLAIN_PROMPT)}-token prompt), the mean of "
        f"{n} runs each, interleaved over {result['rounds']} rounds. Commit `{result['commit']}`; "
        f"{result['machine']}; {result['llama_cpp']}; mtpserve's {result['products']} "
        "on the row's threads. Tokens/s: mean (lowest-highest run); mtpserve / llama.cpp: of "
        "the means and of the best runs. MB/token: the weights one token reads as stored (not "
        "the MTP head's); GB/s: that times the best run's tokens/s.",
        "",
        "| llama.cpp / mtpserve weights | threads | llama.cpp tok/s | mtpserve tok/s | "
        "mtpserve / llama.cpp, mean | best | llama.cpp MB/token | mtpserve MB/token | "
        "llama.cpp GB/s | mtpserve GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(s: list[float]) -> str:
        return f"{statistics.mean(s):.1f} ({min(s):.1f}-{max(s):.1f})"

    for row in result["rows"]:
        ll, ms = row["llama.cpp"], row["mtpserve"]
        lines.append(
            f"| {ll['weights']} / {ms['weights']} | {row['threads']} | {spread(ll['samples'])} | "
            f"{spread(ms['samples'])} | {row['ratio']:.2f}x | {row['ratio_best']:.2f}x | "
            f"{ll['read_bytes'] / 1e6:.0f} | "
            f"{ms['read_bytes'] / 1e6:.0f} | {ll['read_gb_per_s']:.1f} | "
            f"{ms['read_gb_per_s']:.1f} |"
        )
    if not result.get("prompt_tokens"):
        return "\n".join(lines) + "\n"
    p = result["prompt_tokens"]
    lines += [
        "",
        f"Prompt processing, {p} tokens: llama.cpp's `llama-bench -p {p} -n 0` against "
        f"mtpserve's prefill of a {p}-token prompt through the trunk (the MTP head's layer left "
        "out on both sides), each run beside the decode run above. Tokens/s as above; "
        "`--repack 0`: llama.cpp's default (AMX-repacked weights) failed there.",
        "",
        "| llama.cpp / mtpserve weights | threads | llama.cpp prompt tok/s | mtpserve prompt "
        "tok/s | mtpserve / llama.cpp, mean | best |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        pr = row["prompt"]
        weights = f"{row['llama.cpp']['weights']} / {row['mtpserve']['weights']}"
        if pr["llama_cpp_repack_off"]:
            weights += " (llama.cpp `--repack 0`)"
        lines.append(
            f"| {weights} | {row['threads']} | {spread(pr['llama.cpp'])} | "
            f"{spread(pr['mtpserve'])} | {pr['ratio']:.2f}x | {pr['ratio_best']:.2f}x |"
        )
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
    p.add_argument(
        "--shape-model",
        default=None,
        help="instead: plain decoding at this checkpoint's shape (scripts/make_shapes.py)",
    )
    p.add_argument(
        "--plain-formats", default="f32,bf16,q8,q4", help="of " + ",".join(PLAIN_FORMATS)
    )
    p.add_argument("--plain-threads", default="2,1")
    p.add_argument("--plain-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512, help="plain: prefill (0: none)")
    p.add_argument("--rounds", type=int, default=5, help="plain: rounds over every setting")
    p.add_argument("--reps", type=int, default=1, help="plain: runs of each setting per round")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.shape_model:
        source = fetch(args.work)
        build(args.work, source, args.jobs)
        result = plain(args, source)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare_llamacpp_shape.json").write_text(json.dumps(result, indent=2))
        (args.out / "compare_llamacpp_shape.md").write_text(plain_table(result))
        print(plain_table(result))
        return 0
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
