"""Resident memory of a `specloom serve smollm2-135m` process before and after three concurrent ~4 MB prompts it
must refuse (400: far past the context), and how long each refusal took (issue 38, item 4).

    python scripts/refused_body_rss.py <repository checkout> <port>
"""
import json, subprocess, sys, time, urllib.request, concurrent.futures, os
cwd, port = sys.argv[1], int(sys.argv[2])
p = subprocess.Popen([sys.executable, "-m", "specloom", "serve", "smollm2-135m", "--port", str(port)], cwd=cwd,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def rss():
    with open(f"/proc/{p.pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
try:
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                break
        except Exception:
            time.sleep(1)
    time.sleep(2)
    before = rss()
    text = ("The quick brown fox jumps over the lazy dog. " * 90000)[:4_000_000]
    def send(kind):
        body = ({"prompt": text, "max_tokens": 4} if kind == "c" else
                {"messages": [{"role": "user", "content": text}], "max_tokens": 4})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{'completions' if kind == 'c' else 'chat/completions'}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        t = time.time()
        try:
            urllib.request.urlopen(req, timeout=300)
            return 200, time.time() - t, ""
        except urllib.error.HTTPError as e:
            return e.code, time.time() - t, json.loads(e.read())["error"]["message"][:90]
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        res = list(ex.map(send, ["c", "chat", "c"]))
    time.sleep(2)
    after = rss()
    print(json.dumps({"rss_before_mib": round(before), "rss_after_mib": round(after), "responses": res}))
finally:
    p.terminate(); p.wait(60)
