"""Copy a `specloom data` directory into the compact shard form (training/shards.py) -- e.g. a run that wrote
uncompressed shards on a scratch disk, into the repository's `datasets/` -- keeping meta.json, progress.json and
DATACARD.md, so `specloom data --out DST` resumes from it. Shards already in DST are kept.

    python scripts/pack_data.py /work/datagen/smollm2 datasets/smollm2-135m
"""

import json
import os
import shutil
import sys

from specloom.training.shards import SUFFIX, read_shard, shard_files, shard_index, write_shard


def main(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "meta.json")) as f:
        meta = json.load(f)
    vocab = int(meta.get("vocab_size") or 1 << 16)
    have = {shard_index(f) for f in shard_files(dst)}
    n = 0
    for fn in shard_files(src):
        i = shard_index(fn)
        if i in have:
            continue
        d, m = read_shard(fn, ("tokens", "offsets", "loss_mask", "job_ids"))
        if int(d["tokens"].max()) >= 1 << 16:
            vocab = 1 << 31
        write_shard(dst, i, d, m, vocab)
        n += 1
    for name in ("meta.json", "progress.json", "DATACARD.md"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    size = sum(os.path.getsize(f) for f in shard_files(dst) if f.endswith(SUFFIX))
    print(f"{n} shards packed into {dst}; {len(shard_files(dst))} shards, {size / 1e6:.1f} MB compressed")


if __name__ == "__main__":
    main(*sys.argv[1:3])
