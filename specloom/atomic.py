"""Files written whole or not at all: each is written to a temporary file beside it, then renamed over it, so a
crash or a SIGKILL in the middle of a write leaves the previous version (or nothing), never a torn file that a rerun
would fail to read. Long jobs (`specloom data`, `specloom train`) resume from what they find on disk."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager


@contextmanager
def replacing(path: str):
    """Yields a temporary path to write; on success it replaces `path` (one rename), on failure it is removed."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_text(path: str, text: str) -> None:
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


def write_json(path: str, obj, **kw) -> None:
    write_text(path, json.dumps(obj, **kw))


def remove_stale(directory: str) -> None:
    """Remove the temporary files a killed writer left in `directory` (they are never read)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[2] == "tmp" and parts[1].isdigit():
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
