"""Streaming that is exact under multi-token steps: for every way of cutting a token stream (or its text) into
deltas, the incremental detokenizer yields exactly `decode(all ids)`, and the reasoning / tool-call parsers give the
same final content, reasoning and tool calls as the one-piece (non-streamed) parse. Property tests (hypothesis)
over texts with multi-byte characters, tags split anywhere, several tags per delta, and malformed calls."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specloom.serving.detokenize import IncrementalDetokenizer
from specloom.serving.parsers import HermesToolParser, Llama3JsonToolParser, ReasoningParser

WORDS = ["hello", " world", "é", "ü", "中文", "日本語", "🙂", "👩‍💻", " ", "\n", "<", ">", "</", "<tool", "call>",
         "think", "{", "}", '"', "ß", "ﬁ", "  ", "ab", "x=1;", "\t"]
TEXT = st.lists(st.sampled_from(WORDS), max_size=25).map("".join)


def split_at(seq, cuts):
    cuts = sorted({c % (len(seq) + 1) for c in cuts})
    out, prev = [], 0
    for c in cuts + [len(seq)]:
        out.append(seq[prev:c])
        prev = c
    return out


def run(parser_cls, pieces):
    p = parser_cls()
    for piece in pieces:
        p.feed(piece)
    p.finish()
    return p.result


def tool_block(name, args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "</tool_call>"


CALL = st.builds(tool_block, st.sampled_from(["get_weather", "search", "ümlaut_fn"]),
                 st.dictionaries(st.sampled_from(["city", "q", "n", "中"]),
                                 st.one_of(st.integers(-5, 5), st.sampled_from(["Paris", "日本", "a\"b", "🙂"])),
                                 max_size=3))
HERMES_TEXT = st.lists(st.one_of(TEXT, CALL, st.just("<tool_call>{broken</tool_call>")), max_size=6).map("".join)
THINK_TEXT = st.lists(st.one_of(TEXT, st.just("<think>"), st.just("</think>")), max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(HERMES_TEXT, st.lists(st.integers(0, 10_000), max_size=12))
def test_hermes_parser_chunk_invariant(text, cuts):
    whole = run(HermesToolParser, [text])
    streamed = run(HermesToolParser, split_at(text, cuts))
    assert streamed == whole
    for call in whole.tool_calls:
        json.loads(call.arguments)


@settings(max_examples=300, deadline=None)
@given(THINK_TEXT, st.lists(st.integers(0, 10_000), max_size=12))
def test_reasoning_parser_chunk_invariant(text, cuts):
    whole = run(ReasoningParser, [text])
    assert run(ReasoningParser, split_at(text, cuts)) == whole
    n_tags = text.count("<think>") + text.count("</think>")  # tags consumed as delimiters vanish; nothing else
    kept = len(whole.content) + len(whole.reasoning)
    assert len(text) - 8 * n_tags <= kept <= len(text)


@settings(max_examples=200, deadline=None)
@given(st.one_of(TEXT, CALL.map(lambda b: b[len("<tool_call>"):-len("</tool_call>")].replace('"arguments"', '"parameters"')),
                 st.just('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')),
       st.lists(st.integers(0, 10_000), max_size=8))
def test_llama3_parser_chunk_invariant(text, cuts):
    whole = run(Llama3JsonToolParser, [text])
    assert run(Llama3JsonToolParser, split_at(text, cuts)) == whole


def test_parsers_known_answers():
    r = run(HermesToolParser, ["Sure. <tool_", 'call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool', "_call> done"])
    assert r.content == "Sure.  done" and r.tool_calls[0].name == "get_weather"
    assert json.loads(r.tool_calls[0].arguments) == {"city": "Paris"}
    r = run(HermesToolParser, ["a <tool_call>{oops</tool_call> b <tool_call>{\"name\": \"x\""])
    assert r.errors and r.content.startswith("a <tool_call>{oops</tool_call> b ") and not r.tool_calls
    r = run(ReasoningParser, ["<thi", "nk>step 1</th", "ink>The answer is 4."])
    assert (r.reasoning, r.content) == ("step 1", "The answer is 4.")
    r = run(Llama3JsonToolParser, ['  {"name": "f", "parameters": {"x": [1, 2]}}'])
    assert r.tool_calls[0].name == "f" and json.loads(r.tool_calls[0].arguments) == {"x": [1, 2]} and r.content == ""
    r = run(Llama3JsonToolParser, ["Hello {not a call}"])
    assert r.content == "Hello {not a call}" and not r.tool_calls


@pytest.fixture(scope="module")
def real_tokenizers():
    from specloom.loading import load_config, resolve
    from specloom.tokenizer import Tokenizer

    out = []
    for alias in ("smollm2-135m", "gemma3-270m"):
        try:
            src = resolve(alias)
        except Exception:
            continue
        cfg, _ = load_config(src)
        out.append(Tokenizer.from_gguf(src.path, cfg.eos_token_ids))
    if not out:
        pytest.skip("no real tokenizer installed")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXT, st.lists(st.integers(0, 10_000), max_size=10))
def test_incremental_detokenizer_exact(real_tokenizers, text, cuts):
    for tok in real_tokenizers:
        ids = tok.hf(text, add_special_tokens=False)["input_ids"]
        d = IncrementalDetokenizer(tok)
        deltas = [d.push(chunk) for chunk in split_at(ids, cuts)]
        deltas.append(d.finish())
        assert "".join(deltas) == tok.decode(ids), (text, ids)
        assert not any("\ufffd" in x for x in deltas[:-1]) or "\ufffd" in tok.decode(ids)


FULL_TEXT = st.lists(st.one_of(TEXT, CALL, st.just("<think>"), st.just("</think>")), max_size=7).map("".join)


def _pipeline(tok, chunks):
    """Token chunks -> incremental detokenizer -> reasoning parser -> Hermes tool-call parser on the content."""
    d, reasoning, tools = IncrementalDetokenizer(tok), ReasoningParser(), HermesToolParser()
    for chunk in chunks + [None]:
        text = d.push(chunk) if chunk is not None else d.finish()
        r = reasoning.feed(text, final=chunk is None)
        tools.feed(r.content, final=chunk is None)
    return reasoning.result.reasoning, tools.result.content, [(c.name, c.arguments) for c in tools.result.tool_calls]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(FULL_TEXT, st.lists(st.integers(0, 10_000), max_size=10))
def test_token_stream_to_tool_calls_chunk_invariant(real_tokenizers, text, cuts):
    """End to end, as the server streams: every cut of the *token* stream gives the same reasoning, content and
    tool calls as the whole token list decoded and parsed in one piece."""
    for tok in real_tokenizers:
        ids = tok.hf(text, add_special_tokens=False)["input_ids"]
        assert _pipeline(tok, split_at(ids, cuts)) == _pipeline(tok, [ids])
