"""``DistributedEngine``: the engine on rank 0 of a group, its trunk sharded and every cache
operation mirrored on the followers."""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from engine.api import EngineUnavailable, GenerationRequest, RequestError
from engine.cycle.sequence import Sequence
from engine.cycle.speculative import CycleResult
from engine.distributed.group import world
from engine.distributed.leader import DEFAULT_TIMEOUT_S, Leader, LeaderTrunkCache
from engine.distributed.measure import weight_bytes
from engine.distributed.vocab import attach_leader, load_sharded
from engine.model import loader
from engine.runtime import Engine
from engine.scheduling.batching import BatchDecoder

log = logging.getLogger("mtpserve.distributed")


@dataclass
class DistributedEngine(Engine):
    """``Engine`` on rank 0 of a group: the trunk is sharded and mirrored on the followers."""

    leader: Leader | None = field(default=None, repr=False)

    @classmethod
    def load_model(
        cls, model: str, *, mtp_weights: str | None, dtype: str, memory_limit: int | None = None
    ) -> loader.LoadedModel:
        group = world()
        if group is None or group.rank() != 0:
            raise RuntimeError("DistributedEngine runs on rank 0 of a group (mlx.launch)")
        loaded = load_sharded(
            model, mtp_weights=mtp_weights, dtype=dtype, memory_limit=memory_limit
        )
        timeout = float(os.environ.get("MTPSERVE_DISTRIBUTED_TIMEOUT", DEFAULT_TIMEOUT_S))
        leader = Leader(group, timeout)
        leader.weight_bytes = weight_bytes(loaded.model)
        attach_leader(loaded.trunk, leader)
        leader.active = 1  # start-up measures auto K's costs through the group: watched too
        loaded.trunk.mtpserve_new_cache = lambda: LeaderTrunkCache(loaded.trunk, leader)
        loaded.trunk.mtpserve_leader = leader
        leader.watch()
        atexit.register(leader.shutdown)
        return loaded

    @classmethod
    def load(cls, model: str, **kwargs: Any) -> DistributedEngine:
        engine = super().load(model, **kwargs)
        engine.leader.active -= 1  # loaded: the watchdog watches generations only
        return engine

    def __post_init__(self) -> None:
        self.leader = getattr(self.loaded.trunk, "mtpserve_leader", None)

    def enable_prefix_cache(self, budget_bytes: int, *args: Any, **kwargs: Any) -> None:
        """The conversation cache restores trunk caches by building new arrays, which the
        followers would never see (they mirror only ``TrunkCache`` operations): off here."""
        if budget_bytes > 0:
            log.warning("the conversation cache is off under mlx.launch (sharded trunk)")
        super().enable_prefix_cache(0)

    @property
    def on_lost(self) -> list[Callable[[BaseException], None]]:
        """Callbacks run once when the group is lost (the server fails its queue there)."""
        return self.leader.on_lost

    def check(self, request: GenerationRequest) -> None:
        """``Engine.check``, and no prompt scoring: its vocabulary projections of the prompt
        are the leader's alone, where the followers would wait for their part of them."""
        super().check(request)
        if request.prompt_logprobs is not None:
            raise RequestError(
                "prompt logprobs (echo with logprobs) are not served across processes",
                "prompt_logprobs",
            )

    def batch(self, capacity: int) -> BatchDecoder:
        """One row at a time: the followers mirror one sequence's cache operations at a time."""
        return BatchDecoder(self, 1)

    def row_steps(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool] = lambda: False,
        trace: Callable[[dict[str, Any]], None] | None = None,
        seq: Sequence | None = None,
    ) -> Generator[Any, CycleResult | None, None]:
        """``Engine.row_steps`` watched by the leader: progress at every step, and a failure
        after anything reached the group loses the group (the ranks' caches may differ)."""
        leader = self.leader
        leader.check_alive()
        sent = leader.messages
        leader.active += 1
        leader.progress()
        steps = super().row_steps(request, cancelled, trace, seq)
        try:
            reply: Any = None
            thrown: BaseException | None = None
            while True:
                try:
                    item = steps.send(reply) if thrown is None else steps.throw(thrown)
                except StopIteration:
                    return
                thrown = None
                leader.progress()
                try:
                    reply = yield item
                except GeneratorExit:
                    steps.close()
                    raise
                except BaseException as exc:  # the batch's account of this row's cycle
                    thrown = exc
        except (EngineUnavailable, RequestError):
            # a request's own error (a grammar's dead end) is raised where the caches of
            # every rank agree: it fails that request, never the group
            raise
        except Exception as exc:
            if leader.messages == sent:  # refused before anything reached the group
                raise
            raise leader.lose(f"{type(exc).__name__}: {exc}") from exc
        finally:
            leader.active -= 1

    def shutdown(self) -> None:
        self.leader.shutdown()
