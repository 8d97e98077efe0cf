"""Drafter registry. A drafter class registers under the `method` name users pass in `--speculative-config`."""

from __future__ import annotations

DRAFTERS: dict[str, type] = {}


def register(name: str):
    def deco(cls):
        if name in DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        DRAFTERS[name] = cls
        return cls

    return deco
