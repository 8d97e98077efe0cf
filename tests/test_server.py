"""The OpenAI-compatible server, driven by the official `openai` client over a real socket on 127.0.0.1:
chat (streamed and not), completions, n / seed / stop / usage, forced tool calls and JSON-schema output, errors
with OpenAI bodies -- with speculation on (the bundled EAGLE-3 tree) and off. Streamed text == non-streamed text
== plain greedy decoding."""

import json

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="module", params=[None, {"method": "eagle3"}], ids=["off", "eagle3"])
def server(request, smollm2):
    from specloom import Engine
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server
    from specloom.speculative import SpeculativeConfig

    engine = Engine(smollm2.model, smollm2.tokenizer, SpeculativeConfig.parse(request.param), max_model_len=1024)
    live = LiveServer(Server(engine, "smollm2-135m", api_key="sk-test", max_num_seqs=4, speculation="fixed"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key="sk-test", max_retries=0)
    yield client, engine, live.port
    live.close()


MSG = [{"role": "user", "content": "Name three colours, comma separated."}]


def test_chat_streamed_equals_non_streamed_equals_plain(server):
    client, engine, _ = server
    r = client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    plain = engine.generate(messages=MSG, max_tokens=24).text
    assert text == plain
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completions_n_seed_stop(server):
    client, engine, _ = server
    r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == engine.generate("The capital of France is", max_tokens=12).text
    a = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=10,
                                  temperature=0.9, seed=5, n=2)
    b = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=10,
                                  temperature=0.9, seed=5, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    full = r.choices[0].text
    stop = full.strip().split()[1] if len(full.split()) > 1 else "zzz"
    s = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                  temperature=0, stop=[stop])
    assert stop not in s.choices[0].text and full.startswith(s.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=12, temperature=0, stop=[stop],
        stream=True) if c.choices)
    assert streamed == s.choices[0].text


@pytest.mark.parametrize("kwargs, status, needle", [
    ({"model": "gpt-4"}, 404, "does not exist"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"max_tokens": 10 ** 9}, 400, "max_tokens"),
    ({"temperature": 7}, 400, "temperature"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi " * 2000}]}, 400, "context"),
])
def test_bad_requests_get_openai_errors(server, kwargs, status, needle):
    client, _, _ = server
    args = {"model": "smollm2-135m", "messages": MSG, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == status and needle in str(e.value)
    assert client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=2).choices  # still serving


def test_auth_malformed_json_models_health(server):
    _, _, port = server
    import urllib.error
    import urllib.request

    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{not json",
                                 headers={"Authorization": "Bearer sk-test", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and "not valid JSON" in json.loads(e.value.read())["error"]["message"]
    good = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["smollm2-135m"]
    assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())["status"] == "ok"


def test_metrics_count_requests_and_speculation(server):
    client, engine, port = server
    import urllib.request

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        vals = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                vals[k] = float(v)
        return vals

    before = scrape()
    r = client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=16, temperature=0)
    after = scrape()
    key = 'specloom:generation_tokens_total{model_name="smollm2-135m"}'
    assert after[key] - before.get(key, 0) == r.usage.completion_tokens
    lat = 'specloom:e2e_request_latency_seconds_count{model_name="smollm2-135m"}'
    assert after[lat] - before.get(lat, 0) == 1
    drafts = 'specloom:spec_decode_num_draft_tokens_total{model_name="smollm2-135m"}'
    acc = 'specloom:spec_decode_num_accepted_tokens_total{model_name="smollm2-135m"}'
    if engine.drafter is None:
        assert after[drafts] == 0
    else:
        assert after[drafts] > before.get(drafts, 0) and after[acc] <= after[drafts]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call(server, stream):
    jsonschema = pytest.importorskip("jsonschema")
    client, _, _ = server
    args = dict(model="smollm2-135m", messages=ASK, max_tokens=60, temperature=0, tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls, finish = {}, None
        for ch in client.chat.completions.create(**args, stream=True):
            if not ch.choices:
                continue
            for tc in ch.choices[0].delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        calls = list(calls.values())
    else:
        r = client.chat.completions.create(**args)
        finish = r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_response_format_json_schema(server):
    jsonschema = pytest.importorskip("jsonschema")
    client, _, _ = server
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "colors": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 3}},
              "required": ["name", "age", "colors"]}
    r = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=80,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("kwargs, needle", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "f"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_tool_requests(server, kwargs, needle):
    client, _, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4, **kwargs)
    assert needle in str(e.value)


def test_logprobs_are_the_targets_own(server):
    """logprobs (chat: content + top_logprobs; completions: token_logprobs) equal the target's log-softmax at each
    position, computed here with one plain forward pass -- with speculation on as off."""
    import torch

    client, engine, _ = server
    r = client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    ids = engine.tokenizer.encode_chat(MSG)
    out = engine.generate(messages=MSG, max_tokens=12).token_ids
    full = torch.tensor([ids + out])
    with torch.no_grad():
        logits = engine.model(full, torch.arange(full.shape[1])[None], engine.model.new_kv(full.shape[1])).logits[0]
    ref = torch.log_softmax(logits[len(ids) - 1:-1], -1)
    for i, c in enumerate(content):
        assert abs(c.logprob - float(ref[i, out[i]])) < 1e-3
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token  # greedy: the chosen is the top
    comp = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6,
                                     temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) and all(len(t) == 3 for t in lp.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model="smollm2-135m", messages=MSG, max_tokens=12, temperature=0, logprobs=True, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [e.logprob for x in streamed for e in x.content] == pytest.approx([c.logprob for c in content], abs=1e-4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=2, top_logprobs=3)


def test_usage_reports_how_speculation_went(server):
    """Each response's usage carries the drafted and accepted tokens (OpenAI's predicted-output fields and
    specloom's `speculation`), equal to what the engine reports for the same request alone; streamed too."""
    client, engine, _ = server
    r = client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=24, temperature=0)
    alone = engine.generate(messages=MSG, max_tokens=24)
    spec = r.usage.model_extra["speculation"]
    details = r.usage.completion_tokens_details
    assert spec["drafted_tokens"] == alone.num_draft_tokens and spec["accepted_tokens"] == alone.num_accepted_tokens
    assert details.accepted_prediction_tokens == alone.num_accepted_tokens
    assert details.rejected_prediction_tokens == alone.num_draft_tokens - alone.num_accepted_tokens
    assert spec["target_passes"] == alone.num_target_passes
    assert spec["tau"] == round(r.usage.completion_tokens / alone.num_target_passes, 3)
    if engine.drafter is not None:
        assert spec["drafted_tokens"] > 0
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_extra["speculation"] == spec
