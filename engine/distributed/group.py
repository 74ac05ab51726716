"""This process's place in the distributed group: the group itself (None when alone) and this
rank's index."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

_world: Any = None
_world_checked = False


def world() -> Any | None:
    """The distributed group when this process is one of several ranks, else None."""
    global _world, _world_checked
    if not _world_checked:
        group = mx.distributed.init()
        _world = group if group.size() > 1 else None
        _world_checked = True
    return _world


def rank() -> int:
    group = world()
    return group.rank() if group is not None else 0
