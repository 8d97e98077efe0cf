"""The drafter protocol and registry.

A drafter proposes a `DraftTree` each step; the engine runs the target once over it, verifies, commits the
accepted path, and tells the drafter what happened so it can roll back its own state:

    prefill(ctx, target_out)           after the prompt's prefill (target_out: the last chunk's ForwardOutput)
    propose(ctx) -> DraftTree          root = ctx.tokens[-1]; at most ctx.k drafted tokens deep
    on_verified(ctx, result, target_out)

`needs_hidden` lists the target hidden states (HF `hidden_states` ids, see models/transformer.py) the drafter
reads; the engine captures them in every target pass. Drafter classes register under their `method` name with
`@register("name")` and are built by `create(spec, target, tokenizer)`; the engine never branches on the name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree

DRAFTERS: dict[str, type["Drafter"]] = {}


def module_bytes(*modules) -> int:
    """Bytes of the parameters and buffers of `modules` (each tensor counted once)."""
    seen, total = set(), 0
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_1k(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """KV-cache bytes for 1000 tokens: keys and values of every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size() * 1000


def register(name: str):
    def deco(cls):
        if name in DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        DRAFTERS[name] = cls
        cls.method = name
        return cls

    return deco


@dataclass
class DraftContext:
    tokens: list[int]  # prompt + generated so far; tokens[-1] is the root (chosen, not yet run by the target)
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    k: int  # how many tokens deep to draft this step (already capped by the remaining budget)
    max_nodes: int | None = None  # tree drafters: keep at most this many drafted nodes (None: their own setting)


class Drafter:
    method: str = ""
    needs_hidden: tuple[int, ...] = ()

    @classmethod
    def check(cls, spec, target_config) -> None:
        """Cheap checks run before any weights load (bad settings fail fast). Raise SpecloomError.
        `target_config.source_dir` is the target's HF directory (None for GGUF), where built-in drafters live."""

    @classmethod
    def create(cls, spec, target, tokenizer) -> "Drafter":
        raise NotImplementedError

    @property
    def num_speculative_tokens(self) -> int:
        raise NotImplementedError

    def prefill(self, ctx: DraftContext, target_out) -> None:
        pass

    def memory(self) -> dict:
        """Bytes the drafter adds: `weights` (its own parameters and buffers, shared target parts excluded) and
        `kv_per_1k_tokens` (its KV cache per 1000 tokens of context at the dtype it allocates)."""
        return {"weights": 0, "kv_per_1k_tokens": 0}

    def propose(self, ctx: DraftContext) -> DraftTree:
        raise NotImplementedError

    def fork(self) -> "Drafter":
        """A drafter for one more concurrent sequence (continuous batching): it shares this one's weights and
        settings and owns fresh per-sequence state (caches are dropped; `prefill` builds them)."""
        from ..kv import KVCache

        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, KVCache):
                setattr(new, name, None)
            elif isinstance(value, list):  # per-sequence lists (feature queues, per-layer caches) must not alias
                setattr(new, name, [None if isinstance(v, KVCache) else v for v in value])
            elif isinstance(value, dict) and name.startswith("_"):
                setattr(new, name, dict(value))
        return new

    def on_verified(self, ctx: DraftContext, result, target_out) -> None:
        pass
