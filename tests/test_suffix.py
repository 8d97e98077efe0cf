"""Suffix decoding (`{"method": "suffix"}`): the suffix trie against brute-force substring counts (incremental
appends, self-overlapping sequences, removal), its speculation (probabilities, min prob, spec factor, longest
match, node and depth caps), the drafter (request trie kept in step with the sequence, tree drafts, the global
cache of finished responses with its bound), bad keys, and end to end on tiny fp32 targets: greedy output
identical to plain greedy (self-matching prompts with drafts accepted, no match, branching trees), the sampling
distribution unchanged, the serving scheduler filling the cache so a repeated request drafts from its earlier
answer, and the HTTP server."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specloom import Engine, SpecloomError
from specloom.drafters import DRAFTERS, KINDS, DraftContext
from specloom.drafters.suffix.drafter import SuffixDrafter
from specloom.drafters.suffix.trie import SuffixTrie, speculate
from specloom.sampling import SamplingParams
from specloom.scheduler import BatchScheduler, Sequence
from specloom.speculative import SpeculativeConfig

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repetitive: the request's own trie matches
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],  # nothing repeats in the prompt
    [9, 200, 9, 200, 9, 200, 17],
]
N_TOKENS = 37


_PLAIN: dict = {}


def plain(t, ids, n=N_TOKENS):
    """Plain greedy decoding (cached: the tiny targets are session-wide and never change)."""
    key = (t.family, tuple(ids), n)
    if key not in _PLAIN:
        _PLAIN[key] = Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=n, ignore_eos=True)
    return _PLAIN[key]


def suffix_engine(t, **keys) -> Engine:
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "suffix", **keys}), max_model_len=256)


# -- the trie --------------------------------------------------------------------------------------------------

def _brute(seqs, depth) -> Counter:
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i:i + n])] += 1
    return c


def _check_counts(trie: SuffixTrie, seqs, alphabet, rng):
    want = _brute(seqs, trie.max_depth)
    for sub, n in want.items():
        assert trie.count(list(sub)) == n, (sub, n)
        if len(sub) < trie.max_depth:  # continuation probabilities = counts of the next token / all next tokens
            nxt = {t: want[sub + (t,)] for t in alphabet if want.get(sub + (t,))}
            got = {t: r for t, r, _ in trie.children(trie.walk(list(sub)))}
            total = sum(nxt.values())
            assert got.keys() == nxt.keys() and all(abs(got[t] - nxt[t] / total) < 1e-12 for t in nxt), sub
    for _ in range(50):  # absent strings count 0
        sub = tuple(rng.choice(alphabet) for _ in range(rng.randrange(1, trie.max_depth + 1)))
        assert trie.count(list(sub)) == want.get(sub, 0)


def test_trie_counts_match_brute_force():
    """Random sequences over 1-3 symbols (so long self-overlapping repeats: aaaa, abab), appended in chunks of
    1-4 tokens; after every chunk every substring's count and every continuation probability is right, and each
    writer's current suffixes are exactly the positions a walk from the root finds."""
    rng = random.Random(0)
    for _ in range(120):
        depth = rng.randrange(1, 7)
        alphabet = list(range(rng.randrange(1, 4)))
        trie = SuffixTrie(depth)
        done = []
        for _ in range(rng.randrange(1, 4)):
            w = trie.writer()
            toks = [rng.choice(alphabet) for _ in range(rng.randrange(0, 30))]
            i = 0
            while i < len(toks):
                j = min(len(toks), i + rng.randrange(1, 5))
                trie.append(w, toks[i:j])
                i = j
                _check_counts(trie, done + [w.seq], alphabet, rng)
                s = w.seq
                assert len(w.active) == min(depth, len(s) + 1)
                assert all(trie.walk(s[len(s) - m:]) == w.active[m] for m in range(len(w.active)))
            done.append(w.seq)


def test_trie_remove_restores_counts():
    rng = random.Random(1)
    for _ in range(60):
        depth, alphabet = rng.randrange(1, 7), list(range(rng.randrange(1, 4)))
        trie, held = SuffixTrie(depth), []
        for _ in range(7):
            held.append(trie.add([rng.choice(alphabet) for _ in range(rng.randrange(1, 25))]))
            if len(held) > 3:
                trie.remove(held.pop(rng.randrange(len(held))))
            _check_counts(trie, held, alphabet, rng)
        for s in held:
            trie.remove(s)
        assert trie.num_nodes() == 1 and not trie.root.children


def test_trie_stores_unique_text_once():
    """A token that branches off into text seen only once costs one leaf, not max_depth nodes; a repeated
    block costs about max_depth nodes per distinct token, however often it repeats."""
    rng = random.Random(2)
    toks = [rng.randrange(5000) for _ in range(3000)]
    t = SuffixTrie(24)
    t.add(toks)
    assert t.num_nodes() < 2 * len(toks)  # a plain depth-24 trie: about 24 per token
    t = SuffixTrie(24)
    t.add(toks[:300] * 8)
    assert t.num_nodes() < 24 * 300 * 1.2


def test_expand_probabilities_min_prob_and_caps():
    # "1 2" is followed by 3 twice and by 4 once (its last occurrence, the current one, has no next token yet)
    seq = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    trie = SuffixTrie(8)
    trie.add(seq)
    st = trie.walk([1, 2])
    assert trie.count([1, 2]) == 4
    d = trie.expand(st, max_tokens=10, max_depth=2, min_prob=0.0)
    # best first: 3 (2/3), 9 after it (2/3 * 1), then 4 (1/3), 9 after it (1/3)
    assert d.tokens == [3, 9, 4, 9] and d.parents == [0, 1, 0, 3]
    assert d.probs == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3]) and d.score == pytest.approx(2.0)
    d = trie.expand(st, max_tokens=10, max_depth=3, min_prob=0.0)  # deeper: 3 9 1 (2/3) before the 4 branch
    assert d.tokens[:3] == [3, 9, 1] and d.parents[:3] == [0, 1, 2]
    assert trie.expand(st, 10, 2, min_prob=0.5).tokens == [3, 9]  # the 1/3 branch is dropped
    assert trie.expand(st, 3, 2, min_prob=0.0).tokens == [3, 9, 4]  # node cap
    assert trie.expand(st, 10, 1, min_prob=0.0).tokens == [3, 4]  # depth cap
    # products along the path: after "2" comes 3 (2/4... of the continuations of "2": 3, 3, 4 -> 2/3 and 1/3)
    d = trie.expand(trie.walk([2]), 10, 3, 0.0)
    assert d.tokens[0] == 3 and d.probs[0] == pytest.approx(2 / 3)


def test_speculate_spec_factor_and_longest_match():
    trie = SuffixTrie(16)
    trie.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    ctx = [0, 3, 4, 5]  # suffixes "5", "4 5", "3 4 5" match; "0 3 4 5" does not
    matches = trie.matches(ctx)
    assert [m for m, _ in matches] == [1, 2, 3]
    d = speculate(trie, matches, max_nodes=10, max_depth=10, spec_factor=1.0, min_prob=0.1)
    assert d.match_len == 3 and d.tokens == [6, 7, 8]  # at most factor x match length tokens
    d = speculate(trie, matches, 10, 10, spec_factor=2.5, min_prob=0.1)
    assert d.tokens == [6, 7, 8, 9, 10]  # floor(3 * 2.5) = 7, but the text ends after 10
    assert speculate(trie, matches, 2, 10, 2.5, 0.1).tokens == [6, 7]  # node cap
    assert speculate(trie, matches, 10, 10, 0.0, 0.1) is None  # factor 0: no speculation
    assert speculate(trie, trie.matches([11, 12]), 10, 10, 1.0, 0.1) is None  # no match
    # the depth bounds match + draft: a depth-5 trie holds "3 4 5 6 7", so from the 3-token match only 2 follow
    small = SuffixTrie(5)
    small.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    d = speculate(small, small.matches(ctx), 10, 10, 1.5, 0.1)
    assert d.tokens == [6, 7, 8] and d.match_len == 2  # "4 5" + 3 (cap 3) beats "3 4 5" + 2 (cap 4)
    d = speculate(small, small.matches(ctx), 10, 10, 4.0, 0.1)
    assert d.tokens == [6, 7, 8, 9] and d.match_len == 1  # the best score wins, whatever the match length


# -- the drafter -----------------------------------------------------------------------------------------------

def _ctx(tokens, k=8, state=None, max_nodes=None, prompt=None):
    return DraftContext(list(tokens), prompt if prompt is not None else len(tokens), SamplingParams(), None, k,
                        max_nodes=max_nodes, state=state)


def test_registered_with_its_keys():
    assert DRAFTERS["suffix"] is SuffixDrafter and set(KINDS["suffix"].keys) == {
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob"}
    spec = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 12,
                                    "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2,
                                    "suffix_decoding_min_token_prob": 0.25, "num_speculative_tokens": 5})
    d = SuffixDrafter.create(spec, None, None)
    assert (d.k, d.max_tree_depth, d.max_cached_requests, d.max_spec_factor, d.min_token_prob) == (5, 12, 0, 2.0, 0.25)
    d = SuffixDrafter.create(SpeculativeConfig.parse({"method": "suffix"}), None, None)
    assert (d.k, d.max_tree_depth, d.max_cached_requests, d.max_spec_factor, d.min_token_prob) == (
        8, 24, 10000, 1.0, 0.1)
    assert d.num_speculative_tokens == d.num_nodes == 8


def test_drafter_self_match_branches_and_no_match():
    d = SuffixDrafter(k=8, max_spec_factor=4.0, min_token_prob=0.1)
    # "10 11 12" came after different tokens and was followed by 20 twice and by 21 once: the longest match
    # ("10 11 12") branches into 20 (2/3) and 21 (1/3)
    toks = [1, 10, 11, 12, 20, 2, 10, 11, 12, 21, 3, 10, 11, 12, 20, 4, 10, 11, 12]
    tree = d.propose_one(_ctx(toks))
    assert tree.tokens[0] == 12 and not tree.is_chain
    assert {tree.tokens[c] for c in tree.children(0)} == {20, 21}
    assert tree.tokens[1] == 20  # the likelier branch first
    assert len(tree) == 9  # 8 nodes: min(k, 4 x 3)
    # no match: nothing repeats
    assert len(d.propose_one(_ctx([1, 2, 3, 4, 5]))) == 1
    # k = 0, a depth cap, a node cap
    assert len(d.propose_one(_ctx(toks, k=0))) == 1
    assert d.propose_one(_ctx(toks, k=1)).max_depth == 1
    assert len(d.propose_one(_ctx(toks, max_nodes=2))) == 3
    # a repetitive sequence: one certain continuation, a chain of factor x match length
    chain = SuffixDrafter(k=8).propose_one(_ctx([5, 6, 7, 8, 5, 6, 7]))
    assert chain.is_chain and chain.tokens[1:] == [8, 5, 6]  # match "5 6 7" (3 tokens x factor 1)


def test_request_trie_follows_the_sequence_incrementally(monkeypatch):
    """Each propose inserts only the tokens added since the last one (O(depth) per new token); a state handed
    another sequence starts over."""
    appended = []
    orig = SuffixTrie.append

    def spy(self, w, tokens):
        appended.append(len(tokens))
        return orig(self, w, tokens)

    monkeypatch.setattr(SuffixTrie, "append", spy)
    d = SuffixDrafter()
    seq = [5, 6, 7, 8] * 5
    ctx = _ctx(seq[:6], state=d.new_state())
    for n in range(6, len(seq) + 1):
        ctx.tokens[:] = seq[:n]
        a = d.propose_one(ctx)
        b = SuffixDrafter().propose_one(_ctx(seq[:n]))  # from scratch
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert sum(appended[::2]) == len(seq)  # the incremental drafter's calls (every other one)
    assert ctx.state.writer.seq == seq
    ctx.tokens[:] = [1, 2, 3]  # another sequence in the same state
    d.propose_one(ctx)
    assert ctx.state.writer.seq == [1, 2, 3]


def test_global_cache_reuse_and_bound():
    d = SuffixDrafter(k=8, max_cached_requests=2)
    a, b, c = [100, 101, 102, 103, 104, 105], [110, 111, 112, 113], [120, 121, 122, 123]
    d.on_finished(_ctx([1, 2] + a, prompt=2))  # the prompt (1, 2) is not cached, the response is
    assert d.num_cached_requests == 1
    assert d.propose_one(_ctx([7, 100, 101, 102])).tokens[1:] == [103, 104, 105]  # drafted from the cache
    assert len(d.propose_one(_ctx([7, 1, 2]))) == 1
    d.add_response(b)
    d.add_response(c)  # over the bound: the oldest (a) goes
    assert d.num_cached_requests == 2
    assert len(d.propose_one(_ctx([7, 100, 101, 102]))) == 1
    assert d.propose_one(_ctx([7, 110, 111])).tokens[1:] == [112, 113]
    assert d.propose_one(_ctx([7, 120, 121])).tokens[1:] == [122, 123]
    assert d._global.count([100]) == 0 and d._global.count([110, 111]) == 1
    d.clear_cache()
    assert d.num_cached_requests == 0 and len(d.propose_one(_ctx([7, 120, 121]))) == 1
    off = SuffixDrafter(max_cached_requests=0)
    off.add_response(a)
    assert off.num_cached_requests == 0 and len(off.propose_one(_ctx([7, 100, 101, 102]))) == 1


def test_request_trie_and_global_trie_the_better_wins():
    d = SuffixDrafter(k=8, max_spec_factor=8.0)
    d.add_response([50, 51, 60, 61, 62, 63, 64])
    # the request itself saw "50 51" -> 52 once; the cache saw "50 51 60 ... 64": longer and as sure -> cache wins
    got = d.propose_one(_ctx([50, 51, 52, 9, 50, 51]))
    assert got.tokens[1:] == [60, 61, 62, 63, 64]
    d2 = SuffixDrafter(k=8, max_spec_factor=8.0)
    d2.add_response([50, 51, 60])  # a shorter cached continuation scores lower than the request's own
    assert d2.propose_one(_ctx([50, 51, 52, 53, 54, 9, 50, 51])).tokens[1:] == [52, 53, 54, 9, 50, 51]


@pytest.mark.parametrize("spec, needle", [
    ({"suffix_decoding_max_tree_depth": 0}, r"suffix_decoding_max_tree_depth must be an integer in \[1, 256\]"),
    ({"suffix_decoding_max_tree_depth": 300}, "suffix_decoding_max_tree_depth must be"),
    ({"suffix_decoding_max_tree_depth": "24"}, "suffix_decoding_max_tree_depth must be"),
    ({"suffix_decoding_max_cached_requests": -1}, r"suffix_decoding_max_cached_requests must be an integer in \[0,"),
    ({"suffix_decoding_max_spec_factor": 65}, r"suffix_decoding_max_spec_factor must be a number in \[0, 64\]"),
    ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob must be a number in \[0, 1\]"),
    ({"suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob must be"),
    ({"prompt_lookup_max": 3}, "'suffix' does not take 'prompt_lookup_max'"),
    ({"suffix_decoding_max_depth": 3}, "unknown --speculative-config keys"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_bad_keys(spec, needle):
    with pytest.raises(SpecloomError, match=needle):
        SpeculativeConfig.parse({"method": "suffix", **spec})


def test_suffix_keys_refused_for_other_methods():
    with pytest.raises(SpecloomError, match="'ngram' does not take 'suffix_decoding_min_token_prob'"):
        SpeculativeConfig.parse({"method": "ngram", "suffix_decoding_min_token_prob": 0.2})


# -- end to end ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identical(tiny, family, k):
    t = tiny(family)
    e = suffix_engine(t, num_speculative_tokens=k)
    accepted = 0
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
        assert r.token_ids == plain(t, ids).token_ids
        accepted += r.num_accepted_tokens
    assert accepted > 0  # the greedy continuations repeat themselves: the request's own trie drafts them


def test_self_match_accepted_and_no_match(tiny):
    """Self-match: the random gemma3 target falls into a loop on PROMPTS[1] (one token over and over): the
    request's own trie drafts it and nearly every draft is accepted. No match: the llama target's first tokens on
    PROMPTS[1] are all new, so nothing is drafted and every token takes its own pass."""
    t = tiny("gemma3")
    r = suffix_engine(t, num_speculative_tokens=8).generate(prompt_token_ids=PROMPTS[1], max_tokens=N_TOKENS,
                                                            ignore_eos=True)
    assert r.token_ids == plain(t, PROMPTS[1]).token_ids
    assert r.num_accepted_tokens >= 15 and r.num_accepted_tokens >= 0.8 * r.num_draft_tokens
    assert r.mean_accepted_length > 2.0
    t = tiny("llama")
    ref = plain(t, PROMPTS[1], 5).token_ids
    assert len(set(ref) | set(PROMPTS[1])) == len(ref) + len(PROMPTS[1])  # nothing repeats
    r = suffix_engine(t).generate(prompt_token_ids=PROMPTS[1], max_tokens=5, ignore_eos=True)
    assert r.token_ids == ref and r.num_draft_tokens == 0 and r.num_target_passes == 5


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_identical_with_branching_trees(tiny, monkeypatch, family):
    """A cache holding the true answer once and, twice, a short answer that leaves it at its third token: the
    first draft is a tree whose right branch is the second sibling (1/3 against 2/3), so the accepted path is
    not the first child; verified exactly, and the right branch accepted."""
    t = tiny(family)
    trees = []
    orig = SuffixDrafter.propose_one

    def spy(self, ctx):
        tree = orig(self, ctx)
        trees.append(tree)
        return tree

    monkeypatch.setattr(SuffixDrafter, "propose_one", spy)
    e = suffix_engine(t, num_speculative_tokens=6, suffix_decoding_max_spec_factor=3.0)
    ids = PROMPTS[1]
    truth = plain(t, ids, 24).token_ids
    e.drafter.add_response(truth)
    for _ in range(2):
        e.drafter.add_response(truth[:2] + [(truth[2] + 1) % 256])
    r = e.generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
    assert r.token_ids == truth
    first = trees[0]  # context ends with truth[0]: drafts truth[1], then wrong (2/3) and right (1/3) siblings
    assert first.tokens[1:] == [truth[1], (truth[2] + 1) % 256, truth[2]] and first.parents == [-1, 0, 1, 1]
    assert r.num_accepted_tokens >= 12


def test_sampling_distribution(tiny, sampling_tv):
    """Sampling stays the target's own with one-hot tree drafts: a cache of earlier sampled answers (so almost
    every step drafts, min prob 0 so siblings are tried in order after rejections) and a generous spec factor."""
    t = tiny("llama")
    ids = PROMPTS[0]
    e = suffix_engine(t, num_speculative_tokens=4, suffix_decoding_max_spec_factor=4.0,
                      suffix_decoding_min_token_prob=0.0)
    p = Engine(t.model, t.tokenizer)
    for s in range(40):
        e.drafter.add_response(p.generate(prompt_token_ids=ids, max_tokens=6, temperature=1.0, top_k=2,
                                          seed=50_000 + s, ignore_eos=True).token_ids)
    tv = sampling_tv(e, p, ids)
    assert tv < 0.12, tv


def test_serving_fills_the_cache_and_a_repeat_drafts_from_it(tiny):
    """Through the continuous-batching scheduler: several prompts at once give exactly what each gives alone;
    every finished request lands in the global cache (the oldest dropped beyond the bound); the same prompt
    again then drafts its earlier answer, all of it accepted."""
    t = tiny("llama")
    e = suffix_engine(t, num_speculative_tokens=8, suffix_decoding_max_cached_requests=3)
    prompts = [[60 + i, 70 + i, 80 + i, 90 + i] for i in range(4)]
    want = [plain(t, p, 24).token_ids for p in prompts]
    sch = BatchScheduler(e, rows=2, mode="fixed")
    try:
        seqs = [Sequence(p, 24, SamplingParams(), ignore_eos=True) for p in prompts]
        sch.submit(seqs)
        assert [s.wait(120).token_ids for s in seqs] == want
        assert e.drafter.num_cached_requests == 3  # 4 finished, bound 3
        first = Sequence(prompts[0], 24, SamplingParams(), ignore_eos=True)  # its answer was dropped (oldest)...
        sch.submit([first])
        r0 = first.wait(120)
        again = Sequence(prompts[0], 24, SamplingParams(), ignore_eos=True)  # ...and is cached again now
        sch.submit([again])
        r = again.wait(120)
    finally:
        sch.close()
    assert r0.token_ids == r.token_ids == want[0]
    assert r.num_accepted_tokens == r.num_draft_tokens > 0 and r.mean_accepted_length > 2.0
    assert r.num_target_passes < r0.num_target_passes


def test_server_with_suffix(tiny):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server

    t = tiny("llama")
    e = suffix_engine(t)
    live = LiveServer(Server(e, "tiny", max_num_seqs=2, speculation="fixed"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key="x", max_retries=0)
        ids = PROMPTS[2]
        want = t.tokenizer.decode(plain(t, ids, 16).token_ids)
        for _ in range(2):
            r = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0)
            assert r.choices[0].text == want
        assert e.drafter.num_cached_requests == 2
    finally:
        live.close()
