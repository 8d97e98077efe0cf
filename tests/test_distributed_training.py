"""Multi-process training (`torchrun --nproc-per-node 2 -m specloom train ...`, gloo on the CPU) on a tiny random
Llama and tiny data: the 2-process loss curve equals the 1-process one (same global batches, gradients summed over
the processes), only rank 0 writes files, and a 2-process run resumes from its checkpoint. Plus the clear errors.

The workers run through a small wrapper that records, with a Python audit hook, every file each rank opens for
writing or renames under --out (torch.save, json, matplotlib and the atomic renames go through these).
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from specloom.cli import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SPECLOOM_BEHAVIOUR_CHECK": "0"}

WRAPPER = r'''
import atexit, json, os, runpy, sys
out, log = os.path.realpath(sys.argv[sys.argv.index("--out") + 1]), sys.argv.pop(1)
writes = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and (args[1] or "r")[0] in "wax":
        path = args[0]
    elif event == "os.rename":
        path = os.fsdecode(args[1])
    else:
        return
    if os.path.realpath(path).startswith(out):
        writes.append(os.path.basename(path))
def dump():
    with open(f"{log}.{os.environ['RANK']}.json", "w") as f:
        json.dump(writes, f)
atexit.register(dump)
sys.addaudithook(hook)
sys.argv[0] = "specloom"
runpy.run_module("specloom", run_name="__main__")
'''


@pytest.fixture(scope="module")
def one_thread():
    """One thread in this process too, as in the workers (OMP_NUM_THREADS=1): the same arithmetic, and no
    oversubscribed cores on a 2-core machine running three processes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory, one_thread):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("ddp")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for _ in range(24):
            words = " ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(4, 14)))
            f.write(json.dumps({"turns": [words]}) + "\n")
    data = str(root / "data")
    assert main(["data", "--target", t.path, "--prompts", str(prompts), "--out", data, "--max-new-tokens", "8",
                 "--batch-size", "24", "--dtype", "fp32"]) == 0
    (root / "wrapper.py").write_text(WRAPPER)
    return t, data, root


def _args(t, data, out, steps, kind="medusa", *extra):
    return ["train", kind, "--target", t.path, "--data", data, "--out", out, "--steps", str(steps), "--lr", "3e-3",
            "--tokens-per-batch", "160", "--warmup", "1", "--save-every", "2", "--loss-fraction", "1.0", "--no-bf16",
            "--eval-fraction", "0.1", *extra]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(root, args, torchrun: bool, timeout=120):
    """Run `specloom train ...` in 2 processes: through torchrun, or (cheaper: no launcher process) as two
    processes given the environment torchrun gives its workers. Returns (rank 0's stderr, [files each rank wrote])."""
    log = str(root / "writes")
    worker = [str(root / "wrapper.py"), log, *args]
    if torchrun:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            *worker], capture_output=True, text=True, env=ENV, timeout=timeout)
        assert p.returncode == 0, p.stderr[-4000:]
        err = p.stderr
    else:
        port = str(_free_port())
        procs = [subprocess.Popen([sys.executable, *worker], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                  "MASTER_PORT": port}) for r in range(2)]
        try:
            errs = [p.communicate(timeout=timeout)[1] for p in procs]
        finally:  # one failed: the other would wait for it in a collective
            for p in procs:
                p.kill()
        assert [p.returncode for p in procs] == [0, 0], errs
        err = errs[0]
        assert "specloom" not in errs[1] and "it/s" not in errs[1], errs[1]  # rank 1 prints nothing of its own
    writes = [json.load(open(f"{log}.{r}.json")) for r in range(2)]
    for r in range(2):
        os.remove(f"{log}.{r}.json")
    return err, writes


def _close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="this PyTorch build has no torch.distributed gloo backend")
def test_two_processes_match_one_and_resume(setup):
    from safetensors.torch import load_file

    t, data, root = setup
    one = str(root / "one")
    assert main(_args(t, data, one, 4, "medusa", "--medusa-heads", "2")) == 0
    two = str(root / "two")
    err, writes = _two_processes(root, _args(t, data, two, 2, "medusa", "--medusa-heads", "2"), torchrun=True)
    assert "train_state.pt" in writes[0] and "history.json" in writes[0], writes[0]
    assert writes[1] == [], writes[1]  # rank 1 wrote nothing
    assert err.count("trainable parameters") == 1  # rank 0 alone prints
    # rerun to 4 steps: both processes resume from rank 0's checkpoint of step 2
    err, writes = _two_processes(root, _args(t, data, two, 4, "medusa", "--medusa-heads", "2"), torchrun=False)
    assert "resuming at step 2/4" in err and writes[1] == []
    assert sorted(os.listdir(one)) == sorted(os.listdir(two))  # the same files, no leftover temporaries
    h1 = json.load(open(os.path.join(one, "history.json")))
    h2 = json.load(open(os.path.join(two, "history.json")))
    assert [h["step"] for h in h2] == [1, 2, 3, 4]
    for a, b in zip(h1, h2):
        assert a.keys() == b.keys() and a["answer_tokens_seen"] == b["answer_tokens_seen"]
        assert _close(a["loss"], b["loss"], 1e-4), (h1, h2)
        for k in a:
            if k.startswith("acc"):
                assert abs(a[k] - b[k]) < 0.02, (k, h1, h2)
    assert h1[-1]["loss"] != h1[0]["loss"]  # it trained
    w1, w2 = (load_file(os.path.join(d, "medusa_lm_head.safetensors")) for d in (one, two))
    for k in w1:
        torch.testing.assert_close(w1[k].float(), w2[k].float(), rtol=1e-3, atol=1e-4)
    m = json.load(open(os.path.join(two, "config.json")))["specloom"]["manifest"]
    assert m["processes"] == 2 and m["steps"] == 4
    print("\nloss 1 process :", [round(h["loss"], 6) for h in h1])
    print("loss 2 processes:", [round(h["loss"], 6) for h in h2])


def test_batches_that_cannot_be_split_and_other_bad_input(setup, monkeypatch, capsys):
    from specloom import SpecloomError
    from specloom.training import distributed

    monkeypatch.setattr(distributed, "_world", 2)
    with pytest.raises(SpecloomError, match=r"--tokens-per-batch 40 makes batches of as few as 1 sequence\(s\) "
                                            r"\(of up to 30 tokens\), which 2 processes cannot split.*"
                                            r"--tokens-per-batch 60 or more"):
        distributed.check_split([[0, 1], [2]], [20, 20, 30], 40)
    distributed.check_split([[0, 1], [2, 3]], [20, 20, 30, 30], 60)
    monkeypatch.setattr(distributed, "_world", 1)
    t, data, root = setup
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    assert main(_args(t, data, str(root / "bad"), 1)) == 2
    assert "start multi-process training with `torchrun --nproc-per-node N" in capsys.readouterr().err
    assert main(["train", "target", "--init-from", t.path, "--target", t.path, "--data", data,
                 "--out", str(root / "bad_ft"), "--steps", "1"]) == 2
    assert "runs in one process" in capsys.readouterr().err
