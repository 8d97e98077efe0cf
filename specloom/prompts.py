"""JSONL prompt files: the one reader behind `bench`, `doctor`, the load tests and the training data commands.

A line holds `turns` (Spec-Bench, MT-bench: the first turn is the user message) or `prompt`; `category` and an id
(`question_id` or `id`, else the line number) are kept when present.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter

from .errors import SpecloomError


def prompt_files(paths: str | list[str], refuse_eval: bool = False) -> list[str]:
    """The files of `paths` (files, or directories of `*.jsonl` files, sorted). `refuse_eval`: a file under an
    `eval/` directory is an error (benchmark prompts are never training data)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "*.jsonl")))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise SpecloomError(f"{p}: no such prompts file or directory")
    if refuse_eval:
        for fn in files:
            if "eval" in os.path.normpath(os.path.abspath(fn)).split(os.sep)[:-1]:
                raise SpecloomError(f"{fn} lies in an eval/ directory: benchmark prompts are never training data")
    if not files and paths:
        raise SpecloomError(f"no .jsonl prompt files found in {paths}")
    return files


def read_prompts(
    paths: str | list[str], limit: int | None = None, per_category: int | None = None,
    categories: list[str] | None = None, refuse_eval: bool = False,
) -> list[dict]:
    """Rows {"id", "category", "source" (the file's name without extension), "text"} of the files of `paths`
    (prompt_files), in order. `categories` keeps only those; `per_category` the first N of each; `limit` caps the
    total. No prompt at all is an error."""
    rows: list[dict] = []
    seen: Counter = Counter()
    files = prompt_files(paths, refuse_eval)
    for fn in files:
        source = os.path.splitext(os.path.basename(fn))[0]
        with open(fn) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecloomError(f"{fn}:{lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise SpecloomError(f"{fn}:{lineno}: needs a non-empty turns[0] or prompt")
                text = next((t for t in ((obj.get("turns") or [None])[0], obj.get("prompt"))
                             if isinstance(t, str) and t), None)
                if text is None:
                    raise SpecloomError(f"{fn}:{lineno}: needs a non-empty turns[0] or prompt")
                row = {"id": obj.get("question_id", obj.get("id", lineno)), "category": obj.get("category"),
                       "source": source, "text": text}
                if categories and row["category"] not in categories:
                    continue
                if per_category and seen[row["category"]] >= per_category:
                    continue
                seen[row["category"]] += 1
                rows.append(row)
                if limit and len(rows) >= limit:
                    return rows
    if not rows:
        raise SpecloomError(f"{', '.join(files)}: no prompts")
    return rows
