"""The drafter protocol and registry.

A drafter is the kind's *shared* part (weights, settings, tree size); each running sequence owns a per-row
state made by `new_state()`. Every call takes all rows of the step at once, so hidden-state drafters run one
drafter pass per depth for the whole batch:

    new_state() -> state                        per sequence (held in `ctx.state`)
    prefill(ctx, target_out)                    after one row's prompt prefill (target_out: its ForwardOutput)
    propose(ctxs) -> list[DraftTree]            root = ctx.tokens[-1]; at most ctx.k drafted tokens deep
    on_verified(ctxs, results, target_out)      target_out: the step's pass, its row b for ctxs[b]
    on_finished(ctx)                            serving: a request is done (ctx.tokens = prompt + its output)
    idle_free                                   steps at depth 0 cost nothing: the state catches up lazily
    free_drafts(ctxs) -> [(tree, expected)|None] drafts costing no drafter pass, for rows left idle (hybrid)

Each `DraftContext` names its row of the target's KV store (`ctx.kv`, `ctx.row`); a drafter keeps its own
keys/values in a companion store of that store (`ctx.kv.companion(...)`), row for row, so rows are allocated and
freed together. `needs_hidden` lists the target hidden states (HF `hidden_states` ids, see models/transformer.py) the
drafter reads; the step captures them in every target pass. Drafters without a batched pass (n-gram, test
drafters) implement `propose_one(ctx)` instead of `propose`. A kind is one record (`Kind`: drafter, config keys,
checkpoint format, export form, trainers with their options), filled by decorators in its own folder
(`@register`, `@checkpoint_format`, `@export_form`, `@trainer`); the engine never branches on a kind's name.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field

import torch

from ..errors import SpecloomError
from ..kv import kv_bytes_per_token
from ..sampling import SamplingParams
from ..tree import DraftTree



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
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * 1000


def int_key(lo: int, hi: int):
    """A --speculative-config key holding an integer in [lo, hi]."""
    def check(name, v):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise SpecloomError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        return v
    return check


def float_key(lo: float, hi: float):
    """A --speculative-config key holding a number in [lo, hi]."""
    def check(name, v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            raise SpecloomError(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        return float(v)
    return check


TREE_KEYS = {"tree_width": int_key(1, 16), "num_draft_tokens": int_key(1, 256)}


def _token_map_key(name, v):
    if not isinstance(v, str) or not v:
        raise SpecloomError(f"{name} must be a path to a token-map JSON file, got {v!r}")
    return v


# FR-Spec's reduced draft vocabulary (drafters/token_map.py), for kinds that score the whole vocabulary
VOCAB_KEYS = {"draft_vocab": int_key(1, 1 << 22), "token_map": _token_map_key}


@dataclass
class ExportForm:
    """How a kind is written in the speculators format (what vLLM serves): `save(net, out, meta, dtype=,
    verifier=, verifier_architectures=)`; `net(drafter)` the network written; `tokens(spec, meta, net)` the
    draft depth named in vLLM's command; `check_target(model_type, target_name)` refuses, before any weights
    load, a target whose drafter has no speculators form; `vllm` False: no `vllm serve` line (the drafter is
    part of the target checkpoint)."""

    save: Callable
    net: Callable = None  # default: the drafter's `model`
    tokens: Callable = None  # default: the spec's num_speculative_tokens, else the network's num_drafts
    check_target: Callable | None = None
    vllm: bool = True

    def __post_init__(self):
        self.net = self.net or (lambda drafter: drafter.model)
        self.tokens = self.tokens or (lambda spec, meta, net: spec.num_speculative_tokens or net.config.num_drafts)


@dataclass
class Kind:
    """One drafter kind, everything about it in one record, filled from its own folder (drafters/<kind>/):

    * `drafter`: the class (`@register(name, keys, trainers)` on it), built by `create(spec, target, tokenizer)`;
    * `keys`: its own `--speculative-config` keys, name -> check(name, value) returning the value or raising
      SpecloomError (speculative.py takes them as the spec's options);
    * `format`: its checkpoint format (`@checkpoint_format(name)`, drafters/checkpoint.py: `read_config`,
      `build`, `save`), or None for kinds without weights;
    * `export`: its speculators form (`@export_form(name)`, an ExportForm), or `no_export`: why there is none;
    * `trainers`: the modules whose import registers its trainer classes (`@trainer(name)`, into `trained`) and
      whose `add_arguments(parser)` adds their `specloom train` options.
    """

    name: str
    drafter: type | None = None
    keys: dict = field(default_factory=dict)
    trainers: tuple[str, ...] = ()
    format: object | None = None
    export: ExportForm | None = None
    no_export: str | None = None
    trained: dict = field(default_factory=dict)  # trainer name -> class (`specloom train <name>`)


KINDS: dict[str, Kind] = {}


def kind(name: str) -> Kind:
    """The record of kind `name`, made empty on first mention (its folder's modules fill it in any order)."""
    if name not in KINDS:
        KINDS[name] = Kind(name)
    return KINDS[name]


class _Drafters(MutableMapping):
    """method name -> drafter class, read from the kind records (kinds with a drafter only). Setting one makes a
    record with that drafter and no keys of its own (a test's scripted drafter); deleting one drops its record."""

    def __getitem__(self, name):
        k = KINDS.get(name)
        if k is None or k.drafter is None:
            raise KeyError(name)
        return k.drafter

    def __setitem__(self, name, cls):
        KINDS[name] = Kind(name, cls)

    def __delitem__(self, name):
        del KINDS[name]

    def __iter__(self):
        return (n for n, k in KINDS.items() if k.drafter is not None)

    def __len__(self):
        return sum(1 for _ in self)


DRAFTERS = _Drafters()


def register(name: str, keys: dict | None = None, trainers: tuple[str, ...] = (), no_export: str | None = None):
    """Class decorator: the drafter of kind `name`, its `--speculative-config` keys, its trainer modules (".trainer":
    relative to the kind's folder) and (for a kind without a speculators form) why it has none."""
    def deco(cls):
        k = kind(name)
        if k.drafter is not None:
            raise ValueError(f"drafter {name!r} registered twice")
        package = cls.__module__.rsplit(".", 1)[0]  # ".trainer": a module of the kind's own folder
        mods = tuple(package + m if m.startswith(".") else m for m in trainers)
        k.drafter, k.keys, k.trainers, k.no_export = cls, dict(keys or {}), mods, no_export
        cls.method = name
        return cls

    return deco


def trainer(name: str, of: str | None = None):
    """Class decorator: the trainer `specloom train <name>` runs, in the record of kind `of` (default: `name`;
    mtp's folder also trains a new target jointly with its MTP layers: `@trainer("target", of="mtp")`)."""
    def deco(cls):
        kind(of or name).trained[name] = cls
        cls.kind = name
        return cls

    return deco


def export_form(name: str, **options):
    """Function decorator: `save` of kind `name`'s speculators form (ExportForm's other fields as options)."""
    def deco(save):
        kind(name).export = ExportForm(save, **options)
        return save

    return deco


def path_rows(x: torch.Tensor, path: list[int]) -> torch.Tensor:
    """x's rows along `path` (node indices of a verified tree, e.g. to keep the target features of the committed
    positions): a slice where they are consecutive -- a plain step's root, a chain's accepted nodes -- else a
    gather; the same values either way. A row kept across idle steps must not hold a whole pass's tensor alive:
    a slice of a larger storage is copied."""
    p0 = path[0]
    if path[-1] - p0 == len(path) - 1 and all(a + 1 == b for a, b in zip(path, path[1:])):
        r = x[p0:p0 + len(path)]
        return r if r.numel() * r.element_size() == r.untyped_storage().nbytes() else r.clone()
    return x[torch.tensor(path, device=x.device)]


@dataclass
class DraftContext:
    tokens: list[int]  # prompt + generated so far; tokens[-1] is the root (chosen, not yet run by the target)
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    k: int  # how many tokens deep to draft this step (already capped by the remaining budget)
    max_nodes: int | None = None  # tree drafters: keep at most this many drafted nodes (None: their own setting)
    row: int = 0  # this sequence's row in the target's KV store (and in the drafter's companion stores)
    kv: object = None  # the target's KV store (kv.KVCache)
    state: object = None  # the drafter's per-row state (`Drafter.new_state()`)
    budget: int = 0  # the most drafted tokens this row may still emit (its token budget; k <= budget)
    noise_seed: int | None = None  # coupled sampling (sampling.py): draw drafts as argmax(log q + G_t) with this key

    @property
    def root_position(self) -> int:
        return len(self.tokens) - 1


class Drafter:
    method: str = ""
    needs_hidden: tuple[int, ...] = ()
    num_nodes: int | None = None  # tree drafters: drafted nodes per step (None: a chain of depth nodes)
    keeps_kv: bool = False  # keeps keys/values of its own in companion stores (takes `kv_cache_dtype`)
    kv_cache_dtype = None  # the type of those stores (kv_quant.KVType; None: its model's default), set by
    # drafters/__init__.py create_drafter from the spec's `kv_cache_dtype`
    # the checkpoint it was read from, {"path": dir, "meta": its specloom block (target fingerprint, probe
    # recording, manifest, measured figures)}; None for kinds without one (n-gram, suffix, draft model)
    checkpoint: dict | None = None

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

    def memory(self) -> dict:
        """Bytes the drafter adds: `weights` (its own parameters and buffers, shared target parts excluded) and
        `kv_per_1k_tokens` (its companion KV per 1000 slots of a row, at the dtype it allocates; a companion row
        is as long as the target's row)."""
        return {"weights": 0, "kv_per_1k_tokens": 0}

    @property
    def idle_free(self) -> bool:
        """Whether steps in which a row drafts nothing (depth 0) cost this drafter nothing it cannot make up:
        its per-row state catches up lazily -- the next `propose` feeds it what it missed (the tokens, or the
        target features `on_verified` kept), correct after any number of idle steps and for at most one pass
        over the missed positions. The load-aware policy then keeps a row that cannot pay drafting on and probes
        it now and then (its text may become predictable) instead of turning it off for the rest of the
        request. Default: a drafter that reads no target features and keeps no KV of its own (n-gram, suffix);
        any other kind says so itself (a drafter whose state needs real work every step must not)."""
        try:
            kv = self.memory().get("kv_per_1k_tokens", 0)
        except Exception:
            kv = 1
        return not self.needs_hidden and not kv

    def free_drafts(self, ctxs: list[DraftContext]) -> list:
        """Drafts that cost no drafter pass (a host-side lookup of microseconds, no model), offered for rows the
        depth policy would leave idle this step: per row (tree, expected accepted drafted tokens), or None. The
        policy verifies one where its expected tokens pay for the wider pass, running that row at the tree's
        depth; `propose` must then return this very tree for it (the drafter keeps it in the row's state until
        the step, `ctx.root_position` naming the step). `ctx.k` is the row's cap, `ctx.budget` its token
        budget. Default: nothing is free."""
        return [None] * len(ctxs)

    def new_state(self):
        """Fresh per-row state for one sequence."""
        return None

    def prefill(self, ctx: DraftContext, target_out) -> None:
        pass

    def propose(self, ctxs: list[DraftContext]) -> list[DraftTree]:
        return [self.propose_one(c) for c in ctxs]

    def propose_one(self, ctx: DraftContext) -> DraftTree:
        raise NotImplementedError

    def on_verified(self, ctxs: list[DraftContext], results: list, target_out) -> None:
        pass

    def on_finished(self, ctx: DraftContext) -> None:
        """A served request is done and did not fail (the scheduler calls this once, as it retires the row,
        before the caller sees the result): `ctx.tokens` is its prompt and whole output. Drafters that learn
        across requests (suffix: its cache of earlier responses) keep what they need; by default nothing.
        `Engine.generate` does not call it: each call stands alone."""
