"""``mtpserve serve``: flags, settings resolution, and uvicorn.

``add_serve_arguments(parser)`` and ``run_serve(args)`` are what ``mtpserve/cli.py`` wires in;
``python -m server.serve --model M`` runs the same thing standalone. Flags left unset fall through
to ``MTPSERVE_*`` environment variables, then the TOML config file (see ``server.settings``).
The engine module is imported lazily inside the factory, so ``--help`` and config errors never
pay for importing mlx.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from engine.api import DRAFT_VOCAB_HELP, parse_draft_tokens
from server.settings import ServerSettings, load_settings

#: shared by `serve`, `generate` and `bench`


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder or Hugging Face repo id")
    parser.add_argument("--host", help="bind address (default 127.0.0.1: loopback only)")
    parser.add_argument("--port", type=int, help="port (default 8080)")
    parser.add_argument(
        "--draft-tokens",
        dest="draft_tokens",
        metavar="K",
        help="MTP draft tokens per cycle: an integer (0 = plain decoding) or 'auto'",
    )
    parser.add_argument("--mtp-weights", dest="mtp_weights", help="MTP head sidecar file")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype (default auto: as stored on GPUs, float32 on CPUs where it fits)",
    )
    parser.add_argument(
        "--draft-vocab",
        dest="draft_vocab",
        type=int,
        help=DRAFT_VOCAB_HELP,
    )
    parser.add_argument("--api-key", dest="api_key", help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--allowed-hosts",
        dest="allowed_hosts",
        nargs="+",
        metavar="HOST",
        help="Host names served besides loopback and the bound address (a reverse proxy's "
        "name); '*': any",
    )
    parser.add_argument(
        "--allowed-origins",
        dest="allowed_origins",
        nargs="+",
        metavar="ORIGIN",
        help="web origins whose pages may call the API besides the chat page; '*': any",
    )
    parser.add_argument("--preset", help="sampler preset from configs/presets.toml")
    parser.add_argument(
        "--max-queue",
        dest="max_queue",
        type=int,
        help="requests allowed to wait for the engine before 429",
    )
    parser.add_argument(
        "--max-batch",
        dest="max_batch",
        type=int,
        help="requests decoding together, speculation on for each (default 8; 1: one at a time)",
    )
    parser.add_argument(
        "--default-max-tokens",
        dest="default_max_tokens",
        type=int,
        help="max_tokens of a request that sends none (default 4096)",
    )
    parser.add_argument(
        "--served-model-name",
        dest="served_model_names",
        action="append",
        help="extra model name clients may use (repeatable)",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        dest="chat_template_kwargs",
        metavar="JSON",
        help="default chat-template arguments, e.g. '{\"enable_thinking\": false}' "
        "(a request's chat_template_kwargs override them key by key)",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        dest="prompt_cache_bytes",
        type=int,
        help="memory budget of the conversation cache in bytes (default 1 GiB; 0: off)",
    )
    parser.add_argument(
        "--prompt-cache-dir",
        dest="prompt_cache_dir",
        help="keep the conversation cache on disk here too (survives restarts)",
    )
    parser.add_argument(
        "--prompt-cache-disk-bytes",
        dest="prompt_cache_disk_bytes",
        type=int,
        help="byte budget of --prompt-cache-dir (default 8 GiB)",
    )
    parser.add_argument("--config", help="TOML settings file (default: configs/server.toml)")
    parser.add_argument(
        "--log-level", dest="log_level", choices=["critical", "error", "warning", "info", "debug"]
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    overrides: dict[str, Any] = {
        key: getattr(args, key, None)
        for key in (
            "model",
            "host",
            "port",
            "mtp_weights",
            "dtype",
            "draft_vocab",
            "api_key",
            "allowed_hosts",
            "allowed_origins",
            "preset",
            "max_queue",
            "max_batch",
            "default_max_tokens",
            "served_model_names",
            "log_level",
            "chat_template_kwargs",
            "prompt_cache_bytes",
            "prompt_cache_dir",
            "prompt_cache_disk_bytes",
        )
    }
    draft = getattr(args, "draft_tokens", None)
    if draft is not None:
        overrides["draft_tokens"] = parse_draft_tokens(draft)  # a bad K fails here, at start
    settings = load_settings(getattr(args, "config", None), **overrides)
    if draft is not None and str(draft).lower() == "auto":
        settings.draft_tokens = None
    return settings


def engine_factory(settings: ServerSettings) -> Any:
    """A zero-argument loader for the scheduler's worker thread."""

    def load() -> Any:
        from engine.blas import use_fast_blas

        use_fast_blas()  # must precede the first mlx import
        # lazy: the server process imports mlx only here; rank 0 of an mlx.launch group gets
        # the sharded engine (engine.distributed)
        from engine.distributed import engine_class

        engine = engine_class().load(
            settings.model,
            draft_tokens=settings.draft_tokens,
            mtp_weights=settings.mtp_weights,
            draft_vocab=settings.draft_vocab,
            dtype=settings.dtype,
        )
        engine.enable_prefix_cache(
            settings.prompt_cache_bytes,
            settings.prompt_cache_dir,
            settings.prompt_cache_disk_bytes,
        )
        return engine

    return load


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app

    try:
        settings = settings_from_args(args)
    except Exception as exc:  # config errors: one clear line, no traceback
        print(f"mtpserve serve: {exc}", file=sys.stderr)
        return 2
    if not settings.model:
        # The embedded demo model (models/qwen3.5-demo) is the default, as for `generate`.
        from engine.api import DEMO_MODEL

        if not DEMO_MODEL.is_dir():
            print("mtpserve serve: --model is required (no demo model here)", file=sys.stderr)
            return 2
        settings.model = str(DEMO_MODEL)
    if settings.preset:
        try:
            settings.sampling_overrides()
        except Exception as exc:
            print(f"mtpserve serve: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # `mtpserve` configured logging before this (WARNING without -v), which basicConfig leaves
    # alone: the level is set here, so start-up says what it loads and measures
    logging.getLogger().setLevel(settings.log_level.upper())
    from engine.api import ModelNotFound, resolve_model_dir

    try:  # a missing folder or an unreachable repo: one clear line, before the server starts
        resolve_model_dir(settings.model)
    except ModelNotFound as exc:
        print(f"mtpserve serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine_factory(settings), settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtpserve serve", description="OpenAI-compatible server with MTP drafting"
    )
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
