"""A union of request models chosen by their ``type`` field, with a catch-all.

Why: content blocks and input items are told apart by ``type``. A plain union makes pydantic
report every member's mismatch for one bad block; a discriminated union reports the one that
matters. The catch-all member keeps unknown types (images, server tools) valid in the schema so
the adapter can answer with a 400 that names the type, instead of a pydantic union error.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, Discriminator, Tag

#: Tags name union members in pydantic's error locations; the colon marks them as tags, not
#: fields, so an error's ``param`` leaves them out (server.errors).
TAG = "type:"
OTHER = TAG + "*"


def by_type(
    members: dict[str, type[BaseModel]], other: type[BaseModel], missing: str | None = None
) -> Any:
    """``members[type]`` for a known ``type``, else ``other``; ``missing``: the type of an
    object that has none."""

    def tag(value: Any) -> str:
        if isinstance(value, dict):
            kind = value.get("type", missing)
        else:
            kind = getattr(value, "type", None)
        # a type that is not a string (a list, an object) is the catch-all's to reject
        return TAG + kind if isinstance(kind, str) and kind in members else OTHER

    options = [Annotated[model, Tag(TAG + name)] for name, model in members.items()]
    options.append(Annotated[other, Tag(OTHER)])
    return Annotated[Union[tuple(options)], Discriminator(tag)]  # noqa: UP007
