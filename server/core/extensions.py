"""mtpserve's extension fields that every API's request body takes the same way."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

#: ``draft_tokens``: the request's speculative draft length K (0 = plain decoding; the engine
#: bounds it further, with a 400), ``"auto"`` for automatic K whatever the server's default, or
#: absent / null for the server's default (``--draft-tokens``).
DraftTokens = Annotated[int, Field(ge=0, le=32)] | Literal["auto"] | None
