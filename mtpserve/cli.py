"""``mtpserve`` command line: generate, serve, bench, convert, extract-head.

``generate`` is the contract tests and benchmarks use (keep it stable): ``--json`` prints one
object with prompt ids, choices and speculative statistics; ``--trace FILE`` writes one JSON line
per speculative cycle.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from typing import Any

from engine.api import DEMO_MODEL, DRAFT_VOCAB_HELP
from engine.blas import use_fast_blas
from sampling.params import SAMPLER_FIELDS, SamplingOverrides
from server.serve import add_serve_arguments, run_serve

use_fast_blas()  # before anything imports mlx


def default_model() -> str:
    return str(DEMO_MODEL)


def parse_draft_tokens(value: str) -> int | None:
    from engine.api import parse_draft_tokens as parse

    try:
        return parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=default_model(), help="HF repo id or local folder")
    p.add_argument("--mtp-weights", default=None, help="MTP head sidecar safetensors file")
    p.add_argument(
        "--draft-tokens",
        type=parse_draft_tokens,
        default=None,
        help="speculative draft length K (0 = plain decoding) or 'auto' (default)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=DRAFT_VOCAB_HELP,
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """``--preset`` and one flag per sampler field of the definition (``--top-k`` for top_k),
    unset by default so the checkpoint's generation_config and the preset show through."""
    p.add_argument("--preset", default=None, help="sampler preset from configs/presets.toml")
    for spec in SAMPLER_FIELDS:
        flag = "--" + spec.name.replace("_", "-")
        p.add_argument(flag, type=spec.type, default=None, help=spec.description)


def sampling_overrides(args: argparse.Namespace) -> SamplingOverrides:
    """The layer the sampler flags set (None where a flag was not given)."""
    return SamplingOverrides(**{spec.name: getattr(args, spec.name) for spec in SAMPLER_FIELDS})


def cmd_generate(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from engine.api import GenerationRequest, GenerationStats
    from engine.distributed import engine_class
    from engine.runtime import chat_prompt_ids
    from sampling.params import SamplingParamError, preset, resolve
    from server.core.detokenizer import IncrementalDetokenizer

    if args.n < 1:
        print("error: --n must be >= 1", file=sys.stderr)
        return 2
    from engine.model.memory import InsufficientMemory, UnsupportedDtype

    try:
        engine = engine_class().load(
            args.model,
            draft_tokens=args.draft_tokens,
            mtp_weights=args.mtp_weights,
            dtype=args.dtype,
            draft_vocab=args.draft_vocab,
        )
    except (InsufficientMemory, UnsupportedDtype) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.chat:
        prompt_ids = chat_prompt_ids(
            engine.tokenizer,
            [{"role": "user", "content": args.prompt}],
            enable_thinking=not args.no_thinking,
        )
    else:
        prompt_ids = engine.tokenizer.encode(args.prompt, add_special_tokens=False)
    prompt_ids = list(prompt_ids)
    try:
        layers = [engine.sampling_defaults]
        if args.preset:
            layers.append(preset(args.preset))
        base = resolve(*layers, sampling_overrides(args))
    except SamplingParamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    trace_file = open(args.trace, "w") if args.trace else None  # noqa: SIM115
    choices: list[dict[str, Any]] = []
    total = GenerationStats()
    mx.reset_peak_memory()
    try:
        for i in range(args.n):
            # Choice i draws from seed + i: reproducible, yet independent of the other choices.
            params = base if base.seed is None else replace(base, seed=base.seed + i)
            request = GenerationRequest(
                prompt_ids=prompt_ids,
                sampling=params,
                max_tokens=args.max_tokens,
                stop_token_ids=engine.eos_token_ids,
                ignore_eos=args.ignore_eos,
                draft_tokens=args.draft_tokens,
                top_logprobs=args.logprobs,
            )

            def trace(line: dict[str, Any], choice: int = i) -> None:
                if trace_file:
                    trace_file.write(json.dumps({"choice": choice, **line}) + "\n")

            token_ids: list[int] = []
            logprobs: list[dict[str, Any]] = []
            event = None
            # UTF-8 safe streaming text without the EOS token (the server's detokenizer).
            detokenizer = IncrementalDetokenizer(engine.tokenizer, skip_ids=engine.eos_token_ids)
            for event in engine.generate(request, trace=trace):
                token_ids += event.token_ids
                for lp in event.logprobs or []:
                    top = [[t, v] for t, v in lp.top]
                    logprobs.append({"token_id": lp.token_id, "logprob": lp.logprob, "top": top})
                if not args.json:
                    sys.stdout.write(detokenizer.add(event.token_ids))
                    sys.stdout.flush()
            if not args.json:
                sys.stdout.write(detokenizer.flush())
            assert event is not None and event.stats is not None
            total.add(event.stats)
            choice = {
                "token_ids": token_ids,
                "text": _visible_text(engine, token_ids),
                "finish_reason": event.finish_reason,
            }
            if args.logprobs is not None:
                choice["logprobs"] = logprobs
            choices.append(choice)
    except ValueError as exc:  # RequestError, SamplingParamError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if trace_file:
            trace_file.close()
    stats = _stats_json(total, peak=mx.get_peak_memory())
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "choices": choices, "stats": stats}))
    else:
        print(file=sys.stderr)
        print(
            f"[{stats['generation_tps']:.1f} tok/s, K={stats['draft_tokens']}, acceptance "
            f"{stats['acceptance_rate']:.2f}, {stats['cycles']} cycles, peak "
            f"{stats['peak_memory_bytes'] / 2**20:.0f} MiB]",
            file=sys.stderr,
        )
    return 0


def _visible_text(engine: Any, token_ids: list[int]) -> str:
    """Decoded text without a trailing EOS token."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] in engine.eos_token_ids else token_ids
    return engine.tokenizer.decode(ids)


def _stats_json(s: Any, peak: int) -> dict[str, Any]:
    k = s.draft_tokens
    return {
        "draft_tokens": k,
        "proposed": s.proposed,
        "accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "accepted_per_position": s.accepted_per_position[:k],
        "proposed_per_position": s.proposed_per_position[:k],
        "k_histogram": s.k_histogram,
        "cycles": s.cycles,
        "prompt_tps": s.prompt_tps,
        "generation_tps": s.generation_tps,
        "tokens_per_cycle": s.tokens_per_cycle,
        "peak_memory_bytes": int(peak),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a prompt")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking off")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--n", type=int, default=1, help="independent completions")
    gen.add_argument("--trace", default=None, help="write one JSON line per speculative cycle")
    gen.add_argument("--json", action="store_true")
    gen.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability under the model and the N most likely",
    )
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)

    # Importing `engine` preloaded the fast BLAS above, before these modules import mlx.
    from engine.bench import batch, chat, speed
    from engine.model import convert

    speed.register(sub)
    batch.register(sub)
    chat.register(sub)
    convert.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    followed = follow_if_follower(args)
    if followed is not None:
        return followed
    from engine.api import ModelNotFound

    try:
        status = int(args.func(args) or 0)
    except ModelNotFound as exc:  # the user's --model: one line, not a traceback
        print(f"mtpserve {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command in DISTRIBUTED_COMMANDS:
        from engine import distributed

        if distributed.lost_message() is not None:
            return 1
    return status


#: commands that run under ``mlx.launch``: rank 0 runs them, the other ranks follow it
DISTRIBUTED_COMMANDS = ("generate", "serve", "bench")


def follow_if_follower(args: argparse.Namespace) -> int | None:
    """On a rank other than 0 of an ``mlx.launch`` group: load this rank's shard and follow
    rank 0 until it stops (the exit status); None on rank 0 or without a group."""
    if args.command not in DISTRIBUTED_COMMANDS:
        return None
    from engine import distributed

    if distributed.world() is None or distributed.rank() == 0:
        return None
    if args.command == "serve":
        from server.serve import settings_from_args

        # rank 0 reads its dtype from the settings (flag, environment, TOML, then "auto"): the
        # follower must load the very same, or the first collective meets mismatched sizes
        settings = settings_from_args(args)
        model, dtype = settings.model or default_model(), settings.dtype
    else:
        model, dtype = args.model, getattr(args, "dtype", None) or "auto"
    return distributed.run_follower(model, dtype)


if __name__ == "__main__":
    sys.exit(main())
