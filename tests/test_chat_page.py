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
CHROMEDRIVER = shutil.which("chromedriver")


class _Browser:
    """Headless Chromium through chromedriver's WebDriver HTTP API (urllib only: no Selenium or Playwright)."""

    def __init__(self, profile):
        import socket
        import time

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                self._call("GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=900,700", f"--user-data-dir={profile}"]
        caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {"binary": CHROMIUM, "args": args}}}}
        self.session = "/session/" + self._call("POST", "/session", caps)["sessionId"]

    def _call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["value"]

    def open(self, url):
        self._call("POST", self.session + "/url", {"url": url})

    def run(self, script):
        return self._call("POST", self.session + "/execute/sync", {"script": script, "args": []})

    def screenshot(self) -> bytes:
        import base64

        return base64.b64decode(self._call("GET", self.session + "/screenshot"))

    def close(self):
        try:
            self._call("DELETE", self.session)
        finally:
            self.driver.terminate()
            self.driver.wait(10)


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="no Chromium and chromedriver on this host (Debian: chromium, chromium-driver)")
def test_the_page_in_a_real_browser(smollm2, tmp_path):
    """Headless Chromium opens the page on a server without a key, which sends a prompt by itself (?autorun=1);
    SmolLM2-135M drafts for itself (every draft accepted). Once the page says the answer is complete, the answer
    box holds the answer, its tokens in the accepted drafts' green (the screenshot, below the legend's green), and
    the figures line counts them."""
    import io
    import time

    from PIL import Image

    from specloom import Engine
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server
    from specloom.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "draft_model", "model": smollm2.path, "num_speculative_tokens": 3})
    engine = Engine(smollm2.model, smollm2.tokenizer, spec, max_model_len=512)
    expected = engine.generate(messages=[{"role": "user", "content": "Count to ten"}], max_tokens=48, chat=True).text
    server = LiveServer(Server(engine, "smollm2", max_num_seqs=2, speculation="fixed"))
    browser = _Browser(tmp_path / "profile")
    try:
        browser.open(f"http://127.0.0.1:{server.port}/?autorun=1&max_tokens=48&prompt=Count%20to%20ten")
        deadline = time.monotonic() + 120
        while not browser.run("return window.specloomDone === true;"):
            assert time.monotonic() < deadline, "the page never finished its answer"
            time.sleep(0.2)
        text = browser.run("return document.getElementById('out').textContent;")
        stats = browser.run("return document.getElementById('stats').textContent;")
        assert text == expected, (text, expected)
        tokens, steps = (int(x) for x in re.match(r"(\d+) tokens in (\d+) steps", stats).groups())
        assert steps < tokens, stats  # several tokens per step: the drafts were accepted
        img = Image.open(io.BytesIO(browser.screenshot())).convert("RGB")
        if os.environ.get("SPECLOOM_PAGE_SHOT"):
            img.save(os.environ["SPECLOOM_PAGE_SHOT"])
        answer = img.crop((0, 320, img.width, img.height)).tobytes()  # below the form: the answer box
        green = sum(1 for i in range(0, len(answer), 3) if answer[i:i + 3] == bytes((0xC9, 0xF2, 0xC7)))
        assert green > 2000, f"no accepted-draft highlighting in the answer box ({green} green pixels)"
    finally:
        browser.close()
        server.close()
