"""Write ``draft_vocab.json`` into a model folder: token ids ranked by frequency in a corpus.

The MTP head can draft over only the most frequent tokens (``--draft-vocab N``), which makes its
vocabulary projection — most of a draft step for small models — N/V as expensive. Drafting stays
exact (see engine/model/mtp.py); acceptance can drop by at most the target mass outside the subset.

    .venv/bin/python scripts/experiments/draft_vocab.py --model models/qwen3.5-demo --default-size 2048 \
        --corpus /usr/lib/python3.11 [--corpus more/text ...]

``--corpus`` takes files or folders (``*.py``, ``*.txt``, ``*.md`` inside, tests excluded);
``--ids FILE.npy`` takes already-tokenized ids instead.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

SUFFIXES = {".py", ".txt", ".md", ".rst"}


def corpus_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        else:
            files += sorted(
                f
                for f in p.rglob("*")
                if f.suffix in SUFFIXES and "test" not in f.parts and f.is_file()
            )
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--corpus", action="append", default=[])
    parser.add_argument("--ids", default=None, help=".npy of token ids")
    parser.add_argument("--default-size", type=int, required=True)
    args = parser.parse_args()

    counts: Counter[int] = Counter()
    if args.ids:
        import numpy as np

        counts.update(np.load(args.ids).ravel().tolist())
    if args.corpus:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        for f in corpus_files(args.corpus):
            counts.update(tokenizer.encode(f.read_text(errors="ignore"), add_special_tokens=False))
    if not counts:
        raise SystemExit("no corpus: give --corpus or --ids")
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    ranked = [t for t, _ in counts.most_common() if t < vocab]
    ranked += [t for t in range(vocab) if t not in counts]  # unseen ids last, in id order
    total = sum(counts.values())
    coverage = sum(counts[t] for t in ranked[: args.default_size]) / total
    out = {
        "default_size": args.default_size,
        "coverage_at_default": round(coverage, 4),
        "corpus_tokens": total,
        "ids_by_frequency": ranked,
    }
    (Path(args.model) / "draft_vocab.json").write_text(json.dumps(out))
    print(
        f"wrote draft_vocab.json: top {args.default_size} tokens cover {coverage:.1%} of "
        f"{total} corpus tokens"
    )


if __name__ == "__main__":
    main()
