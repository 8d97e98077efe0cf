"""Target passes of fixed widths replayed as CUDA graphs (issue 40, "fast on a GPU").

A decode step of a small model on a GPU is bound by kernel launches, not by reading the weights: SmolLM2-135M
runs ~300 kernels a token, each a few microseconds to launch from Python. As gpt-fast does, a pass of T tokens
over one sequence is captured once per width T (and per set of captured hidden states) and replayed: the
launches happen once, in the graph. What makes a pass capturable is that nothing in it depends on the host:

* `StaticPass` stands in for the store's pass (kv.py's `KVPass`): the first new slot is a device tensor, so the
  keys/values, the slots' RoPE positions and the mask are written and built with `index_copy_` and comparisons
  over *every* slot of the row (the shapes never change); attention reads the row's whole store, the mask hiding
  what the pass must not see (stale slots beyond the pass, a tree's other branches);
* the RoPE tables are built for the store's whole length beforehand (`Rope.lookup` reads them without the size
  check's host read).

The host keeps its own bookkeeping as for any pass: `kv.begin` opens the pass (lengths, pending entries) before
the replay and `kv.commit` keeps the accepted path after it, so the step runs exactly as without graphs.

Where it applies: a CUDA target whose layers are PyTorch modules, a plain (unquantized) KV store, a pass over one
row of up to `MAX_WIDTH` tokens with a causal or tree mask (`applies`). Anything else (prefill chunks, batched
rows, the CPU) runs eagerly. `SPECLOOM_CUDA_GRAPHS=0` turns it off. A capture that fails turns graphs off for
the model and the pass runs eagerly (logged once).

On the CPU the same static pass runs eagerly (`GraphedPasses(..., capture=False)`): what the CPU suite can check
(`tests/test_graphs.py`: generation through it equals the eager path); the graphs themselves are checked by the
GPU kit (`tests/test_cuda.py`).
"""

from __future__ import annotations

import logging
import os

import torch

from .context import AttentionContext
from .transformer import ForwardOutput

log = logging.getLogger("specloom")

MAX_WIDTH = 32  # the widest pass replayed (a draft tree of 31 nodes); wider ones run eagerly
MAX_GRAPHS = 64  # graphs kept per store ((row, width, captured states) each); passes beyond them run eagerly


def prebuild_rope(rope, length: int, dtype, device) -> None:
    """Build `rope`'s tables to cover positions < `length` in `dtype` on `device` (a graph reads them through
    `Rope.lookup` and cannot grow them)."""
    t = rope.cos_table
    if t is None or t.shape[0] < length or t.dtype != dtype or t.device != torch.device(device):
        rope(torch.tensor([[length - 1]], device=device), dtype)


def enabled(model) -> bool:
    """Whether `model`'s single-row passes replay as CUDA graphs here."""
    return (model.device.type == "cuda" and os.environ.get("SPECLOOM_CUDA_GRAPHS", "1") != "0"
            and torch.cuda.is_available())


class StaticPass:
    """A pass of T entries over row `row` of a plain KV store whose first slot is the device tensor `start`
    (shape (1,), long): every shape is fixed by (T, the store), so a graph can replay it at any slot."""

    static = True

    def __init__(self, kv, row: int, T: int, start: torch.Tensor):
        self.kv, self.row, self.T, self.start_t = kv, row, T, start
        self.n, self.rows, self.members, self.uniform = 1, [row], [row], True
        self._slots = None

    def open(self, T: int) -> "StaticPass":
        if T != self.T:
            raise ValueError(f"a static pass of {self.T} entries was given {T} tokens")
        return self

    def static_context(self, model, positions: torch.Tensor, attn_mask: torch.Tensor | None) -> AttentionContext:
        """The context of a target pass (transformer.py's `_context` hands a static pass here)."""
        cos_sin = {kind: model.ropes[kind if kind in model.ropes else "full"].lookup(positions, model.dtype)
                   for kind in model.layer_kinds}
        sliding = model.config.sliding_window if "sliding" in model.layer_kinds else None
        return self.context(positions, attn_mask, cos_sin, sliding)

    def context(self, positions: torch.Tensor, attn_mask: torch.Tensor | None, cos_sin: dict,
                sliding_window: int | None = None) -> AttentionContext:
        """The pass's attention context, computed on the device: slots start..start+T-1 take the positions, and
        the (1, 1, T, S_max) mask shows each query the row's slots before the mask's R columns and, of the last R
        slots up to the pass's end, those `attn_mask` (T, R) allows (causal over the new entries without one;
        R > T: a drafter's rows of earlier depths, as models/context.py reads them)."""
        kv, T, dev = self.kv, self.T, positions.device
        S = kv.max_len
        self._slots = self.start_t + torch.arange(T, device=dev)  # (T,)
        kv.slot_pos[self.row].index_copy_(0, self._slots, positions[0])
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril() if attn_mask is None \
            else attn_mask.reshape(T, attn_mask.shape[-1])
        R = mask.shape[-1]
        rel = torch.arange(S, device=dev) - (self.start_t + (T - R))  # (S,): slot - the first masked slot
        inside = (rel >= 0) & (rel < R)
        full = (rel < 0) | (mask[:, rel.clamp(0, R - 1)] & inside)  # (T, S)
        masks = {"full": full[None, None]}
        if sliding_window is not None:
            near = (positions[0][:, None] - kv.slot_pos[self.row][None, :]) < sliding_window
            masks["sliding"] = masks["full"] & near[None, None]
        return AttentionContext(self, cos_sin, masks, {}, False, False)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (1, H_kv, T, d) into the row's slots start..start+T-1; returns the row's whole store (1, H, S, d)."""
        kl, vl = self.kv.k[layer], self.kv.v[layer]
        kl[self.row].index_copy_(1, self._slots, k[0].to(kl.dtype))
        vl[self.row].index_copy_(1, self._slots, v[0].to(vl.dtype))
        return kl[self.row:self.row + 1], vl[self.row:self.row + 1]


class _Graph:
    """One captured width: its input buffers, its graph (None: run eagerly) and its outputs."""

    def __init__(self, model, kv, row: int, T: int, capture: tuple, dev):
        self.tok = torch.zeros(1, T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, T, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        self.mask = self.causal.clone()
        self.pass_ = StaticPass(kv, row, T, self.start)
        self.model, self.capture = model, capture
        self.graph = None
        self.out: ForwardOutput | None = None

    def run_eager(self) -> ForwardOutput:
        return self.model(self.tok, self.pos, self.pass_, attn_mask=self.mask, capture=self.capture)


class GraphedPasses:
    """The replayed passes of one model over one KV store (`run` one pass; `applies` whether it can)."""

    def __init__(self, model, kv, capture: bool = True):
        self.model, self.kv, self.capture_graphs = model, kv, capture
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.failed = False
        self.runs = 0  # passes run through a static pass (replayed, or eagerly where capture is off)

    def applies(self, p, attn_mask: torch.Tensor | None) -> bool:
        """A pass over one row of a plain store, at most MAX_WIDTH wide, causal or with a (T, T) tree mask."""
        if self.failed or self.kv.k_scale is not None or p.n != 1 or not 1 <= p.T <= MAX_WIDTH:
            return False
        return attn_mask is None or tuple(attn_mask.shape[-2:]) == (p.T, p.T) and attn_mask.numel() == p.T * p.T

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, p, attn_mask: torch.Tensor | None,
            capture: tuple = ()) -> ForwardOutput:
        """The pass `p` (opened by kv.begin over one row) of `tokens`/`positions` (1, T): its logits (1, T, V)
        and captured hidden states. The outputs are the graph's own buffers: read them before the next pass."""
        T, row = p.T, p.rows[0]
        key = (row, T, tuple(capture))
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return self.model(tokens, positions, p, attn_mask=attn_mask, capture=capture)
            g = self.graphs[key] = _Graph(self.model, self.kv, row, T, tuple(capture), tokens.device)
        self.runs += 1
        g.tok.copy_(tokens)
        g.pos.copy_(positions)
        g.start.fill_(p.start)
        g.mask.copy_(g.causal if attn_mask is None else attn_mask.reshape(T, T))
        for rope in self.model.ropes.values():
            prebuild_rope(rope, self.kv.max_len, self.model.dtype, self.model.device)
        if not self.capture_graphs:
            return g.run_eager()
        if g.graph is None and not self._capture(g):
            self.failed = True
            return g.run_eager()
        g.graph.replay()
        return g.out

    def _capture(self, g: _Graph) -> bool:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        captured = capture(g.run_eager, self.pool, "target passes")
        if captured is None:
            return False
        g.graph, g.out = captured
        # the RoPE tables the graph reads stay alive with it (a later rebuild replaces the module's own)
        g.tables = [(r.cos_table, r.sin_table) for r in self.model.ropes.values()]
        return True


def capture(fn, pool, what: str):
    """(graph, fn's output) of `fn` captured as a CUDA graph in memory pool `pool`, after two warm-up calls on a
    side stream; None where capture fails (logged: `what` then runs eagerly). `fn` must write only what a replay
    writes too (a pass's own slots), since the warm-ups run it for real."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out
    except Exception as e:  # eager from now on: slower, never wrong
        log.warning("CUDA graph capture failed (%s: %s): %s run eagerly", type(e).__name__, e, what)
        return None
