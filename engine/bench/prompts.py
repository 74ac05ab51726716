"""The bench prompts (configs/bench_prompts.jsonl) as token ids, rendered as each tool sees them:
chat prompts through the checkpoint's chat template, the others encoded as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import configs
from engine.runtime import chat_prompt_ids

DEFAULT_PROMPTS = configs.path(configs.BENCH_PROMPTS)


def load_prompts(path: Path, tokenizer: Any, limit: int | None) -> list[dict[str, Any]]:
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        if item.get("chat"):
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": item["prompt"]}])
        else:
            ids = tokenizer.encode(item["prompt"], add_special_tokens=False)
        prompts.append({**item, "ids": list(ids)})
    return prompts[:limit] if limit else prompts
