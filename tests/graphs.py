"""Which primitives an mlx graph holds, for tests that check which implementation a path runs
(a native op or mlx's formulation give the same numbers, so only the graph tells them apart)."""

from __future__ import annotations

import io
import re

import mlx.core as mx

_NODE = re.compile(r'label ="([^"]+)", shape=rectangle')


def primitive_names(*outputs: mx.array) -> set[str]:
    """The names of the primitives in the graph behind ``outputs`` (mlx's compiled fusions
    under their ``Compiled...`` names). Take it before anything evaluates them: an evaluated
    array is detached from its graph, and its set is empty."""
    buffer = io.StringIO()
    mx.export_to_dot(buffer, *outputs)
    return set(_NODE.findall(buffer.getvalue()))
