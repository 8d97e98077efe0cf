"""A depth-bounded suffix trie over token sequences, with occurrence counts, for suffix decoding.

The trie holds every substring of length <= `max_depth` of its sequences; a node's `count` is how many times its
string occurs (over all sequences). Sequences grow one token at a time (`append`): the writer keeps the nodes of
the sequence's current suffixes (lengths 0 .. max_depth - 1), so a token costs O(max_depth) work whatever the
sequence's length. A finished sequence can be taken out again (`remove`, O(len x max_depth)), for a bounded cache.

Memory: a string that occurs only once never gets nodes below its first unique token. Such a node is a *leaf*
(`children is None`, count 1): it stands for one occurrence, `seq[pos]`, and implies the chain that follows it in
that sequence (`seq[pos + 1]`, `seq[pos + 2]`, ... down to `max_depth`). A second occurrence turns the leaf into an
ordinary node and pushes a leaf one level down. Nodes are therefore made only for the repeated substrings plus one
leaf per occurrence that branches off, not max_depth nodes per token.

Speculation (`speculate`): from the trie positions matching the context's suffixes, grow a draft tree best-first:
a child's probability is its parent's times count(child) / (the counts of all the parent's children, i.e. the
occurrences of the parent's string that have a next token); children below `min_prob` are dropped; the tree stops
at `min(max_nodes, floor(match_len * spec_factor))` tokens. Its score is the sum of its nodes' probabilities (the
expected number of accepted tokens); the best-scoring match length wins, the longer match on a tie.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


class Node:
    __slots__ = ("count", "children", "seq", "pos", "depth")

    def __init__(self, count: int, children: dict | None, seq: list | None, pos: int, depth: int):
        self.count = count
        self.children = children  # token -> Node; None: a leaf (one occurrence, its chain implied by seq)
        self.seq = seq  # leaves: the sequence of their one occurrence
        self.pos = pos  # leaves: the index of this node's token in seq
        self.depth = depth  # length of the node's string


# A trie position: (node, e). e == 0: the node itself; e > 0 (leaves only): e tokens further down its chain.
State = tuple


@dataclass
class Writer:
    """One sequence being appended to a trie: its tokens and the positions of its current suffixes."""

    seq: list[int] = field(default_factory=list)
    active: list = field(default_factory=list)  # active[L]: the position of seq[-L:] (L = 0 .. max_depth - 1)


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]  # DraftTree numbering: 0 is the root (the context's last token), drafted nodes 1..n
    probs: list[float]
    score: float
    match_len: int


class SuffixTrie:
    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError("max_depth must be at least 1")
        self.max_depth = max_depth
        self.root = Node(0, {}, None, -1, 0)

    # -- building --------------------------------------------------------------------------------------------
    def writer(self) -> Writer:
        return Writer(active=[(self.root, 0)])

    def append(self, w: Writer, tokens) -> None:
        """Append `tokens` to the writer's sequence: O(max_depth) per token."""
        D, root = self.max_depth, self.root
        seq = w.seq
        act = w.active
        for t in tokens:
            n = len(seq)
            seq.append(t)
            root.count += 1
            new = [None] * (len(act) + 1)
            new[0] = (root, 0)
            # longest suffix first: when a leaf of an earlier occurrence in this very sequence is split below,
            # that occurrence's own (longer) suffix has already moved on and can be moved into the new leaf
            for L in range(len(act) - 1, -1, -1):
                node, e = act[L]
                kids = node.children
                if kids is None:  # this occurrence's own leaf: its implied chain grows with seq
                    new[L + 1] = (node, e + 1)
                    continue
                c = kids.get(t)
                if c is None:
                    kids[t] = c = Node(1, None, seq, n, L + 1)
                elif c.children is None:  # the leaf of one earlier occurrence: now two, so it becomes a node
                    cs, p = c.seq, c.pos
                    c.children, c.seq, c.count = {}, None, 2
                    if c.depth < D and p + 1 < len(cs):
                        g = c.children[cs[p + 1]] = Node(1, None, cs, p + 1, c.depth + 1)
                        if cs is seq:  # that occurrence may be a current suffix inside c's chain: move it into g
                            lo = n - p + c.depth  # its length, ending at the new token
                            if lo < len(new) and new[lo] is not None and new[lo][0] is c:
                                new[lo] = (g, new[lo][1] - 1)
                else:
                    c.count += 1
                new[L + 1] = (c, 0)
            if len(new) > D:
                new.pop()  # a suffix of length max_depth cannot grow
            act = new
        w.active = act

    def add(self, tokens) -> list[int]:
        """Insert a whole sequence; returns its token list (keep it to `remove` the sequence later)."""
        w = self.writer()
        self.append(w, tokens)
        return w.seq

    def remove(self, seq: list[int]) -> None:
        """Take out a sequence inserted with `add` (the very list it returned)."""
        D = self.max_depth
        root = self.root
        for s in range(len(seq)):
            root.count -= 1
            node = root
            for i in range(s, min(s + D, len(seq))):
                kids = node.children
                if kids is None:  # inside this occurrence's own chain: nothing below is stored
                    break
                tok = seq[i]
                c = kids[tok]
                c.count -= 1
                if c.count == 0:  # only this occurrence went through c (and its subtree)
                    del kids[tok]
                    break
                node = c

    # -- reading ---------------------------------------------------------------------------------------------
    def walk(self, pattern, state: State | None = None) -> State | None:
        """The position of `pattern` (from `state`, default the root), or None when it never occurred."""
        node, e = state if state is not None else (self.root, 0)
        D = self.max_depth
        for t in pattern:
            if node.children is None:
                i = node.pos + e + 1
                if node.depth + e + 1 > D or i >= len(node.seq) or node.seq[i] != t:
                    return None
                e += 1
            else:
                node = node.children.get(t)
                if node is None:
                    return None
        return node, e

    def count(self, pattern) -> int:
        """How many times `pattern` occurs (0 if never, or longer than max_depth)."""
        if len(pattern) > self.max_depth:
            return 0
        st = self.walk(pattern)
        if st is None:
            return 0
        node, e = st
        return 1 if e else node.count

    def children(self, state: State) -> list[tuple[int, float, State]]:
        """(token, count(child) / count of all children, child position) for each continuation of `state`."""
        node, e = state
        if node.children is None:
            i = node.pos + e + 1
            if node.depth + e + 1 <= self.max_depth and i < len(node.seq):
                return [(node.seq[i], 1.0, (node, e + 1))]
            return []
        kids = node.children
        if not kids:
            return []
        total = 0
        for c in kids.values():
            total += c.count
        return [(t, c.count / total, (c, 0)) for t, c in kids.items()]

    def num_nodes(self) -> int:
        """Stored nodes (the root included)."""
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            if node.children:
                stack.extend(node.children.values())
        return n

    def matches(self, context) -> list[tuple[int, State]]:
        """(m, position of context[-m:]) for m = 1, 2, ... while the suffix occurs (m < max_depth)."""
        out = []
        top = min(len(context), self.max_depth - 1)
        for m in range(1, top + 1):
            st = self.walk(context[len(context) - m:])
            if st is None:
                break
            out.append((m, st))
        return out

    # -- speculation -----------------------------------------------------------------------------------------
    def expand(self, state: State, max_tokens: int, max_depth: int, min_prob: float) -> Draft:
        """Best-first draft tree below `state`: at most `max_tokens` nodes, `max_depth` deep, each node's path
        probability >= min_prob."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        score = 0.0
        if max_tokens <= 0 or max_depth <= 0:
            return Draft(tokens, parents, probs, score, 0)
        heap: list = []
        tie = 0
        for tok, r, st in self.children(state):
            if r >= min_prob:
                heap.append((-r, tie, tok, st, 0, 1))
                tie += 1
        heapq.heapify(heap)
        while heap and len(tokens) < max_tokens:
            neg, _, tok, st, parent, depth = heapq.heappop(heap)
            p = -neg
            tokens.append(tok)
            parents.append(parent)
            probs.append(p)
            score += p
            if depth < max_depth:
                me = len(tokens)  # DraftTree index of the node just taken
                for ctok, r, cst in self.children(st):
                    q = p * r
                    if q >= min_prob:
                        heapq.heappush(heap, (-q, tie, ctok, cst, me, depth + 1))
                        tie += 1
        return Draft(tokens, parents, probs, score, 0)


def speculate(trie: SuffixTrie, matches: list[tuple[int, State]], max_nodes: int, max_depth: int,
              spec_factor: float, min_prob: float, best: Draft | None = None) -> Draft | None:
    """The best draft over the match lengths in `matches` ((m, position) pairs): per match length m at most
    min(max_nodes, floor(m * spec_factor)) tokens. Returns `best` unless some draft scores strictly higher;
    among equal scores the longer match wins. A draft's score never exceeds its token count, so shorter
    matches are not tried once their cap cannot beat the best score."""
    for m, st in sorted(matches, key=lambda x: -x[0]):
        cap = min(max_nodes, int(m * spec_factor + 1e-6))
        if cap <= 0 or (best is not None and best.score >= cap):
            break  # caps only shrink with m
        d = trie.expand(st, cap, max_depth, min_prob)
        if d.tokens and (best is None or d.score > best.score):
            d.match_len = m
            best = d
    return best
