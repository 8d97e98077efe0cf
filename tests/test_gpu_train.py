"""scripts/gpu_train.sh --smoke on the CPU with a tiny target: data, EAGLE-3 and DSpark training, the size check."""

import json
import os
import random
import subprocess
import sys


def test_gpu_train_script_smoke(tiny, tmp_path):
    t = tiny("llama")
    prompts = tmp_path / "p.jsonl"
    rng = random.Random(0)
    with open(prompts, "w") as f:
        for _ in range(16):
            f.write(json.dumps({"turns": [" ".join(f"w{rng.randrange(4, 60)}" for _ in range(6))]}) + "\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHON=sys.executable, GPU_TRAIN_DEVICE="cpu", GPU_TRAIN_TARGET=t.path,
               GPU_TRAIN_PROMPTS=str(prompts))
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(root, "scripts", "gpu_train.sh"), str(out), "--smoke"], env=env,
                       capture_output=True, text=True, timeout=900)
    log = (out / "gpu_train.log").read_text()
    assert r.returncode == 0, log[-3000:]
    assert "=== done: 0 failed" in log
    for kind in ("eagle3", "dspark"):
        cfg = json.load(open(out / kind / "config.json"))
        assert cfg["specloom"]["kind"] == kind and cfg["specloom"]["manifest"]["steps"] == 4
    assert json.load(open(out / "eagle3" / "config.json"))["specloom"]["warm_start_layer"] == -1
    assert len(json.load(open(out / "eagle3" / "evals.json"))) == 2  # step 2 and the end
