"""Exact end-to-end speculative decoding on tiny random fp32 targets: for every drafter kind, greedy output is
token-for-token identical to plain greedy decoding — including the self-draft (everything accepted, tau = k+1)
and a drafter whose every guess is wrong (nothing accepted, tau = 1) — plus a branching-tree drafter that
exercises the ancestor mask and the commit of a non-contiguous path."""

import pytest

from specloom import Engine, SpecloomError
from specloom.drafters import DRAFTERS, Drafter
from specloom.speculative import SpeculativeConfig
from specloom.tree import DraftTree

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repetitive: n-gram lookup finds matches
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
    [9, 200, 9, 200, 9, 200, 17],
]
N_TOKENS = 37  # = 1 + 18 * 2 = 1 + 9 * 4 = 1 + 4 * 9: only full steps for k = 1, 3, 8


def plain(t, ids, n=N_TOKENS):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=n, ignore_eos=True)


def spec_engine(t, spec: dict) -> Engine:
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse(spec))


class _Scripted(Drafter):
    """Test drafter that knows the plain greedy continuation and proposes right or wrong guesses from it."""

    truth: dict = {}
    wrong = False
    tree = False

    def __init__(self, k):
        self.k = k

    @classmethod
    def create(cls, spec, target, tokenizer):
        return cls(spec.num_speculative_tokens)

    @property
    def num_speculative_tokens(self):
        return self.k

    def propose_one(self, ctx):
        seq = self.truth[ctx.num_prompt_tokens]  # prompt + greedy continuation
        n = len(ctx.tokens)
        right = seq[n:n + ctx.k]
        vocab = 256
        if self.wrong:
            return DraftTree.chain(ctx.tokens[-1], [(x + 1) % vocab for x in right])
        if not self.tree:
            return DraftTree.chain(ctx.tokens[-1], right)
        # root -> [wrong, right]; right -> [right2, wrong2]; right2 -> chain of the rest
        toks, parents = [ctx.tokens[-1]], [-1]
        prev = 0
        for i, tok in enumerate(right):
            toks.append((tok + 3) % vocab)
            parents.append(prev)
            toks.append(tok)
            parents.append(prev)
            prev = len(toks) - 1
        return DraftTree(toks, parents)


@pytest.fixture()
def scripted():
    DRAFTERS["_scripted"] = _Scripted
    yield _Scripted
    del DRAFTERS["_scripted"]
    _Scripted.truth, _Scripted.wrong, _Scripted.tree = {}, False, False


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_identical(tiny, family, k):
    t = tiny(family)
    e = spec_engine(t, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
        assert r.token_ids == plain(t, ids).token_ids


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_self_draft_all_accepted(tiny, family, k):
    """The target drafting for itself: every draft accepted, tau = k + 1 exactly."""
    t = tiny(family)
    e = spec_engine(t, {"method": "draft_model", "model": t.path, "num_speculative_tokens": k})
    assert e.drafter.model is t.model  # weights shared, own KV cache
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
        assert r.token_ids == plain(t, ids).token_ids
        assert r.mean_accepted_length == k + 1
        assert r.num_accepted_tokens == r.num_draft_tokens == (N_TOKENS - 1) // (k + 1) * k
        assert r.acceptance_per_position == [1.0] * k


@pytest.mark.parametrize("k", [1, 3, 8])
def test_other_random_draft_model_identical(tiny, k):
    """A draft model with other random weights (same vocabulary): some guesses accepted, output unchanged."""
    t, other = tiny("llama"), tiny("qwen3")
    e = spec_engine(t, {"method": "draft_model", "model": other.path, "num_speculative_tokens": k})
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
        assert r.token_ids == plain(t, ids).token_ids
        assert 1.0 <= r.mean_accepted_length < k + 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_wrong_drafts_nothing_accepted(tiny, scripted, family, k):
    t = tiny(family)
    for ids in PROMPTS:
        ref = plain(t, ids)
        scripted.truth[len(ids)] = ids + ref.token_ids
    scripted.wrong = True
    e = spec_engine(t, {"method": "_scripted", "num_speculative_tokens": k})
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
        assert r.token_ids == scripted.truth[len(ids)][len(ids):]
        assert r.num_accepted_tokens == 0 and r.mean_accepted_length == 1.0
        assert r.num_target_passes == N_TOKENS


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [2, 5])
def test_branching_tree_commits_the_right_path(tiny, scripted, family, k):
    """Each right guess sits second among two siblings: the accepted path is non-contiguous in the tree, so
    the ancestor mask and the KV gather of `commit(path)` must both be right for the output to match."""
    t = tiny(family)
    for ids in PROMPTS:
        scripted.truth[len(ids)] = ids + plain(t, ids).token_ids
    scripted.tree = True
    e = spec_engine(t, {"method": "_scripted", "num_speculative_tokens": k})
    for ids in PROMPTS:
        r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
        assert r.token_ids == scripted.truth[len(ids)][len(ids):]
        assert r.num_accepted_tokens > 0


def test_sampling_seeded_reproducible(tiny):
    t = tiny("llama")
    e = spec_engine(t, {"method": "draft_model", "model": tiny("qwen3").path, "num_speculative_tokens": 3})
    a = e.generate(prompt_token_ids=PROMPTS[0], max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    b = e.generate(prompt_token_ids=PROMPTS[0], max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_stop_inside_a_multi_token_step(tiny):
    """EOS accepted in the middle of a drafted chain ends the output exactly where plain decoding ends it."""
    t = tiny("llama")
    free = plain(t, PROMPTS[1])
    eos = free.token_ids[6]
    t.tokenizer.eos_token_ids = frozenset({eos})
    try:
        ref = Engine(t.model, t.tokenizer).generate(prompt_token_ids=PROMPTS[1], max_tokens=N_TOKENS)
        e = spec_engine(t, {"method": "draft_model", "model": t.path, "num_speculative_tokens": 4})
        r = e.generate(prompt_token_ids=PROMPTS[1], max_tokens=N_TOKENS)
    finally:
        t.tokenizer.eos_token_ids = frozenset({1})
    assert r.token_ids == ref.token_ids and r.token_ids[-1] == eos and r.finish_reason == "stop"


def test_draft_model_with_other_vocabulary_refused(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import save_tiny_tokenizer

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    save_tiny_tokenizer(str(tmp_path))
    t = tiny("llama")
    with pytest.raises(SpecloomError, match="vocabulary of 300 tokens"):
        spec_engine(t, {"method": "draft_model", "model": str(tmp_path)})


@pytest.mark.parametrize("spec, needle", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 1000}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "needs \"model\""),
    ({"method": "nonsense"}, "unknown speculative method"),
    ({"method": "draft_model", "model": "x", "tree_width": 0}, "tree_width"),
])
def test_bad_settings(tiny, spec, needle):
    t = tiny("llama")
    with pytest.raises(SpecloomError, match=needle):
        spec_engine(t, spec)


def test_speculation_up_to_the_end_of_the_context(tiny):
    """A request that fills the context exactly still has room for the draft tree's KV slots."""
    t = tiny("llama")
    ids = PROMPTS[0]
    n = t.model.config.max_position - len(ids)
    ref = Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=n, ignore_eos=True)
    e = spec_engine(t, {"method": "draft_model", "model": t.path, "num_speculative_tokens": 8})
    r = e.generate(prompt_token_ids=ids, max_tokens=n, ignore_eos=True)
    assert r.token_ids == ref.token_ids and len(r.token_ids) == n


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_model_tree(tiny, family, k):
    """draft_model with tree_width 3: output unchanged for the self-draft and for another random model. The
    self-draft's depth-1 candidates include the target's argmax, so position 1 is always accepted (deeper, the
    beam keeps the best cumulative log-probabilities and may drop the argmax path)."""
    t = tiny(family)
    other = tiny("qwen3" if family == "llama" else "llama")
    for model, all_accepted in ((t.path, True), (other.path, False)):
        e = spec_engine(t, {"method": "draft_model", "model": model, "num_speculative_tokens": k, "tree_width": 3})
        for ids in PROMPTS:
            r = e.generate(prompt_token_ids=ids, max_tokens=N_TOKENS, ignore_eos=True)
            assert r.token_ids == plain(t, ids).token_ids
            if all_accepted:
                assert r.acceptance_per_position[0] == 1.0
                assert r.num_draft_tokens % 3 == 0  # 3 nodes per depth


def test_draft_model_tree_sampling_reproducible(tiny):
    t = tiny("llama")
    e = spec_engine(t, {"method": "draft_model", "model": tiny("qwen3").path, "num_speculative_tokens": 3,
                        "tree_width": 2})
    a = e.generate(prompt_token_ids=PROMPTS[0], max_tokens=20, temperature=0.9, seed=3)
    b = e.generate(prompt_token_ids=PROMPTS[0], max_tokens=20, temperature=0.9, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_draft_model_with_other_token_ids_refused(tiny, tmp_path):
    """Same vocabulary size, different tokens behind the ids: refused after loading, with the reason."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = tiny("llama")
    shutil.copytree(tiny("qwen3").path, tmp_path / "other")
    for f in (tmp_path / "other").glob("*token*"):
        f.unlink()
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"x{i}": i for i in range(4, 256)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        tmp_path / "other")
    with pytest.raises(SpecloomError, match="another tokenizer"):
        spec_engine(t, {"method": "draft_model", "model": str(tmp_path / "other")})
