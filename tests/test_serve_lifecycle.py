"""The server's life over 127.0.0.1: `/health` answers 503 "starting" until the model is ready, then 200 "ok";
SIGTERM drains `specloom serve` (no new request is admitted, the running one finishes, exit 0) and, past
`--shutdown-timeout`, ends what still runs with one clear 503 event; `/metrics` behind the API key when asked.

The model is the tiny random Llama over SmolLM2's tokenizer (conftest.py's `tiny_smol`), with a longer context so
that one streamed request of 4000 tokens runs for seconds."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

uvicorn = pytest.importorskip("uvicorn")

CHAT = "/v1/chat/completions"


def _get(port, path, auth=None):
    """(status, body text) of a GET."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(port, body: dict, timeout=60):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{CHAT}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat(max_tokens, stream=False):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


class _App:
    """build_app(target) behind uvicorn on a free port, in a thread."""

    def __init__(self, target):
        import socket

        from specloom.serving.app import build_app

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.uv = uvicorn.Server(uvicorn.Config(build_app(target), log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.uv.started:
            time.sleep(0.02)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(timeout=10)


def _engine(tiny_smol):
    from specloom import Engine
    from specloom.speculative import SpeculativeConfig

    model, tokenizer, _ = tiny_smol
    return Engine(model, tokenizer, SpeculativeConfig.parse(None), max_model_len=256)


def test_health_starting_until_ready(tiny_smol):
    """Before the model is ready: /health 503 {"status": "starting"}, generation and /v1/models 503 with OpenAI's
    error body; once ready: 200 {"status": "ok"} and requests served."""
    from specloom.serving.api import Server
    from specloom.serving.lifecycle import Lifecycle

    life = Lifecycle()
    app = _App(life)
    try:
        status, text = _get(app.port, "/health")
        assert (status, json.loads(text)) == (503, {"status": "starting"})
        status, body = _post(app.port, _chat(2))
        assert status == 503 and body["error"]["code"] == "server_starting", body
        status, text = _get(app.port, "/v1/models")
        assert status == 503 and json.loads(text)["error"]["code"] == "server_starting"
        server = Server(_engine(tiny_smol), "tiny", max_num_seqs=2, speculation="off")
        life.ready(server)
        try:
            status, text = _get(app.port, "/health")
            assert (status, json.loads(text)) == (200, {"status": "ok"})
            status, body = _post(app.port, _chat(2))
            assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body
        finally:
            server.close()
    finally:
        app.close()


def test_metrics_require_key(tiny_smol):
    """--metrics-require-key: /metrics answers 401 without the key and serves with it; off (the default) it is
    open. Asking for it without a key is one clear error."""
    from specloom.errors import SpecloomError
    from specloom.serving.api import Server

    with pytest.raises(SpecloomError, match="needs --api-key"):
        Server(_engine(tiny_smol), "tiny", max_num_seqs=1, speculation="off", metrics_require_key=True)
    for required in (True, False):
        server = Server(_engine(tiny_smol), "tiny", api_key="k", max_num_seqs=1, speculation="off",
                        metrics_require_key=required)
        app = _App(server)
        try:
            status, text = _get(app.port, "/metrics")
            if required:
                assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
                assert _get(app.port, "/metrics", "Bearer wrong")[0] == 401
            else:
                assert status == 200 and "specloom:" in text
            status, text = _get(app.port, "/metrics", "Bearer k")
            assert status == 200 and "specloom:" in text
        finally:
            app.close()
            server.close()


# -- SIGTERM drain, through the real `specloom serve` ---------------------------------------------------------
@pytest.fixture(scope="module")
def long_smol(tiny_smol, tmp_path_factory):
    """tiny_smol with a 8192-position context: a 4000-token answer takes seconds."""
    path = str(tmp_path_factory.mktemp("long_smol"))
    shutil.copytree(tiny_smol[2], path, dirs_exist_ok=True)
    cfg = os.path.join(path, "config.json")
    with open(cfg) as f:
        c = json.load(f)
    c["max_position_embeddings"] = 8192
    with open(cfg, "w") as f:
        json.dump(c, f)
    return path


def _start(path, *extra):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "specloom", "serve", path, "--port", str(port), "--dtype", "fp32",
                             "--max-model-len", "4200", "--max-num-seqs", "2", *extra],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    t0 = time.time()
    while time.time() - t0 < 120:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if _get(port, "/health")[0] == 200:
                return proc, port
        except OSError:  # not listening yet
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("serve did not become ready")


def _stream_until_sigterm(proc, port, after_sigterm):
    """A streamed 4000-token request; after its first content chunk, SIGTERM the server and run `after_sigterm`.
    Returns the stream's data lines."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{CHAT}", data=json.dumps(_chat(4000, True)).encode(),
                                 headers={"Content-Type": "application/json"})
    lines, signalled = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            if not raw.startswith(b"data:"):
                continue
            lines.append(raw.decode()[5:].strip())
            if not signalled and len(lines) >= 2:
                proc.send_signal(signal.SIGTERM)
                signalled = True
                after_sigterm()
    return lines


def test_sigterm_drains_then_exits_0(long_smol):
    """SIGTERM while a streamed request runs: /health says draining, a new request is refused with 503, the
    running one completes (finish_reason, [DONE]), and the process exits 0."""
    proc, port = _start(long_smol)
    seen = {}

    def probe():
        time.sleep(0.2)  # the signal handler runs in the server's main thread
        seen["health"] = _get(port, "/health")
        seen["new"] = _post(port, _chat(2))

    try:
        lines = _stream_until_sigterm(proc, port, probe)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert seen["health"][0] == 503 and json.loads(seen["health"][1]) == {"status": "draining"}, seen
    status, body = seen["new"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    assert lines[-1] == "[DONE]", lines[-3:]
    finish = json.loads(lines[-2])["choices"][0]["finish_reason"]
    assert finish in ("length", "stop"), lines[-2]
    tokens = sum(1 for x in lines[:-2] if json.loads(x)["choices"][0]["delta"].get("content"))
    assert finish == "stop" or tokens > 1000, tokens  # it ran to its end, well past the SIGTERM
    assert rc == 0 and "Traceback" not in stderr and "draining" in stderr, stderr


def test_sigterm_grace_period_ends_the_rest(long_smol):
    """Past --shutdown-timeout a request still running ends with one 503 error event naming the grace period;
    the process exits 0."""
    proc, port = _start(long_smol, "--shutdown-timeout", "0.3")
    try:
        t0 = time.time()
        lines = _stream_until_sigterm(proc, port, lambda: None)
        took = time.time() - t0
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    err = json.loads(lines[-1])["error"]
    assert err["code"] == "server_shutting_down" and "grace period of 0.3 s" in err["message"], lines[-1]
    assert took < 30
    assert rc == 0 and "Traceback" not in stderr, stderr
