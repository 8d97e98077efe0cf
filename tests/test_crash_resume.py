"""Crash safety of the long jobs (issue 14): `specloom data` and `specloom train` killed with SIGKILL at a random
moment (after at least one shard / checkpoint is on disk) and rerun with the same command end with what an
uninterrupted run writes: the same conversations (job id -> tokens, loss mask, source, turns), the same meta.json and
data totals; the same final weights and the same loss history, bit for bit. Every file is written to a temporary
name and renamed (specloom/atomic.py), so no torn file is left for the rerun to trip on.

Tiny random Llama (conftest.py), fp32 generation (greedy and sampled answers are batch-invariant there), one thread
(so that the two training runs do the same arithmetic)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TRAIN_STEPS = 160  # checkpoints every 5 steps: the kill lands part-way with room to spare


def _prompts(path, n, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(3, 12)))
            f.write(json.dumps({"turns": [words]}) + "\n")
    return str(path)


def _run(args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "specloom", *args], capture_output=True, text=True, env=ENV,
                       timeout=timeout)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


def _run_and_kill(args, written, rng, timeout=300, max_wait=0.4):
    """Start the command, wait until `written()` is true, wait a random moment more (up to `max_wait` seconds),
    SIGKILL it. Returns whether it was still running when killed."""
    proc = subprocess.Popen([sys.executable, "-m", "specloom", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)
    t0 = time.time()
    try:
        while not written():
            assert proc.poll() is None, "the job ended before it wrote anything"
            assert time.time() - t0 < timeout
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, max_wait))
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    return alive


def _conversations(d):
    from specloom.training.shards import read_shard, shard_files

    out = {}
    for fn in shard_files(d):
        t, meta = read_shard(fn, ("tokens", "offsets", "loss_mask", "job_ids"))
        info = json.loads(meta["specloom"])
        off = t["offsets"].tolist()
        for j, (job, a, b) in enumerate(zip(t["job_ids"].tolist(), off[:-1], off[1:])):
            assert job not in out, f"job {job} stored twice"
            out[job] = (t["tokens"][a:b].tolist(), t["loss_mask"][a:b].tolist(), info["sources"][j], info["turns"][j])
    return out


def _totals(d):
    prog = json.load(open(os.path.join(d, "progress.json")))
    return {k: prog[k] for k in ("conversations", "tokens", "answer_tokens", "per_source", "turns",
                                 "answer_length_histogram", "answer_length_median")}


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    return tiny("llama").path, root, _prompts(root / "p.jsonl", 80)


@pytest.fixture(scope="module")
def whole_data(runs):
    """One uninterrupted `specloom data` run: the reference of the data test and the training test's data."""
    target, root, prompts = runs
    whole = str(root / "data_whole")
    _run(_data_args(target, prompts, whole))
    return whole


def _data_args(target, prompts, out):
    return ["data", "--target", target, "--prompts", prompts, "--out", out, "--max-new-tokens", "24", "--rows", "4",
            "--shard-tokens", "100", "--sampled-fraction", "0.5", "--dtype", "fp32", "--kv-dtype", "fp32"]


def _train_args(target, data, out):
    return ["train", "medusa", "--target", target, "--data", data, "--out", out, "--tokens-per-batch", "128",
            "--save-every", "5", "--medusa-heads", "2", "--steps", str(TRAIN_STEPS)]


@pytest.mark.parametrize("seed", [0])
def test_data_killed_and_rerun_equals_an_uninterrupted_run(runs, whole_data, seed):
    target, root, prompts = runs
    whole, killed = whole_data, str(root / f"data_killed{seed}")
    rng = random.Random(seed)
    for attempt in range(4):  # a fast host can finish all 80 tiny conversations within the random wait: kill sooner
        shutil.rmtree(killed, ignore_errors=True)
        alive = _run_and_kill(_data_args(target, prompts, killed),
                              lambda: os.path.isfile(os.path.join(killed, "shard_00001.safetensors.xz")),
                              rng, max_wait=0.4 / 4 ** attempt)
        before = len(_conversations(killed))
        if alive and before < 80:
            break
    _run(_data_args(target, prompts, killed))
    want = _conversations(whole)
    assert sorted(want) == list(range(80))
    assert _conversations(killed) == want
    assert not [f for f in os.listdir(killed) if f.endswith(".tmp")]
    assert json.load(open(os.path.join(killed, "meta.json"))) == json.load(open(os.path.join(whole, "meta.json")))
    assert _totals(killed) == _totals(whole)
    assert alive and 0 < before < 80, (alive, before)  # it was killed part-way, with something already stored


def _weights(d):
    from safetensors.torch import load_file

    return load_file(os.path.join(d, "medusa_lm_head.safetensors"))


def test_train_killed_and_rerun_equals_an_uninterrupted_run(runs, whole_data):
    target, root, _ = runs
    data = whole_data
    whole, killed = str(root / "train_whole"), str(root / "train_killed")
    _run(_train_args(target, data, whole))
    state = os.path.join(killed, "train_state.pt")
    rng = random.Random(1)
    for attempt in range(4):  # as for the data job: a fast host may finish within the random wait
        shutil.rmtree(killed, ignore_errors=True)
        alive = _run_and_kill(_train_args(target, data, killed), lambda: os.path.isfile(state), rng,
                              max_wait=0.4 / 4 ** attempt)
        step = torch.load(state, weights_only=False)["step"]
        if alive and step < TRAIN_STEPS:
            break
    p = _run(_train_args(target, data, killed))
    assert f"resuming at step {step}/{TRAIN_STEPS}" in p.stderr
    assert not [f for f in os.listdir(killed) if f.endswith(".tmp")]
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hist = [json.load(open(os.path.join(d, "history.json"))) for d in (whole, killed)]
    assert hist[0] == hist[1] and len(hist[0]) == TRAIN_STEPS
    assert json.load(open(os.path.join(whole, "evals.json"))) == json.load(open(os.path.join(killed, "evals.json")))
    assert alive and 0 < step < TRAIN_STEPS, (alive, step)


def test_a_failed_write_leaves_the_old_file(tmp_path):
    from specloom.atomic import replacing, write_json

    path = str(tmp_path / "meta.json")
    write_json(path, {"v": 1})
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            with open(tmp, "w") as f:
                f.write('{"v": 2, "tor')  # killed here, as far as the reader can tell
            raise RuntimeError
    assert json.load(open(path)) == {"v": 1} and os.listdir(tmp_path) == ["meta.json"]


def test_stale_temporary_files_are_removed(tmp_path):
    """What a SIGKILL mid-write leaves (`<name>.<pid>.tmp`) is removed when the job starts again; nothing else."""
    from specloom.atomic import remove_stale

    for name in ("train_state.pt.4242.tmp", "shard_00003.safetensors.17.tmp", "notes.tmp", "keep.json"):
        (tmp_path / name).write_text("x")
    remove_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["keep.json", "notes.tmp"]
