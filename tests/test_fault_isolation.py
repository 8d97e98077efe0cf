"""One bad request never hurts another (issue 14, item 1): a fault while drafting, masking, verifying, sampling
or finishing one sequence fails that sequence alone (its row freed, a clear 4xx/5xx for its client), and every
other sequence ends with exactly the tokens it gets alone (fp32, greedy); the scheduler keeps serving.

A schema that can never be satisfied (a required property whose `$ref` refers only to itself) is refused when the
request is planned, with a 400 naming the schema problem; should a grammar still run out of allowed tokens
mid-decode (here: that admission check switched off), only its own request ends, with a 400 and no parser dump."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from specloom import Engine
from specloom.sampling import SamplingParams
from specloom.scheduler import BatchScheduler, Sequence
from specloom.serving.schema_satisfiable import unsatisfiable
from specloom.speculative import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
            "$defs": {"A": {"$ref": "#/$defs/A"}}}
N = 24


# -- the admission check -----------------------------------------------------------------------------------------

def test_unsatisfiable_schemas_are_named():
    assert "#/$defs/A" in unsatisfiable(SELF_REF)
    assert "#" in unsatisfiable({"$ref": "#"})
    assert unsatisfiable({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]})
    two = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}},
           "type": "array", "items": {"$ref": "#/$defs/A"}, "minItems": 1}
    assert "#/$defs/A" in unsatisfiable(two) and "#/$defs/B" in unsatisfiable(two)
    # recursion with a way out is fine: an optional property, an anyOf branch, an empty array
    ok = [
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}},
        {"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"},
        {"$defs": {"T": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/T"},
                                                        "minItems": 1}]}}, "$ref": "#/$defs/T"},
        {"type": "array", "items": {"$ref": "#"}},
        {"type": "object"}, True, {"$ref": "#/$defs/missing"},
    ]
    assert [unsatisfiable(s) for s in ok] == [None] * len(ok)
    chain = {f"A{i}": {"$ref": f"#/$defs/A{i + 1}"} for i in range(2000)}
    chain["A2000"] = {"type": "string"}
    t0 = time.perf_counter()
    assert unsatisfiable({"$defs": chain, "$ref": "#/$defs/A0"}) is None
    assert time.perf_counter() - t0 < 2  # linear, not one pass per link


# -- the scheduler: faults in one row ---------------------------------------------------------------------------

def _prompts():
    return [[5, 6, 7, 8] * 5, [9, 10, 11] * 6, [20, 30, 40, 50, 60], [70, 71, 72, 70, 71, 72, 70]]


@pytest.fixture(scope="module")
def engines(tiny):
    t = tiny("llama")
    alone = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids
             for p in _prompts()]
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse(NGRAM), max_model_len=128), alone


def _run(engine, rows=4, mode="fixed"):
    """All prompts at once; returns their sequences, after checking every row came back and the scheduler still
    serves a fresh request."""
    sch = BatchScheduler(engine, rows=rows, mode=mode)
    try:
        seqs = [Sequence(p, N, SamplingParams(), ignore_eos=True) for p in _prompts()]
        sch.submit(seqs)
        for s in seqs:
            s.done.wait(120)
            assert s.done.is_set()
        assert sch.pool.active == 0 and sch.num_running == 0
        again = Sequence(_prompts()[0], 4, SamplingParams(), ignore_eos=True)
        sch.submit([again])
        assert again.wait(60).token_ids and sch.thread.is_alive()
        return seqs
    finally:
        sch.close()


def _check(seqs, alone, poisoned, error_type=RuntimeError, needle="injected"):
    for i, s in enumerate(seqs):
        if i == poisoned:
            assert isinstance(s.error, error_type) and needle in str(s.error), s.error
        else:
            assert s.error is None, s.error
            assert s.result.token_ids == alone[i], i


def test_fault_in_one_rows_verify_fails_it_alone(engines, monkeypatch):
    import specloom.step

    engine, alone = engines
    real = specloom.step.verify
    calls = {"n": 0}

    def verify(tree, logits, params, generator, best=None):
        if params.seed == 666:
            calls["n"] += 1
            if calls["n"] == 3:  # mid-decode, after it emitted some tokens
                raise RuntimeError("injected verify fault")
        return real(tree, logits, params, generator, best)

    monkeypatch.setattr(specloom.step, "verify", verify)
    sch = BatchScheduler(engine, rows=4, mode="fixed")
    try:
        seqs = [Sequence(p, N, SamplingParams(seed=666 if i == 1 else None), ignore_eos=True)
                for i, p in enumerate(_prompts())]
        sch.submit(seqs)
        for s in seqs:
            assert s.done.wait(120)
        _check(seqs, alone, 1)
        assert sch.pool.active == 0
    finally:
        sch.close()


def test_bad_draft_tree_for_one_row_turns_its_speculation_off(engines, monkeypatch):
    """A drafter that proposes a token id outside the vocabulary for one row: the target pass never sees it,
    that row decodes on without speculation; every output is the target's own."""
    from specloom.tree import DraftTree

    engine, alone = engines
    drafter = engine.drafter
    real = type(drafter).propose

    def propose(self, ctxs):
        trees = real(self, ctxs)
        return [DraftTree(t.tokens + [10 ** 6], t.parents + [0]) if c.tokens[:4] == [9, 10, 11, 9] else t
                for c, t in zip(ctxs, trees)]

    monkeypatch.setattr(type(drafter), "propose", propose)  # the class: undo leaves no instance attribute
    seqs = _run(engine)
    _check(seqs, alone, -1)


def test_drafter_crash_and_failed_target_pass_lose_nothing(engines, monkeypatch):
    """The drafter raising for the batch turns speculation off for its rows; a target pass with drafts that
    raises is run again without them. Outputs are exact either way."""
    engine, alone = engines
    drafter, model = engine.drafter, engine.model
    real_propose, real_forward = type(drafter).propose, type(model).forward
    state = {"propose": 0, "forward": 0}

    def propose(self, ctxs):
        state["propose"] += 1
        if state["propose"] == 2:
            raise RuntimeError("injected drafter fault")
        return real_propose(self, ctxs)

    def forward(self, tokens, *a, **kw):
        if tokens.shape[1] > 1 and tokens.shape[0] > 1 and state["forward"] == 0:
            state["forward"] += 1
            raise RuntimeError("injected target fault")
        return real_forward(self, tokens, *a, **kw)

    monkeypatch.setattr(type(model), "forward", forward)
    _check(_run(engine), alone, -1)
    assert state["forward"] == 1
    monkeypatch.setattr(type(drafter), "propose", propose)
    _check(_run(engine), alone, -1)
    assert state["propose"] >= 2


def test_faults_between_steps_fail_one_sequence_and_keep_the_scheduler(engines, monkeypatch):
    """A failure while finishing one sequence (its result) or admitting another (its depth policy) fails that
    one alone; the scheduler thread survives and serves the next request."""
    from specloom.step import Row

    engine, alone = engines
    real_result = Row.result

    def result(self):
        if self.req.ids == _prompts()[2]:
            raise RuntimeError("injected result fault")
        return real_result(self)

    monkeypatch.setattr(Row, "result", result)
    seqs = _run(engine)
    _check(seqs, alone, 2)
    monkeypatch.setattr(Row, "result", real_result)

    sch = BatchScheduler(engine, rows=4, mode="fixed")
    real_admit = sch.policy.admit

    def admit(row, drafter):
        if row.req.ids == _prompts()[3]:
            raise RuntimeError("injected admission fault")
        return real_admit(row, drafter)

    monkeypatch.setattr(sch.policy, "admit", admit)
    try:
        seqs = [Sequence(p, N, SamplingParams(), ignore_eos=True) for p in _prompts()]
        sch.submit(seqs)
        for s in seqs:
            assert s.done.wait(120)
        _check(seqs, alone, 3, RuntimeError, "injected admission fault")
        assert sch.pool.active == 0 and sch.thread.is_alive()
    finally:
        sch.close()


# -- the live server --------------------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
NAME = "tiny-smol"


@pytest.fixture(scope="module")
def live(tiny_smol):
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server

    model, tokenizer, _ = tiny_smol
    engine = Engine(model, tokenizer, SpeculativeConfig.parse(NGRAM), max_model_len=256)
    server = LiveServer(Server(engine, NAME, max_num_seqs=4, speculation="fixed"))
    yield server.port
    server.close()


def _post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _sse(port, body) -> list[dict]:
    """The JSON events of a raw streamed response (status 200 checked)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        lines = r.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def _good(content, stream=False):
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 150,
            "temperature": 0, "stream": stream}


def _bad_tool_call():
    return {"model": NAME, "messages": [{"role": "user", "content": "call it"}], "max_tokens": 40,
            "temperature": 1.0, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": SELF_REF}}]}


def _bad_response_format(temperature):
    return {"model": NAME, "messages": [{"role": "user", "content": "json"}], "max_tokens": 40,
            "temperature": temperature,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SELF_REF}}}


def _stream_text(port, body, started: threading.Event):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    text = []
    for ch in client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            text.append(ch.choices[0].delta.content)
            started.set()
    started.set()
    return "".join(text)


def _beside(port, bad: dict):
    """Two good requests (one streamed) running; `bad` sent once the stream has begun. Returns (good text,
    streamed text, the bad request's (status, body), the largest batch a step ran)."""
    out, started = {}, threading.Event()
    a = threading.Thread(target=lambda: out.__setitem__("good", _post(port, _good("Tell me a story."))))
    b = threading.Thread(target=lambda: out.__setitem__("stream", _stream_text(port, _good("Hello there!", True),
                                                                               started)))
    a.start()
    b.start()
    started.wait(120)
    out["bad"] = _post(port, bad)
    a.join(180)
    b.join(180)
    status, body = out["good"]
    assert status == 200, body
    return body["choices"][0]["message"]["content"], out["stream"], out["bad"]


def test_unsatisfiable_schema_is_a_400_at_admission(live):
    port = live
    for bad in (_bad_tool_call(), _bad_response_format(0), _bad_response_format(1.0)):
        status, body = _post(port, bad)
        msg = body["error"]["message"]
        assert status == 400 and "#/$defs/A" in msg and "never produces a value" in msg, body
        assert "<state>" not in msg and "Parser" not in msg
    status, body = _post(port, _good("Hello there!"))
    assert status == 200


def test_poisoned_request_fails_alone_beside_good_ones(live, monkeypatch):
    """The reported case, past the admission check (switched off here): the grammar runs out of allowed tokens
    mid-decode. The poisoned request gets a 400 naming the dead end; the two good ones (one streamed) get
    exactly their alone output; the server keeps serving."""
    import specloom.serving.tools as tools
    from specloom.step import Stepper

    port = live
    alone_good = _post(port, _good("Tell me a story."))[1]["choices"][0]["message"]["content"]
    alone_stream = _stream_text(port, _good("Hello there!", True), threading.Event())
    assert alone_good and alone_stream

    monkeypatch.setattr(tools, "unsatisfiable", lambda schema: None)
    sizes = []
    real_step = Stepper.step

    def step(self, rows, plan):
        sizes.append((len(rows), sum(r.req.constraint is not None for r in rows)))
        return real_step(self, rows, plan)

    monkeypatch.setattr(Stepper, "step", step)
    for bad in (_bad_tool_call(), _bad_response_format(0)):
        sizes.clear()
        good, streamed, (status, body) = _beside(port, bad)
        assert status == 400, body
        msg = body["error"]["message"]
        assert "allows no next token" in msg and "<state>" not in msg, msg
        assert good == alone_good and streamed == alone_stream
        assert (3, 1) in sizes  # the poisoned request really ran in a step beside both good ones
    events = _sse(port, dict(_bad_tool_call(), stream=True))  # streamed: its stream ends with one error event
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and "allows no next token" in errors[0]["message"] and "error" in events[-1]
    monkeypatch.undo()
    assert _post(port, _good("Hello there!"))[1]["choices"][0]["message"]["content"] == alone_stream


def test_grammar_dead_end_is_cut_from_drafts_then_named(tiny_smol):
    """A drafted token after which the grammar allows nothing is pruned like an ungrammatical one (verification
    never reaches it); once the output itself gets there, masking raises the dead-end error, in one line."""
    import torch

    from specloom.serving.grammar import GrammarError, GrammarSpec, compile_constraint
    from specloom.tree import DraftTree

    _, tok, _ = tiny_smol
    c = compile_constraint(GrammarSpec.json_schema(SELF_REF), tok, len(tok.hf))
    prefix = tok.encode('{"a":', special=False)
    c.advance(prefix)
    space = tok.encode(" ", special=False)
    assert len(space) == 1
    tree = DraftTree([prefix[-1], space[0]], [-1, 0])
    assert len(c.prune(tree)) == 1  # the draft into the dead end is cut
    logits = torch.zeros(2, len(tok.hf))
    c.mask(tree, logits)
    assert torch.isfinite(logits[0]).sum() == 1 and torch.isfinite(logits[0, space[0]])  # still allowed itself
    c.advance(space)
    with pytest.raises(GrammarError) as e:
        c.mask_row(torch.zeros(len(tok.hf)))
    assert "allows no next token" in str(e.value) and "\n" not in str(e.value)
