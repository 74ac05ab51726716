"""Shared fixtures: tiny random Qwen3.5 checkpoints in HF layout, and engines over them; the tier
markers.

The suite is in four folders, one per tier, each test marked with its folder's name (``-m unit``):
unit (pure functions, the sampler, the kernels), engine (model, cycle, batching, caches),
server (HTTP against the scripted fake engine or the real one, in process) and e2e (subprocess
servers and commands, client libraries, the browser, distributed). Every unit test and the tests
marked ``fast`` in the other tiers make ``make test-fast``. The helper modules (checkpoints.py,
fake_engine.py, ...) sit here, importable by name from every tier.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.blas import use_fast_blas

use_fast_blas()  # before mlx is imported anywhere in the test session

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import VARIANTS, Variant, write_checkpoint  # noqa: E402

TIERS = ("unit", "engine", "server", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (its folder under tests/); the unit tier is fast as a whole."""
    here = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(here).parts
        tier = parts[0] if len(parts) > 1 and parts[0] in TIERS else None
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}/")
        item.add_marker(tier)
        if tier == "unit":
            item.add_marker("fast")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep measured-cost caches of throwaway checkpoints out of the user's home."""
    import engine.scheduling.costs

    path = tmp_path_factory.mktemp("cost-cache")
    os.environ["MTPSERVE_CACHE"] = str(path)
    engine.scheduling.costs.CACHE_DIR = path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Variant], Path]:
    """Write (once per session) the checkpoint of a ``Variant``; returns its folder."""
    cache: dict[Variant, Path] = {}

    def make(variant: Variant) -> Path:
        if variant not in cache:
            cache[variant] = write_checkpoint(tmp_path_factory.mktemp(variant.name), variant)
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: Callable[[Variant], Path]) -> Path:
    """The default tiny checkpoint (dense, tied, single file, with an MTP head)."""
    return make_checkpoint(VARIANTS["dense-tied"])


@pytest.fixture(scope="session")
def load_engine(make_checkpoint: Callable[[Variant], Path]) -> Callable[..., object]:
    """Load (once per session) an ``Engine`` for a variant name or ``Variant``."""
    from engine.runtime import Engine

    cache: dict[tuple, object] = {}

    def load(variant: str | Variant, **kwargs: object) -> object:
        v = VARIANTS[variant] if isinstance(variant, str) else variant
        key = (v, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = Engine.load(str(make_checkpoint(v)), **kwargs)
        return cache[key]

    return load


@pytest.fixture(scope="session")
def tiny_engine(load_engine: Callable[..., object]) -> object:
    return load_engine("dense-tied", draft_tokens=2)


# -- HTTP clients of a module's ``server`` fixture (a fake_engine.LiveServer) ------------------


@pytest.fixture
def client(server: object) -> object:
    """The openai SDK pointed at the module's live server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(server: object):
    """An httpx client on the module's live server (raw bodies, SSE, metrics)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def claude(server: object) -> object:
    """The anthropic SDK pointed at the module's live server."""
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
