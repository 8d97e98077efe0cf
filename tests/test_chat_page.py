"""The chat page at `/` (serving/static/chat.html) and the streamed speculation figures it shows
(`stream_options.include_speculation`, the `speculate` request field): a real server on a socket, the official
`openai` client, the page's script checked by Node where it is installed, and the page in headless Chromium where
that is installed (skipped with the reason otherwise)."""

import json
import os
import re
import shutil
import subprocess
import urllib.request

import openai
import pytest

KEY = "sk-page"


@pytest.fixture(scope="module")
def live(tiny_smol):
    from specloom import Engine
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server
    from specloom.speculative import SpeculativeConfig

    model, tokenizer, path = tiny_smol
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    engine = Engine(model, tokenizer, spec, max_model_len=512)  # the target drafting for itself: all accepted
    server = LiveServer(Server(engine, "tiny", api_key=KEY, max_num_seqs=4, speculation="fixed"))
    yield server.port, engine
    server.close()


def _client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_the_page_is_served_and_the_api_keeps_its_key(live):
    port, _ = live
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/") as r:
        page = r.read().decode()
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page and "include_speculation" in page and "<script" in page
    assert "http://" not in page and "https://" not in page  # nothing from a CDN
    with pytest.raises(urllib.error.HTTPError) as e:  # the page holds no key: its API calls need one
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=b'{"messages": []}',
            headers={"Content-Type": "application/json"}))
    assert e.value.code == 401


def _stream(port, speculate: bool):
    chunks = list(_client(port).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count: one two three"}], max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True, "include_speculation": True},
        extra_body={"speculate": speculate}))
    steps = [c.choices[0].model_extra["specloom"] for c in chunks if c.choices and "specloom" in c.choices[0].model_extra]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return steps, text, chunks[-1].usage


def test_streamed_steps_say_which_tokens_were_accepted_drafts(live):
    port, engine = live
    steps, text, usage = _stream(port, True)
    assert sum(len(s["tokens"]) for s in steps) == usage.completion_tokens == 24
    assert "".join(t for s in steps for t in s["tokens"]) == text
    assert all(0 <= s["accepted"] <= len(s["tokens"]) for s in steps)
    assert sum(s["accepted"] for s in steps) == usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert any(s["accepted"] == len(s["tokens"]) - 1 >= 1 for s in steps)  # self-draft: whole drafts accepted
    plain_steps, plain_text, plain_usage = _stream(port, False)  # the page's "plain decoding" switch
    assert plain_text == text and all(s["accepted"] == 0 and len(s["tokens"]) == 1 for s in plain_steps)
    assert plain_usage.completion_tokens_details.accepted_prediction_tokens == 0


def _script() -> str:
    from specloom.serving import app

    page = app._page()
    return re.search(r"<script>(.*)</script>", page, re.S).group(1)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed: the page's script is not checked")
def test_the_page_script_parses_and_reads_sse(tmp_path):
    src = tmp_path / "page.js"
    src.write_text(_script())
    r = subprocess.run(["node", "--check", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fn = re.search(r"function parseEvents\(buffer\) \{.*?\n\}\n", _script(), re.S).group(0)
    probe = fn + 'console.log(JSON.stringify(parseEvents("data: {\\"a\\": 1}\\n\\ndata: [DONE]\\n\\ndata: {\\"b\\"")));'
    r = subprocess.run(["node", "-e", probe], capture_output=True, text=True)
    assert json.loads(r.stdout) == {"events": ['{"a": 1}', "[DONE]"], "rest": 'data: {"b"'}


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (chromium, chromium-browser or google-chrome) on this host")
def test_the_page_in_a_real_browser(tiny_smol, tmp_path):
    """Headless Chromium opens the page on a server without a key, which sends a prompt by itself (?autorun=1);
    the screenshot after the stream must show the accepted drafts' green."""
    from specloom import Engine
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server
    from specloom.speculative import SpeculativeConfig

    model, tokenizer, path = tiny_smol
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    server = LiveServer(Server(Engine(model, tokenizer, spec, max_model_len=512), "tiny", max_num_seqs=2,
                               speculation="fixed"))
    try:
        shot = tmp_path / "page.png"
        url = f"http://127.0.0.1:{server.port}/?autorun=1&max_tokens=48&prompt=Count%20to%20ten"
        subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                        "--window-size=900,700", "--virtual-time-budget=20000", url], capture_output=True,
                       timeout=120)
        from PIL import Image

        img = Image.open(shot).convert("RGB")
        green = sum(1 for p in img.getdata() if p == (0xC9, 0xF2, 0xC7))
        assert green > 200, "no accepted-draft highlighting in the screenshot"
        if os.environ.get("SPECLOOM_PAGE_SHOT"):
            img.save(os.environ["SPECLOOM_PAGE_SHOT"])
    finally:
        server.close()
