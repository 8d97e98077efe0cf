"""KVCache bookkeeping (reserve / write / commit / commit(path) / truncate) and its use by the model: chunked
prefill, rollback and tree verification must give the same logits as feeding the accepted tokens plainly."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB
from specloom.errors import SpecloomError
from specloom.kv import KVCache

L, H, D = 2, 2, 3


def new_cache(max_len: int = 16) -> KVCache:
    return KVCache(L, H, D, max_len)


def fill(kv: KVCache, values: list[float]) -> int:
    """One 'pass' writing len(values) entries to every layer: k = value (+ layer), v = -k. Returns the start."""
    n = len(values)
    start = kv.reserve(n)
    for layer in range(L):
        k = torch.tensor(values).view(1, 1, n, 1).expand(1, H, n, D) + layer
        keys, vals = kv.write(layer, start, k, -k)
        assert keys.shape == vals.shape == (1, H, start + n, D)
    return start


def slots(kv: KVCache, n: int | None = None) -> list[float]:
    """Committed slot values read back from layer 0 (checking every layer/head/dim agrees)."""
    n = kv.length if n is None else n
    k, v = kv.k[:, 0, :, :n], kv.v[:, 0, :, :n]  # (L, H, n, D)
    for layer in range(L):
        assert torch.equal(k[layer], k[0] + layer)
    assert torch.equal(v, -k)
    assert torch.equal(k[0], k[0, :1, :, :1].expand(H, n, D))
    return k[0, 0, :, 0].tolist()


def test_commit_keeps_all_pending():
    kv = new_cache()
    assert fill(kv, [0, 1, 2]) == 0
    assert (kv.length, kv.pending) == (0, 3)
    kv.commit()
    assert (kv.length, kv.pending) == (3, 0)
    assert fill(kv, [3, 4]) == 3
    kv.commit()
    assert (kv.length, kv.pending) == (5, 0)
    assert slots(kv) == [0, 1, 2, 3, 4]


def test_commit_path_gathers_into_contiguous_slots():
    kv = new_cache()
    fill(kv, [0, 1, 2])
    kv.commit()
    fill(kv, [100, 101, 102, 103, 104])
    kv.commit([0, 2, 3])
    assert (kv.length, kv.pending) == (6, 0)
    assert slots(kv) == [0, 1, 2, 100, 102, 103]
    # the next pass starts right after the accepted path
    assert fill(kv, [7]) == 6
    kv.commit()
    assert slots(kv) == [0, 1, 2, 100, 102, 103, 7]


@pytest.mark.parametrize(
    "path, expect",
    [
        ([3, 4], [10, 14, 15]),  # pure shift left
        ([1, 0], [10, 12, 11]),  # reversed: overlapping source and destination
        ([0, 1], [10, 11, 12]),  # identity prefix: nothing moves
        (torch.tensor([2, 4]), [10, 13, 15]),  # tensor path
        ([], [10]),  # nothing accepted
    ],
)
def test_commit_path_variants(path, expect):
    kv = new_cache()
    fill(kv, [10])
    kv.commit()
    fill(kv, [11, 12, 13, 14, 15])
    kv.commit(path)
    assert kv.length == len(expect)
    assert kv.pending == 0
    assert slots(kv) == expect


def test_commit_path_outside_pending_raises():
    kv = new_cache()
    fill(kv, [0, 1, 2])
    with pytest.raises(ValueError):
        kv.commit([0, 3])
    with pytest.raises(ValueError):
        kv.commit([-1])
    with pytest.raises(ValueError):  # a leading path (nothing to move) longer than what is pending
        kv.commit([0, 1, 2, 3])


def test_truncate_inside_pending_keeps_its_first_entries():
    kv = new_cache()
    fill(kv, [0, 1, 2])
    kv.commit()
    fill(kv, [3, 4, 5, 6])
    kv.truncate(5)  # accept the first two pending entries
    assert (kv.length, kv.pending) == (5, 0)
    assert slots(kv) == [0, 1, 2, 3, 4]
    assert fill(kv, [9]) == 5  # the rejected slots are overwritten next
    kv.commit()
    assert slots(kv) == [0, 1, 2, 3, 4, 9]


def test_truncate_before_pending_drops_committed_tail():
    kv = new_cache()
    fill(kv, [0, 1, 2, 3])
    kv.commit()
    fill(kv, [4, 5])
    kv.truncate(2)
    assert (kv.length, kv.pending) == (2, 0)
    assert slots(kv) == [0, 1]
    assert fill(kv, [7]) == 2


def test_truncate_out_of_range_raises():
    kv = new_cache()
    fill(kv, [0, 1])
    kv.commit()
    fill(kv, [2])
    kv.truncate(3)  # the end of the pending block is fine
    with pytest.raises(ValueError):
        kv.truncate(4)
    with pytest.raises(ValueError):
        kv.truncate(-1)


def test_reserve_over_capacity_raises():
    kv = new_cache(max_len=8)
    fill(kv, [0] * 6)
    kv.commit()
    assert kv.reserve(2) == 6  # exactly fills the cache
    with pytest.raises(SpecloomError):
        kv.reserve(3)
    kv.commit()
    with pytest.raises(SpecloomError):
        kv.reserve(1)
    with pytest.raises(SpecloomError):
        new_cache(max_len=4).reserve(5)


def test_reserve_drops_uncommitted_entries():
    kv = new_cache()
    fill(kv, [0, 1])
    kv.commit()
    fill(kv, [5, 6, 7])
    assert fill(kv, [8]) == 2  # a new pass replaces the uncommitted one
    assert kv.pending == 1
    kv.commit()
    assert slots(kv) == [0, 1, 8]


def test_reset():
    kv = new_cache()
    fill(kv, [0, 1])
    kv.commit()
    fill(kv, [2])
    kv.reset()
    assert (kv.length, kv.pending) == (0, 0)
    assert kv.reserve(16) == 0


# -- the model over the cache -------------------------------------------------------------------------------------

TOL = 1e-5


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(model, kv, toks: list[int], start_pos: int, **kw) -> torch.Tensor:
    """One forward pass of `toks` at positions start_pos.. (chain); returns logits (T, V)."""
    pos = torch.arange(start_pos, start_pos + len(toks))[None]
    with torch.inference_mode():
        return model(torch.tensor([toks]), pos, kv, **kw).logits[0]


def plain_logits(model, seq: list[int], then: list[int]) -> list[torch.Tensor]:
    """Prefill `seq` in one pass, then decode `then` one token at a time: [last prefill logits, decode logits...]."""
    kv = model.new_kv(len(seq) + len(then) + 4)
    out = [step(model, kv, seq, 0)[-1]]
    kv.commit()
    for i, t in enumerate(then):
        out.append(step(model, kv, [t], len(seq) + i)[-1])
        kv.commit()
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_chunked_prefill_matches_single_prefill(tiny, family):
    model = tiny(family).model
    prompt, then = tokens(21, seed=10), tokens(6, seed=11)
    if family == "gemma3":
        assert model.config.sliding_window < 12  # the chunks below cross the window
    ref = plain_logits(model, prompt, then)

    kv = model.new_kv(40)
    start = 0
    for n in (7, 5, 9):
        last = step(model, kv, prompt[start:start + n], start, num_logits=1)[-1]
        kv.commit()
        start += n
    assert kv.length == 21
    assert (last - ref[0]).abs().max() <= TOL
    for i, t in enumerate(then):
        got = step(model, kv, [t], 21 + i)[-1]
        kv.commit()
        assert (got - ref[i + 1]).abs().max() <= TOL, f"decode step {i}"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_engine_prefill_chunks(tiny, family):
    from specloom.engine import Engine

    t = tiny(family)
    prompt = tokens(23, seed=12)
    ref = plain_logits(t.model, prompt, [])[0]
    for chunk in (4, 9, 512):
        engine = Engine(t.model, t.tokenizer, prefill_chunk=chunk)
        kv = t.model.new_kv(32)
        got = engine.prefill(prompt, kv).logits[0, -1]
        assert kv.length == 23
        assert (got - ref).abs().max() <= TOL, f"prefill_chunk={chunk}"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rollback_by_truncate(tiny, family):
    """A speculative chain of 4 tokens of which 2 are accepted (truncate), then a different continuation: same
    logits as feeding prefix + the 2 accepted tokens + the continuation plainly."""
    model = tiny(family).model
    prefix, chain, then = tokens(12, seed=20), tokens(4, seed=21), tokens(3, seed=22)
    kv = model.new_kv(40)
    step(model, kv, prefix, 0)
    kv.commit()
    chain_logits = step(model, kv, chain, 12)
    kv.truncate(14)
    got = []
    for i, t in enumerate(then):
        got.append(step(model, kv, [t], 14 + i)[-1])
        kv.commit()
    ref = plain_logits(model, prefix + chain[:2], then)
    for i in range(3):
        assert (got[i] - ref[i + 1]).abs().max() <= TOL, f"step {i}"
    # the chain pass itself equals the plain run over the same tokens
    ref_chain = plain_logits(model, prefix + chain, [])
    full = step(model, model.new_kv(20), prefix + chain, 0)
    assert (chain_logits - full[12:]).abs().max() <= TOL
    assert (chain_logits[-1] - ref_chain[0]).abs().max() <= TOL


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_pass_then_commit_path(tiny, family):
    """Tree: 0 is the root, 1 and 2 are its children, 3 is the child of 1. Positions follow depth. Committing
    the path [0, 1, 3] must leave the cache as if the chain [t0, t1, t3] had been fed plainly."""
    model = tiny(family).model
    prefix = tokens(12, seed=30)  # longer than Gemma's window of 8: the sliding mask applies in the tree pass
    t0, t1, t2, t3 = tokens(4, seed=31)
    then = tokens(3, seed=32)
    P = len(prefix)

    kv = model.new_kv(40)
    step(model, kv, prefix, 0)
    kv.commit()
    mask = torch.tensor([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ], dtype=torch.bool)
    positions = torch.tensor([[P, P + 1, P + 1, P + 2]])
    with torch.inference_mode():
        tree_logits = model(torch.tensor([[t0, t1, t2, t3]]), positions, kv, attn_mask=mask).logits[0]
    assert kv.pending == 4
    kv.commit([0, 1, 3])
    assert kv.length == P + 3

    # tree logits: node 3 = chain [t0, t1, t3]; node 2 = chain [t0, t2]
    chain = step(model, model.new_kv(40), prefix + [t0, t1, t3], 0)
    assert (tree_logits[[0, 1, 3]] - chain[P:]).abs().max() <= TOL
    sib = step(model, model.new_kv(40), prefix + [t0, t2], 0)
    assert (tree_logits[2] - sib[-1]).abs().max() <= TOL

    got = []
    for i, t in enumerate(then):
        got.append(step(model, kv, [t], P + 3 + i)[-1])
        kv.commit()
    ref = plain_logits(model, prefix + [t0, t1, t3], then)
    for i in range(len(then)):
        assert (got[i] - ref[i + 1]).abs().max() <= TOL, f"decode step {i} after the tree commit"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_tree_mask_3d(tiny, family):
    """A (B, T, T) mask is accepted and means the same as the (T, T) one for B = 1."""
    model = tiny(family).model
    prefix = tokens(10, seed=40)
    toks = tokens(3, seed=41)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([[10, 11, 11]])
    out = []
    for m in (mask, mask[None]):
        kv = model.new_kv(20)
        step(model, kv, prefix, 0)
        kv.commit()
        with torch.inference_mode():
            out.append(model(torch.tensor([toks]), pos, kv, attn_mask=m).logits[0])
    assert torch.equal(out[0], out[1])


def test_rows_by_index_any_set_in_any_order_and_nothing_moves(tiny):
    """A pass takes any rows in use, in the caller's order (`spread` / `pick` through the rows' span: the rows
    between are padding); freeing a row moves no other; `allocate` takes the lowest free row."""
    model = tiny("llama").model
    kv = model.new_kv(64, batch=4, active=0)
    rows = [kv.allocate() for _ in range(4)]
    assert rows == [0, 1, 2, 3]
    prompts = {0: [5, 6, 7], 1: [9, 10, 11, 12], 2: [20, 21], 3: [30, 31, 32, 33, 34]}
    with torch.inference_mode():
        for r, p in prompts.items():
            model(torch.tensor([p]), torch.arange(len(p))[None], kv.begin([r], [len(p)]))
            kv.commit(row=r)
        before = kv.k[:, 3, :, :5].clone()
        kv.free(1)  # row 3 stays where it is, its keys untouched
        assert kv.used == [True, False, True, True] and kv.lengths[1] == 0
        assert torch.equal(kv.k[:, 3, :, :5], before)
        p = kv.begin([3, 0], [2, 1])  # not neighbours, not in order: rows 1 and 2 of the span are padding
        assert (p.span.lo, p.span.n, p.rows, p.members) == (0, 4, [0, 1, 2, 3], [3, 0])
        tok, pos = torch.tensor([[40, 41], [8, 0]]), torch.tensor([[5, 6], [3, 3]])
        mask = torch.tensor([[[True, False], [True, True]], [[True, False], [False, True]]])
        out = p.pick(model(p.spread(tok), p.spread(pos), p, attn_mask=p.spread(mask, True)).logits)
        kv.commit()
        assert kv.lengths == [4, 0, 2, 7]
        for b, (r, toks, n) in enumerate(((3, [40, 41], 2), (0, [8], 1))):
            ref = model(torch.tensor([prompts[r] + toks]), torch.arange(len(prompts[r]) + n)[None],
                        model.new_kv(64)).logits[0, -n:]
            assert torch.allclose(out[b, :n], ref, atol=1e-5), r
    assert kv.allocate() == 1  # the lowest free row
