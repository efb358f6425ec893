"""`make pack-models` / `make unpack-models`: move the download stage's model folders to a box with no hub or registry.

pack    writes the folders results/models.json lists (built by the download stage in download.store) into ONE plain
        tar: bf16 weights do not compress (zstd -19 gained nothing on SmolLM2 and took 2.5 min). Its first member,
        ladder-models.json, is the manifest: each model's files and their sha256 (the folder's own marker's).
        --part-mb N splits it into parts of at most N MiB (ARCHIVE.001-of-004, ...) for transfer paths that limit a
        file's size. Beside it, ARCHIVE.sha256 (`sha256sum -c` format) hashes the archive or each part.
unpack  reads the archive or its parts (all present, in order, each matching ARCHIVE.sha256 where it came along),
        checks every file's sha256 against the manifest, then moves each folder into download.store; the download
        stage then finds them verified (their .ladder-model.json) and uses them as they are: no package, no hub.
The archive is byte-for-byte reproducible (fixed order, times and owners): the same models pack to the same hash.

  python scripts/models_pack.py pack [--manifest results/models.json] [--out ladder-models.tar] [--part-mb N]
                                     [--models a,b]
  python scripts/models_pack.py unpack ARCHIVE [--store DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import common
import config
from records.models import ModelsManifest
from serving import model_store

MANIFEST = "ladder-models.json"
FORMAT = 1
BUILT = ("pypi-gguf", "quantize", "shape")  # sources whose folders the download stage builds in download.store
_PART = re.compile(r"\.(\d{3})-of-(\d{3})$")


class PackError(RuntimeError):
    pass


# ---------------------------------------------------------------- parts: one stream over many files
class PartWriter(io.RawIOBase):
    """A write stream cut into files of at most `part_bytes` (None: one file), each hashed as it is written."""

    def __init__(self, out: Path, part_bytes: int | None):
        self.out, self.part_bytes = out, part_bytes
        self.files: list[tuple[Path, str]] = []  # (path, sha256) of the finished files
        self._f, self._h, self._n = None, None, 0

    def writable(self) -> bool:
        return True

    def _next(self) -> None:
        if len(self.files) == 999:  # the names count parts in 3 digits
            raise PackError(f"PART_MB: {self.part_bytes / 2**20:.2g} MiB makes more than 999 parts; use a larger one")
        self._finish()
        path = self.out if self.part_bytes is None else self.out.with_name(f"{self.out.name}.part{len(self.files)}")
        self._f, self._h, self._n = open(path, "wb"), hashlib.sha256(), 0
        self._path = path

    def _finish(self) -> None:
        if self._f:
            self._f.close()
            self.files.append((self._path, self._h.hexdigest()))
            self._f = None

    def write(self, b) -> int:
        view, done = memoryview(b), 0
        while done < len(view):
            if self._f is None or (self.part_bytes and self._n >= self.part_bytes):
                self._next()
            take = len(view) - done if not self.part_bytes else min(len(view) - done, self.part_bytes - self._n)
            chunk = view[done:done + take]
            self._f.write(chunk)
            self._h.update(chunk)
            self._n += take
            done += take
        return done

    def abort(self) -> None:
        self._finish()
        for path, _ in self.files:
            path.unlink(missing_ok=True)

    def close(self) -> list[tuple[Path, str]]:
        """Finish the last file; split parts get their final names, ARCHIVE.NNN-of-MMM. Returns (path, sha256)."""
        if self._f is None and not self.files:
            self._next()
        self._finish()
        super().close()
        if self.part_bytes is None:
            return self.files
        n, named = len(self.files), []
        for i, (path, sha) in enumerate(self.files, 1):
            final = self.out.with_name(f"{self.out.name}.{i:03d}-of-{n:03d}")
            path.replace(final)
            named.append((final, sha))
        self.files = named
        return named


class PartReader(io.RawIOBase):
    """The parts read back as one stream, in order."""

    def __init__(self, parts: list[Path]):
        self.parts, self._i, self._f = parts, 0, open(parts[0], "rb")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while True:
            n = self._f.readinto(b)
            if n or self._i == len(self.parts) - 1:
                return n
            self._f.close()
            self._i += 1
            self._f = open(self.parts[self._i], "rb")

    def close(self) -> None:
        self._f.close()
        super().close()


def parts_of(archive: Path) -> tuple[Path, list[Path]]:
    """(ARCHIVE, its files): ARCHIVE itself, or every ARCHIVE.NNN-of-MMM (ARCHIVE may name the tar or any part)."""
    m = _PART.search(archive.name)
    base = archive.with_name(archive.name[:m.start()]) if m else archive
    if not m and archive.is_file():
        return base, [archive]
    found = sorted(base.parent.glob(f"{glob_escape(base.name)}.[0-9][0-9][0-9]-of-[0-9][0-9][0-9]"))
    if not found:
        raise PackError(f"ARCHIVE: {archive}: no such file, and no parts {base.name}.NNN-of-MMM beside it")
    totals = {int(_PART.search(p.name).group(2)) for p in found}
    if len(totals) > 1:
        raise PackError(f"ARCHIVE: {base}: parts of different splits lie together "
                        f"({', '.join(p.name for p in found)}); keep one split's parts only")
    total = totals.pop()
    want = [base.with_name(f"{base.name}.{i:03d}-of-{total:03d}") for i in range(1, total + 1)]
    missing = [p.name for p in want if not p.is_file()]
    if missing:
        raise PackError(f"ARCHIVE: {base}: part {', '.join(missing)} is missing ({total - len(missing)} of {total} "
                        f"parts found in {base.parent}); copy every part")
    return base, want


def glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def sums_file(base: Path) -> Path:
    return base.with_name(base.name + ".sha256")


def check_sums(parts: list[Path], base: Path) -> None:
    """Each part against ARCHIVE.sha256, where it came along: a part damaged in transfer is named before unpacking."""
    sums = sums_file(base)
    if not sums.is_file():
        print(f"unpack: no {sums.name} beside the archive: parts not checked as a whole (every file still is)")
        return
    want = {name.lstrip("*"): sha  # `sha256sum -b` marks binary mode with a star
            for sha, name in (ln.split(None, 1) for ln in sums.read_text().splitlines() if ln.strip())}
    for part in parts:
        if part.name not in want:
            raise PackError(f"{sums}: lists no sha256 for {part.name}")
        got = common.sha256_file(part)
        if got != want[part.name]:
            raise PackError(f"ARCHIVE: {part}: sha256 {got}, expected {want[part.name]} ({sums.name}); "
                            f"the file was damaged in transfer: copy it again")


# ---------------------------------------------------------------- pack
def _info(name: str, size: int, mode: int = 0o644, kind=tarfile.REGTYPE) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.type, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, mode, kind, 0, 0, 0, "", ""
    return ti


class _Hashing:
    """A file read through, hashed on the way (tar reads each member once)."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        block = self.f.read(n)
        self.h.update(block)
        return block


def packable(models_json: Path, only: list[str] | None) -> dict:
    """name -> (folder, manifest entry) of the models to pack: the download stage's own builds, as it listed them."""
    if not models_json.is_file():
        raise PackError(f"--manifest: {models_json} is missing; run the download stage first (`dvc repro download`)")
    models = ModelsManifest.load_file(models_json).entries()
    unknown = [n for n in only or [] if n not in models]
    if unknown:
        raise PackError(f"MODELS: {', '.join(unknown)} not in {models_json} ({', '.join(models)}); set the profile "
                        f"whose download.fetch lists them, then `dvc repro download`")
    out = {}
    for name in only or list(models):
        m = models[name]
        if m.get("source") not in BUILT:
            print(f"pack: {name}: skipped: source {m.get('source')}: its folder {m.get('path')} is not the "
                  f"download stage's build (copy a Hugging Face cache or your own folder as it is)")
            continue
        folder = Path(m["path"])
        marker = folder / model_store.MARKER
        if not marker.is_file():
            raise PackError(f"{name}: {marker} is missing: {folder} is not a finished build; run the download stage")
        info = common.read_json(marker)
        if info.get("sha256") != m.get("sha256") or model_store.tree_sha256(info["files"]) != info.get("sha256"):
            raise PackError(f"{name}: {models_json} lists sha256 {m.get('sha256')}, but {marker} holds "
                            f"{info.get('sha256')}; run the download stage again (`dvc repro download`)")
        out[name] = (folder, {k: m.get(k) for k in ("source", "id", "revision")} | {
            "sha256": info["sha256"], "files": info["files"]})
    if not out:
        raise PackError(f"{models_json}: no model built by the download stage to pack")
    return out


def pack(models_json: Path, out: Path, part_mb: float | None = None, only: list[str] | None = None) -> list[Path]:
    """Write the archive (or its parts) and ARCHIVE.sha256; every file is hashed as it is read and must match
    the sha256 its folder's marker recorded, so a damaged store is never shipped."""
    if part_mb is not None and part_mb <= 0:
        raise PackError(f"PART_MB: {part_mb} is not allowed; expected a size in MiB > 0")
    chosen = packable(models_json, only)
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in [out, sums_file(out), *out.parent.glob(f"{glob_escape(out.name)}.[0-9][0-9][0-9]-of-*")]:
        old.unlink(missing_ok=True)  # a part of an earlier split would be mistaken for one of this one
    writer = PartWriter(out, int(part_mb * 2**20) if part_mb else None)
    manifest = json.dumps({"format": FORMAT, "models": {n: e for n, (_, e) in chosen.items()}},
                          indent=2, sort_keys=True).encode()
    try:
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_info(MANIFEST, len(manifest)), io.BytesIO(manifest))
            for name, (folder, entry) in chosen.items():
                tar.addfile(_info(name, 0, 0o755, tarfile.DIRTYPE))
                for rel in [model_store.MARKER, *sorted(entry["files"])]:
                    path = folder / rel
                    with open(path, "rb") as f:
                        src = _Hashing(f)
                        tar.addfile(_info(f"{name}/{rel}", path.stat().st_size), src)
                    want = entry["files"].get(rel)
                    if want and src.h.hexdigest() != want:
                        raise PackError(f"{name}: file {path}: sha256 {src.h.hexdigest()}, expected {want} (its "
                                        f"{model_store.MARKER}); the store is damaged: run the download stage again")
        files = writer.close()
    except BaseException:
        writer.abort()  # no half archive is left to be copied
        raise
    common.write_text(sums_file(out), "".join(f"{sha}  {p.name}\n" for p, sha in files))
    size = sum(p.stat().st_size for p, _ in files) / 2**20
    print(f"pack: {', '.join(chosen)} -> {', '.join(str(p) for p, _ in files)} ({size:.0f} MiB"
          f"{f' in {len(files)} parts' if len(files) > 1 else ''}); hashes in {sums_file(out)}")
    return [p for p, _ in files]


# ---------------------------------------------------------------- unpack
def _member_path(ti: tarfile.TarInfo, models: dict) -> tuple[str, str] | None:
    """(model, file) a member may be, else None: only the manifest's models and files, and their markers."""
    parts = ti.name.split("/")
    if len(parts) == 1 and ti.isdir() and ti.name in models:
        return None
    if len(parts) < 2 or parts[0] not in models or any(p in ("", ".", "..") for p in parts) or not ti.isfile():
        raise PackError(f"{ti.name}: not a file of a model in {MANIFEST}; refused (is this a ladder models archive?)")
    rel = "/".join(parts[1:])
    if rel != model_store.MARKER and rel not in models[parts[0]]["files"]:
        raise PackError(f"{ti.name}: not listed in {MANIFEST}; refused")
    return parts[0], rel


def _extract(tar: tarfile.TarFile, work: Path, where: str) -> dict:
    """Every member into `work`, each file hashed as it is written; returns the manifest's models."""
    models, got = None, {}
    for ti in tar:
        if models is None:
            if ti.name != MANIFEST or not ti.isfile():
                raise PackError(f"{where}: starts with {ti.name!r}, not {MANIFEST}: not a ladder models archive")
            try:
                manifest = json.load(tar.extractfile(ti))
            except ValueError as e:
                raise PackError(f"{where}: {MANIFEST} is not JSON ({e})") from None
            if manifest.get("format") != FORMAT:
                raise PackError(f"{where}: {MANIFEST} format {manifest.get('format')!r}; this script reads {FORMAT}")
            models = manifest["models"]
            bad = [n for n in models if not re.fullmatch(r"[\w][\w.-]*", n)]
            if bad:
                raise PackError(f"{where}: {MANIFEST} names models {bad}; expected folder names ([A-Za-z0-9_.-])")
            continue
        where_to = _member_path(ti, models)
        if where_to is None:
            continue
        model, rel = where_to
        dest = work / model / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with tar.extractfile(ti) as src, open(dest, "wb") as f:
            while block := src.read(1 << 20):
                h.update(block)
                f.write(block)
        got[(model, rel)] = h.hexdigest()
    if models is None:
        raise PackError(f"{where}: empty: no {MANIFEST}")
    for model, entry in models.items():
        for rel, want in entry["files"].items():
            if (model, rel) not in got:
                raise PackError(f"{model}/{rel}: listed in {MANIFEST} but not in {where}; pack it again")
            if got[(model, rel)] != want:
                raise PackError(f"{model}/{rel}: sha256 {got[(model, rel)]}, expected {want} ({MANIFEST}); "
                                f"the file is corrupt: copy the archive again")
        marker = work / model / model_store.MARKER
        info = common.read_json(marker) if marker.is_file() else {}
        if info.get("files") != entry["files"] or model_store.tree_sha256(entry["files"]) != entry["sha256"]:
            raise PackError(f"{model}/{model_store.MARKER}: does not list the files and hashes of {MANIFEST}; "
                            f"pack it again")
    return models


def unpack(archive: Path, store: Path) -> dict:
    """Unpack into `store` (each folder replaced only once all of them verified); returns the manifest's models."""
    base, parts = parts_of(archive)
    check_sums(parts, base)
    where = base.name + (f" ({len(parts)} parts)" if len(parts) > 1 else "")
    store.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=store))  # same file system: folders move in by rename
    try:
        reader = PartReader(parts)
        try:
            with tarfile.open(fileobj=io.BufferedReader(reader, 1 << 20), mode="r|") as tar:
                models = _extract(tar, work, where)
        except (tarfile.TarError, EOFError) as e:
            raise PackError(f"{where}: not a whole tar ({e}): a part is truncated or not of this archive; "
                            f"copy it again") from None
        finally:
            reader.close()
        for name, entry in models.items():
            dest = store / name
            shutil.rmtree(dest, ignore_errors=True)
            (work / name).replace(dest)
            print(f"unpack: {name} -> {dest} ({len(entry['files'])} files, sha256 verified; "
                  f"tree {entry['sha256'][:12]})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return models


def recipe_notes(store: Path, names, catalog: dict) -> list[str]:
    """Unpacked models that this params.yaml's download.catalog would not take as they are (another recipe, or no
    entry): said at unpack time, not when the download stage would rebuild them (and need their source)."""
    notes = []
    for name in names:
        spec = catalog.get(name)
        built = common.read_json(store / name / model_store.MARKER).get("spec")
        if spec and (catalog.get(spec.get("from")) or {}).get("source") == "local":
            continue  # its recipe includes the local model's hash, known only to the download stage
        if spec is None:
            notes.append(f"{name}: not in download.catalog of params.yaml: no profile here serves it")
        elif spec.get("source") in BUILT and model_store.spec_hash(spec) != built:
            notes.append(f"{name}: download.catalog.{name} here is not the recipe it was built with: the download "
                         f"stage will rebuild it (and need its source); pack it with this params.yaml's catalog")
    return notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write the archive of the download stage's model folders")
    p.add_argument("--manifest", type=Path, default=common.RESULTS / "models.json")
    p.add_argument("--out", type=Path, default=common.ROOT / "ladder-models.tar")
    p.add_argument("--part-mb", type=float, default=None, help="split into parts of at most this many MiB")
    p.add_argument("--models", default=None, help="comma-separated names (default: every model it built)")
    u = sub.add_parser("unpack", help="unpack an archive (or its parts) into download.store, verified")
    u.add_argument("archive", type=Path)
    u.add_argument("--store", type=Path, default=None, help="default: download.store of params.yaml")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            pack(args.manifest, args.out, args.part_mb, [m for m in (args.models or "").split(",") if m] or None)
        else:
            cfg = config.section(common.read_params(), "download")
            store = args.store or model_store.store_path(cfg)
            for note in recipe_notes(store, unpack(args.archive, store), cfg["catalog"]):
                print(f"unpack: note: {note}")
    except (PackError, model_store.ModelError, common.ParamsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
