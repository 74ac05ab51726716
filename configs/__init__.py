"""The configuration files that ship with mtpserve, as package data: sampler presets, the server's
default settings, the chat template, the bench prompts.

Read them through these functions, never through a path relative to a module: from a clone and
from an installed wheel alike, the files are found where the installer put them.
"""

from __future__ import annotations

from contextlib import ExitStack
from importlib.resources import as_file, files
from pathlib import Path

PRESETS = "presets.toml"
SERVER = "server.toml"
CHAT_TEMPLATE = "chat_template.jinja"
BENCH_PROMPTS = "bench_prompts.jsonl"

_extracted = ExitStack()  # files of a zipped install, extracted once for the process's life


def text(name: str) -> str:
    """The contents of the shipped file ``name``."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def path(name: str) -> Path:
    """The shipped file ``name`` on disk, for readers that take a path (pydantic's TOML source,
    ``--prompts`` defaults); an ordinary install gives the file itself."""
    resource = files(__name__).joinpath(name)
    if isinstance(resource, Path):
        return resource
    return _extracted.enter_context(as_file(resource))
