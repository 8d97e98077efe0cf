"""Grammar-constrained generation (specloom/serving/grammar.py, tools.py): forced tool calls and structured
output on the real SmolLM2-135M, and exactness under speculation -- constrained greedy output with any drafter
(n-gram, the bundled EAGLE-3 tree, drafters of garbage and of tokens the target likes but the grammar forbids)
equals constrained plain greedy token for token; constrained sampling keeps its distribution; prune / mask on a
hand-built tree equal fresh matchers advanced along each path, and the grammar state never moves over drafts.

The tiny random targets get a small byte-level tokenizer of their own (113 tokens for a 256-wide vocabulary,
so ids 113..255 must always be masked): llguidance needs byte-level token texts, which the shared word-level
test tokenizer does not have."""

from __future__ import annotations

import json
import random
from collections import Counter

import jsonschema
import pytest
import torch

from specloom import Engine
from specloom.drafters import DRAFTERS, Drafter
from specloom.serving.grammar import GrammarError, GrammarSpec, compile_constraint
from specloom.serving.parsers import HermesToolParser, Llama3JsonToolParser
from specloom.serving.tools import ToolRequestError, plan_request
from specloom.speculative import SpeculativeConfig
from specloom.tokenizer import Tokenizer
from specloom.tree import DraftTree

# -- a byte-level tokenizer for the tiny models ---------------------------------------------------------------

SP = "\u0120"  # the byte-level alphabet's space


def byte_level_tokenizer(chat_template: str | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as Core
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    for c in range(33, 127):
        vocab[chr(c)] = len(vocab)
    vocab[SP] = len(vocab)
    merges = [("{", '"'), ('"', ":"), (":", SP), ('"', ","), (",", SP), (SP, '"'), ('"', "}"), ("t", "r"),
              ("tr", "u"), ("tru", "e"), ("1", "0")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    core = Core(models.BPE(vocab, merges, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
                                 unk_token="<unk>")
    if chat_template:
        hf.chat_template = chat_template
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def btok() -> Tokenizer:
    return byte_level_tokenizer()


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.hf(text, add_special_tokens=False)["input_ids"])


TINY_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["ab", "cd", "e"]},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["ok", "n", "tag", "xs"],
    "additionalProperties": False,
}
TINY_SPEC = GrammarSpec.json_schema(TINY_SCHEMA)
TINY_PROMPTS = ['{"ok": true, "n": 10}', 'xyz xyz xyz', '[[[']
V = 256  # the tiny models' logits width


def fresh(spec: GrammarSpec, tok: Tokenizer, prefix: list[int]):
    c = compile_constraint(spec, tok, V)
    c.advance(prefix)
    return c


def forbidden_row(c) -> torch.Tensor:
    row = torch.zeros(V)
    c.mask_row(row)
    return torch.isinf(row)


def grammatical(spec, tok, path: list[int]) -> bool:
    if any(t >= len(tok.hf) for t in path):
        return False
    try:
        fresh(spec, tok, path)
    except GrammarError:
        return False
    return True


# -- prune / mask on hand-built trees -------------------------------------------------------------------------

def node_path(tree: DraftTree, i: int) -> list[int]:
    out = []
    while i > 0:
        out.append(tree.tokens[i])
        i = tree.parents[i]
    return out[::-1]


def test_prune_and_mask_equal_fresh_matchers(btok):
    prefix = ids_of(btok, '{"ok": ')
    c = fresh(TINY_SPEC, btok, prefix)
    before = forbidden_row(c)
    t = {s: ids_of(btok, s)[0] for s in ["t", "f", "x", "tru", "e", "r", "u", "1", ",", "a", ", "]}
    # root -> t, x(bad), tru, 1(bad), 200 (beyond the tokenizer), f;  t -> r, x(bad);  tru -> e, u(bad);
    # e -> ", " -> x(bad) ;  f -> a
    tokens = [prefix[-1], t["t"], t["x"], t["tru"], t["1"], 200, t["f"], t["r"], t["x"], t["e"], t["u"], t[", "],
              t["x"], t["a"], t["e"]]
    parents = [-1, 0, 0, 0, 0, 0, 0, 1, 1, 3, 3, 9, 11, 6, 8]  # node 14 hangs under a rejected node
    v = len(tokens)
    probs = torch.rand(v, V)
    tree = DraftTree(tokens, parents, probs)
    alive = [i == 0 or grammatical(TINY_SPEC, btok, prefix + node_path(tree, i)) for i in range(v)]
    # a node is kept exactly when its whole path is grammatical (which implies its parent's)
    assert alive == [True, True, False, True, False, False, True, True, False, True, False, True, False, True,
                     False]
    pruned = c.prune(tree)
    keep = [i for i in range(v) if alive[i]]
    assert pruned.tokens == [tokens[i] for i in keep]
    assert [node_path(pruned, j) for j in range(len(pruned))] == [node_path(tree, i) for i in keep]
    assert torch.equal(pruned.draft_probs, probs[keep])
    assert torch.equal(forbidden_row(c), before)  # prune left the state alone

    logits = torch.randn(len(pruned), V)
    ref = logits.clone()
    c.mask(pruned, logits)
    for j in range(len(pruned)):
        want = forbidden_row(fresh(TINY_SPEC, btok, prefix + node_path(pruned, j)))
        assert torch.equal(torch.isinf(logits[j]), want), j
        assert torch.equal(logits[j][~want], ref[j][~want])  # allowed logits untouched
        assert want[len(btok.hf):].all()  # ids beyond the tokenizer: always forbidden
    # masking the unpruned tree gives the same rows for the live nodes
    full = torch.randn(v, V)
    c.mask(tree, full)
    for j, i in enumerate(keep):
        assert torch.equal(torch.isinf(full[i]), torch.isinf(logits[j]))
    assert torch.equal(forbidden_row(c), before)
    assert c.prune(pruned) is pruned  # nothing left to drop


def test_eos_exactly_when_the_grammar_may_end(btok):
    eos = 1
    text = '{"ok": true, "n": 7, "tag": "e", "xs": [1]'
    prefix = ids_of(btok, text)
    c = fresh(TINY_SPEC, btok, prefix)
    close = ids_of(btok, "}")[0]
    assert forbidden_row(c)[eos] and not c.done
    # root -> "}" -> EOS -> EOS ; root -> EOS (too early: dropped)
    tree = DraftTree([prefix[-1], close, eos, eos, eos], [-1, 0, 1, 2, 0])
    pruned = c.prune(tree)
    assert pruned.tokens == [prefix[-1], close, eos, eos]
    logits = torch.zeros(len(pruned), V)
    c.mask(pruned, logits)
    allowed = [(~torch.isinf(r)).nonzero().flatten().tolist() for r in logits]
    assert eos not in allowed[0] and close in allowed[0]
    assert allowed[1] == allowed[2] == allowed[3] == [eos]  # after "}" the grammar is complete: EOS only
    c.advance([close])
    assert c.done and (~forbidden_row(c)).nonzero().flatten().tolist() == [eos]
    c.advance([eos, eos])  # EOS after the end is fine
    assert c.done
    with pytest.raises(GrammarError):
        c.advance([ids_of(btok, "a")[0]])
    with pytest.raises(GrammarError):
        fresh(TINY_SPEC, btok, ids_of(btok, '{"ok": 5'))
    with pytest.raises(GrammarError, match="end of sequence"):
        fresh(TINY_SPEC, btok, ids_of(btok, '{"ok": true') + [eos])


def test_compile_cache_and_errors(btok):
    a = compile_constraint(TINY_SPEC, btok, V)
    b = compile_constraint(GrammarSpec.json_schema(dict(TINY_SCHEMA)), btok, V)
    assert a is not b and a._m is not b._m  # own state per request, one compiled grammar
    a.advance(ids_of(btok, '{"ok": '))
    assert not torch.equal(forbidden_row(a), forbidden_row(b))
    with pytest.raises(GrammarError, match="strin"):
        compile_constraint(GrammarSpec.json_schema({"type": "strin"}), btok, V)
    with pytest.raises(GrammarError):
        GrammarSpec.lark("start: (").check()


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=50),
                                    dict(temperature=1.0, top_p=0.5), dict(temperature=2.0, top_k=3, top_p=0.9)])
def test_sampling_through_masked_logits(params):
    """-inf logits get probability 0 under every filter, also when top-k asks for more tokens than are allowed."""
    from specloom.sampling import SamplingParams, probs_from_logits, sample_token

    logits = torch.randn(V).masked_fill(torch.arange(V) % 50 != 3, float("-inf"))  # 6 allowed ids
    p = probs_from_logits(logits, SamplingParams(**params))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-5
    assert (p[torch.isinf(logits)] == 0).all()
    g = torch.Generator().manual_seed(0)
    assert all(int(sample_token(logits, SamplingParams(**params), g)) % 50 == 3 for _ in range(50))


# -- exactness under speculation on tiny targets --------------------------------------------------------------

class _Scripted(Drafter):
    """Test drafter: proposes whatever `fn(ctx)` returns."""

    fn = None

    @classmethod
    def create(cls, spec, target, tokenizer):
        d = cls()
        d.k, d.target = spec.num_speculative_tokens, target
        return d

    @property
    def num_speculative_tokens(self):
        return self.k

    def propose_one(self, ctx):
        return type(self).fn(self, ctx)


@pytest.fixture()
def scripted():
    DRAFTERS["_grammar_scripted"] = _Scripted
    yield _Scripted
    del DRAFTERS["_grammar_scripted"]
    _Scripted.fn = None


def unconstrained_argmax_chain(d, ctx):
    """The target's own unconstrained greedy continuation: tokens the target likes, most of which the grammar
    forbids -- accepted by verification unless the logits are masked."""
    toks = list(ctx.tokens)
    for _ in range(ctx.k):
        kv = d.target.new_kv(len(toks) + 1)
        out = d.target(torch.tensor([toks]), torch.arange(len(toks))[None], kv, num_logits=1)
        toks.append(int(out.logits[0, -1].argmax()))
    return DraftTree.chain(ctx.tokens[-1], toks[len(ctx.tokens):])


def garbage_tree(d, ctx):
    """A random tree of random ids over the whole logits width (specials and ids beyond the tokenizer too)."""
    rng = random.Random(len(ctx.tokens))
    tokens, parents, depth = [ctx.tokens[-1]], [-1], [0]
    for _ in range(3 * ctx.k):
        p = rng.randrange(len(tokens))
        if depth[p] < ctx.k:
            tokens.append(rng.randrange(V))
            parents.append(p)
            depth.append(depth[p] + 1)
    return DraftTree(tokens, parents)


def mixed_tree(truth):
    """At each depth: [garbage, the constrained greedy token, the target's unconstrained favourite]; the right
    token sits second, so the accepted path is non-contiguous."""
    def fn(d, ctx):
        seq = truth[ctx.num_prompt_tokens]
        n = len(ctx.tokens)
        right = seq[n:n + ctx.k]
        fav = unconstrained_argmax_chain(d, ctx).tokens[1:]
        tokens, parents, prev = [ctx.tokens[-1]], [-1], 0
        for j, tok in enumerate(right):
            for x in ((tok + 7) % V, tok, fav[j] if j < len(fav) else 0):
                tokens.append(x)
                parents.append(prev)
            prev = len(tokens) - 2
        return DraftTree(tokens, parents)
    return fn


def constrained(engine, tok, ids, spec=TINY_SPEC, **kw):
    c = compile_constraint(spec, tok, V)
    seen = []
    advance = c.advance
    c.advance = lambda toks: (seen.extend(toks), advance(toks))[1]
    r = engine.generate(prompt_token_ids=ids, max_tokens=kw.pop("max_tokens", 80), constraint=c, **kw)
    assert seen[:len(r.token_ids)] == r.token_ids  # the state moved over emitted tokens only
    return r, c


@pytest.mark.parametrize("drafter", ["ngram", "unconstrained", "garbage", "mixed"])
def test_tiny_greedy_exact_under_speculation(tiny, btok, scripted, drafter):
    t = tiny("llama")
    plain = Engine(t.model, btok)
    refs, truth = {}, {}
    for text in TINY_PROMPTS:
        ids = ids_of(btok, text)
        r, c = constrained(plain, btok, ids)
        assert r.finish_reason == "stop" and c.done, r
        jsonschema.validate(json.loads(btok.decode(r.token_ids)), TINY_SCHEMA)
        refs[text], truth[len(ids)] = r, ids + r.token_ids
    if drafter == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    else:
        scripted.fn = {"unconstrained": unconstrained_argmax_chain, "garbage": garbage_tree,
                       "mixed": mixed_tree(truth)}[drafter]
        spec = {"method": "_grammar_scripted", "num_speculative_tokens": 3}
    e = Engine(t.model, btok, SpeculativeConfig.parse(spec))
    accepted = 0
    for text in TINY_PROMPTS:
        r, _ = constrained(e, btok, ids_of(btok, text))
        assert r.token_ids == refs[text].token_ids, (drafter, text, btok.decode(r.token_ids))
        assert r.finish_reason == "stop"
        accepted += r.num_accepted_tokens
    if drafter == "mixed":
        assert accepted > 0


class _Sampler(Drafter):
    """Drafts from a fixed distribution q over a few tokens (two of them never grammatical), with draft_probs:
    root -> two siblings drawn without replacement; the first -> a chain from q."""

    q: torch.Tensor = None

    @classmethod
    def create(cls, spec, target, tokenizer):
        return cls()

    @property
    def num_speculative_tokens(self):
        return 3

    def propose_one(self, ctx):
        q, g = type(self).q, ctx.generator
        a = int(torch.multinomial(q, 1, generator=g))
        q2 = q.clone()
        q2[a] = 0
        q2 /= q2.sum()
        b = int(torch.multinomial(q2, 1, generator=g))
        c = int(torch.multinomial(q, 1, generator=g))
        d = int(torch.multinomial(q, 1, generator=g))
        probs = torch.stack([torch.zeros(V), q, q2, q, q])
        return DraftTree([ctx.tokens[-1], a, b, c, d], [-1, 0, 0, 1, 3], probs)


def test_tiny_sampling_keeps_the_constrained_distribution(tiny, btok):
    """Constrained sampling with a drafter whose proposals the grammar partly rejects (pruned) has the
    distribution of constrained plain sampling: first three tokens over {a, b}^2 x {a, b, c}."""
    t = tiny("llama")
    spec = GrammarSpec.regex("[ab]{2,5}c")
    a, b, c, z = (ids_of(btok, s)[0] for s in "abcz")
    q = torch.zeros(V)
    q[[a, b, c, z, 200]] = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    _Sampler.q = q
    DRAFTERS["_grammar_sampler"] = _Sampler
    try:
        spec_e = Engine(t.model, btok, SpeculativeConfig.parse({"method": "_grammar_sampler"}))
        plain = Engine(t.model, btok)
        ids = ids_of(btok, "abab")

        def dist(engine, base, n=500):
            out, drafted = Counter(), 0
            for s in range(n):
                r, _ = constrained(engine, btok, ids, spec, max_tokens=4, temperature=1.0, seed=base + s,
                                   sampling_rule="rejection")
                out[tuple(r.token_ids[:3])] += 1
                drafted += r.num_draft_tokens
            return out, drafted

        x, drafted = dist(spec_e, 0)
        y, _ = dist(plain, 10_000)
    finally:
        del DRAFTERS["_grammar_sampler"]
    assert drafted > 300
    assert all(set(k[:2]) <= {a, b} and k[2] in (a, b, c) for k in x | y)
    tv = 0.5 * sum(abs(x[k] - y[k]) for k in set(x) | set(y)) / 500
    assert tv < 0.12, (tv, x, y)


# -- plan_request ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    from specloom.errors import SpecloomError
    from specloom.loading import load_config, resolve

    try:
        src = resolve("smollm2-135m")
    except SpecloomError as e:
        pytest.skip(f"smollm2-135m not available: {e}")
    return Tokenizer.from_gguf(src.path, load_config(src)[0].eos_token_ids)


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]},
                                                   "days": {"type": "integer"}},
                  "required": ["city", "unit", "days"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris in celsius for the next 3 days?"}]


def test_plan_injects_tools_into_the_system_message(smol_tok):
    body = {"messages": [{"role": "system", "content": "Be brief."}, *ASK], "tools": [WEATHER, TIME]}
    plan = plan_request(body, smol_tok)
    assert plan.parser == "hermes" and plan.grammar is None and not plan.forced_tool
    assert plan.template_kwargs == {}  # SmolLM2's template knows nothing of tools
    system = plan.messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.")
    for needle in ("get_weather", "Weather forecast for a city", json.dumps(WEATHER_PARAMS), "get_time",
                   "<tool_call>"):
        assert needle in system["content"]
    assert plan.messages[1:] == ASK
    smol_tok.encode_chat(plan.messages, **plan.template_kwargs)
    # no system message: one is added; history with a call and its result rendered as Hermes text
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plan = plan_request({"messages": history, "tools": [WEATHER], "tool_choice": "required"}, smol_tok)
    roles = [m["role"] for m in plan.messages]
    assert roles == ["system", "user", "assistant", "user"] and plan.forced_tool
    assert "one of these functions" in plan.messages[0]["content"]
    call = HermesToolParser()
    call.feed(plan.messages[2]["content"], final=True)
    assert [(c.name, json.loads(c.arguments)) for c in call.result.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius", "days": 3})]
    assert plan.messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    # tool_choice "none": no definitions, no parser
    plan = plan_request({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, smol_tok)
    assert plan.messages == ASK and plan.parser is None and plan.grammar is None


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>"
    "{{ m.content or '' }}<|eot_id|>{% endfor %}{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{% endif %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    "{# <|python_tag|> #}"
)


@pytest.mark.parametrize("template, parser, key", [(HERMES_TEMPLATE, "hermes", "arguments"),
                                                   (LLAMA3_TEMPLATE, "llama3_json", "parameters")])
def test_plan_native_templates(template, parser, key):
    tok = byte_level_tokenizer(template)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    plan = plan_request({"messages": history, "tools": [WEATHER],
                         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, tok)
    assert plan.parser == parser and plan.forced_tool
    assert plan.template_kwargs == {"tools": [WEATHER]}
    assert plan.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # an object for templates
    assert plan.messages[2]["role"] == "tool"
    text = tok.decode(tok.encode_chat(plan.messages, **plan.template_kwargs))
    assert "get_weather" in text and "Weather forecast" in text  # the template rendered the tools
    # the forced grammar accepts exactly the format's call text, which the format's parser reads back
    call = {"name": "get_weather", key: {"city": "Oslo", "unit": "celsius", "days": 2}}
    out = json.dumps(call)
    if parser == "hermes":
        out = f"<tool_call>{out}</tool_call>"  # (this tokenizer has no newline; the grammar allows one)
    c = compile_constraint(plan.grammar, tok, V)
    c.advance(ids_of(tok, out))
    assert c.done
    p = HermesToolParser() if parser == "hermes" else Llama3JsonToolParser()
    p.feed(out, final=True)
    assert [(x.name, json.loads(x.arguments)) for x in p.result.tool_calls] == [("get_weather", call[key])]
    with pytest.raises(GrammarError):
        fresh(plan.grammar, tok, ids_of(tok, out.replace("get_weather", "get_time")))


def test_required_grammar_accepts_each_tool_once(smol_tok):
    plan = plan_request({"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required"}, smol_tok)
    for call in ({"name": "get_time", "arguments": {"tz": "UTC"}},
                 {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit", "days": 1}}):
        c = compile_constraint(plan.grammar, smol_tok, 49152)
        c.advance(ids_of(smol_tok, f"<tool_call>{json.dumps(call)}</tool_call>"))
        assert c.done
    for bad in ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # a required argument missing
                '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', 'Sure! <tool_call>'):
        with pytest.raises(GrammarError):
            compile_constraint(plan.grammar, smol_tok, 49152).advance(ids_of(smol_tok, bad))


def _tool(**fn):
    return {"type": "function", "function": fn}


@pytest.mark.parametrize("extra, param, needle", [
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "\"type\": \"function\""),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ({"tools": [_tool(name=7)]}, "tools[0].function.name", "must be a string"),
    ({"tools": [_tool(name="get weather!")]}, "tools[0].function.name", "'get weather!' is invalid"),
    ({"tools": [WEATHER, _tool(name="get_weather")]}, "tools[1].function.name", "a second function"),
    ({"tools": [_tool(name="f", parameters="x")]}, "tools[0].function.parameters", "function 'f'"),
    ({"tools": [_tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "strin"}}})]},
     "tools[0].function.parameters", "function 'f': invalid parameters schema: .*strin"),
    ({"tools": [_tool(name="f", parameters={"type": "object", "properties": 5})]},
     "tools[0].function.parameters", "function 'f'.*properties"),
    ({"tools": [_tool(name="f", parameters={"type": "string"})]}, "tools[0].function.parameters", "object"),
    ({"tools": [_tool(name="f", parameters={"type": "object", "properties": {"a": {"not": {"type": "string"}}}})],
      "tool_choice": "required"}, "tools[0].function.parameters", "function 'f'.*cannot be enforced"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "'get_time', which is not in tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"properties": 5}}}},
     "response_format.json_schema.schema", "'p'.*properties"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages", "not valid JSON"),
])
def test_plan_rejects_bad_input(smol_tok, extra, param, needle):
    with pytest.raises(ToolRequestError, match=needle) as e:
        plan_request({"messages": ASK, **extra}, smol_tok)
    assert e.value.param == param and e.value.message == str(e.value)


# -- the real SmolLM2-135M ------------------------------------------------------------------------------------

def run_plan(real, body, spec=None, max_tokens=60):
    plan = plan_request(body, real.tokenizer)
    ids = real.tokenizer.encode_chat(plan.messages, **plan.template_kwargs)
    e = Engine(real.model, real.tokenizer, SpeculativeConfig.parse(spec) if spec else None)
    c = compile_constraint(plan.grammar, real.tokenizer, real.model.config.vocab_size)
    r = e.generate(prompt_token_ids=ids, max_tokens=max_tokens, constraint=c)
    return plan, r, c


@pytest.mark.real
def test_real_forced_tool_call_exact_under_speculation(smollm2):
    body = {"messages": ASK, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    plan, ref, c = run_plan(smollm2, body)
    assert plan.forced_tool and ref.finish_reason == "stop" and c.done, ref.text
    p = HermesToolParser()
    p.feed(ref.text, final=True)
    assert len(p.result.tool_calls) == 1 and not p.result.errors and not p.result.content.strip(), p.result
    call = p.result.tool_calls[0]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    for spec in ({"method": "ngram"}, {"method": "eagle3"}):
        _, r, _ = run_plan(smollm2, body, spec)
        assert r.token_ids == ref.token_ids, (spec, r.text, ref.text)
        assert r.speculation["drafted_steps"] > 0  # the drafter drafted here: the exactness check is not vacuous
        if spec["method"] == "ngram":  # prompt lookup finds the tool's name and keys: fewer passes
            assert r.num_target_passes < ref.num_target_passes


@pytest.mark.real
def test_real_jump_forward_drafts_what_the_grammar_forces(smollm2):
    """Grammar jump-forward: where the constraint forces the next tokens (the tool-call envelope, a JSON key,
    a closing brace) they are drafted for free. Same tokens as without it (plain and with a drafter); fewer
    target passes on a forced tool call and on a response_format schema."""
    from specloom.step import Stepper

    tool = {"messages": ASK, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    person = {"messages": [{"role": "user", "content": "Describe Ada, a 36 year old engineer, as JSON."}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    passes = {}
    for name, body in (("tool", tool), ("person", person)):
        for spec in (None, {"method": "ngram"}):
            runs = {}
            for jump in (False, True):
                Stepper.jump_forward = jump
                try:
                    _, r, c = run_plan(smollm2, body, spec)
                finally:
                    Stepper.jump_forward = True
                assert c.done, r.text
                runs[jump] = r
            assert runs[True].token_ids == runs[False].token_ids, (name, spec)
            passes[(name, bool(spec))] = (runs[False].num_target_passes, runs[True].num_target_passes,
                                          len(runs[True].token_ids))
    for key, (without, with_jump, tokens) in passes.items():
        assert with_jump < without, (key, passes)
    # the forced tool call: most of its tokens are the envelope and the keys
    without, with_jump, tokens = passes[("tool", False)]
    assert tokens / with_jump > 1.5 * tokens / without, passes


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "role": {"enum": ["student", "teacher", "engineer"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
    "required": ["name", "age", "role", "skills"], "additionalProperties": False}


@pytest.mark.real
def test_real_response_format_json_schema(smollm2):
    body = {"messages": [{"role": "user", "content": "Describe Ada, a 36 year old engineer who likes math and "
                                                     "poetry, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                       "strict": True}}}
    plan, r, c = run_plan(smollm2, body, {"method": "ngram"})
    assert plan.parser is None and not plan.forced_tool
    assert r.finish_reason == "stop" and c.done, r.text
    jsonschema.validate(json.loads(r.text), PERSON)


@pytest.mark.real
def test_real_response_format_json_object(smollm2):
    body = {"messages": [{"role": "user", "content": "Give the capital of France as a JSON object with the key "
                                                     "\"capital\"."}], "response_format": {"type": "json_object"}}
    _, r, c = run_plan(smollm2, body)
    assert r.finish_reason == "stop" and c.done
    assert isinstance(json.loads(r.text), dict)
