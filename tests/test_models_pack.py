"""models_pack: the download stage's model folders packed into a plain tar (or parts), unpacked on a box with no
hub or registry, every file checked against its sha256; the download stage then uses them as they are. No engine:
small folders built here, marked the way the download stage marks its builds."""
import json

import pytest

import models_pack
from serving import model_store

# a catalog entry whose package is not installed anywhere: the unpacked folder must be enough
SPEC = {"source": "pypi-gguf", "package": "ladder-no-such-package==0.0.1", "gguf": "m.gguf",
        "gguf_sha256": "0" * 64, "dtype": "bfloat16"}
QUANT = {"source": "quantize", "from": "tiny", "scheme": "W4A16", "group_size": 32, "symmetric": False}
CATALOG = {"tiny": SPEC, "tiny-w4a16": QUANT}


def build(store, name, spec, weights: bytes) -> dict:
    folder = store / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "name": name}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "sub").mkdir()
    (folder / "sub" / "tokenizer.json").write_text("{}")
    info = model_store.finish(folder, spec, {"id": f"test:{name}", "revision": "r1"})
    return {"name": name, "source": spec["source"], "path": str(folder), "id": info["id"],
            "revision": info["revision"], "sha256": info["sha256"]}


@pytest.fixture
def src(tmp_path):
    """A store with two built models and the manifest the download stage would have written."""
    store = tmp_path / "src-store"
    models = {"tiny": build(store, "tiny", SPEC, b"WEIGHTS-A" * 40000),
              "tiny-w4a16": build(store, "tiny-w4a16", QUANT, b"PACKED-B" * 20000),
              "hub": {"name": "hub", "source": "hf", "path": str(tmp_path / "hf-cache"), "id": "org/m",
                      "revision": "abc", "sha256": "abc"}}
    manifest = tmp_path / "models.json"
    manifest.write_text(json.dumps({"store": str(store), "models": models}))
    return manifest, store


def test_round_trip_in_parts_and_the_download_stage_takes_the_folders_without_the_package(src, tmp_path, capsys):
    manifest, store = src
    parts = models_pack.pack(manifest, tmp_path / "out" / "m.tar", part_mb=0.1)
    assert [p.name for p in parts] == [f"m.tar.{i:03d}-of-{len(parts):03d}" for i in range(1, len(parts) + 1)]
    assert len(parts) >= 5 and all(p.stat().st_size <= 0.1 * 2**20 for p in parts)
    assert "hub: skipped: source hf" in capsys.readouterr().out  # only the download stage's own builds travel
    dest = tmp_path / "air-gapped-store"
    got = models_pack.unpack(parts[2], dest)  # any part names the archive
    assert set(got) == {"tiny", "tiny-w4a16"}
    for name in got:
        assert model_store.tree_hashes(dest / name) == model_store.tree_hashes(store / name)
    done = {}
    entry = model_store.provide("tiny-w4a16", CATALOG, dest, done)  # verified: neither rebuilt nor its source asked
    assert entry["path"] == str(dest / "tiny-w4a16") and entry["sha256"] == got["tiny-w4a16"]["sha256"]
    assert model_store.provide("tiny", CATALOG, dest, done)["id"] == "test:tiny"
    with pytest.raises(model_store.ModelError, match=r"ladder-no-such-package==0.0.1 is not installed and .* holds no "
                                                  r"verified build of it; .*make unpack-models"):
        model_store.provide("tiny", CATALOG, tmp_path / "empty-store", {})


def test_the_archive_is_reproducible_and_one_file_without_part_mb(src, tmp_path):
    manifest, _ = src
    a = models_pack.pack(manifest, tmp_path / "a" / "m.tar")
    b = models_pack.pack(manifest, tmp_path / "b" / "m.tar", only=["tiny", "tiny-w4a16"])
    assert [p.name for p in a] == ["m.tar"]
    assert a[0].read_bytes() == b[0].read_bytes()
    assert (tmp_path / "a" / "m.tar.sha256").read_text() == (tmp_path / "b" / "m.tar.sha256").read_text()


def corrupt(path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    i = data.index(needle)
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_file_is_refused_naming_it_and_its_hash(src, tmp_path):
    manifest, store = src
    (tar,) = models_pack.pack(manifest, tmp_path / "m.tar")
    corrupt(tar, b"PACKED-B")
    # with the archive's .sha256 beside it: the damaged archive is named before anything is unpacked
    with pytest.raises(models_pack.PackError, match=r"m\.tar: sha256 [0-9a-f]{64}, expected [0-9a-f]{64} "
                                                    r"\(m\.tar\.sha256\); the file was damaged in transfer"):
        models_pack.unpack(tar, tmp_path / "dest")
    # without it: the file inside, with the hash it has and the one the manifest says
    (tmp_path / "m.tar.sha256").unlink()
    want = json.loads((store / "tiny-w4a16" / model_store.MARKER).read_text())["files"]["model.safetensors"]
    with pytest.raises(models_pack.PackError) as e:
        models_pack.unpack(tar, tmp_path / "dest")
    assert "tiny-w4a16/model.safetensors: sha256 " in str(e.value) and f"expected {want}" in str(e.value)
    assert "corrupt" in str(e.value)
    assert not (tmp_path / "dest" / "tiny").exists()  # nothing moved in: every file is checked first
    assert [p.name for p in (tmp_path / "dest").iterdir()] == []


def test_a_missing_or_truncated_part_is_refused(src, tmp_path):
    manifest, _ = src
    parts = models_pack.pack(manifest, tmp_path / "m.tar", part_mb=0.1)
    n = len(parts)
    parts[1].unlink()
    with pytest.raises(models_pack.PackError, match=rf"part m\.tar\.002-of-{n:03d} is missing \({n - 1} of {n} "):
        models_pack.unpack(tmp_path / "m.tar", tmp_path / "dest")
    parts = models_pack.pack(manifest, tmp_path / "m.tar", part_mb=0.1)
    parts[-1].unlink()  # the last one too: the names say how many there are
    with pytest.raises(models_pack.PackError, match=rf"part m\.tar\.{n:03d}-of-{n:03d} is missing"):
        models_pack.unpack(tmp_path / "m.tar", tmp_path / "dest")
    parts = models_pack.pack(manifest, tmp_path / "m.tar", part_mb=0.1)
    parts[-2].write_bytes(parts[-2].read_bytes()[:1000])
    (tmp_path / "m.tar.sha256").unlink()
    with pytest.raises(models_pack.PackError, match="not a whole tar .* a part is truncated"):
        models_pack.unpack(tmp_path / "m.tar", tmp_path / "dest")


def test_pack_refuses_a_damaged_store_and_leaves_no_archive(src, tmp_path):
    manifest, store = src
    corrupt(store / "tiny" / "model.safetensors", b"WEIGHTS-A")
    with pytest.raises(models_pack.PackError, match=r"tiny: file .*tiny/model\.safetensors: sha256 [0-9a-f]{64}, "
                                                    r"expected [0-9a-f]{64} .*run the download stage again"):
        models_pack.pack(manifest, tmp_path / "out" / "m.tar", part_mb=0.1)
    assert list((tmp_path / "out").iterdir()) == []
    assert models_pack.main(["pack", "--manifest", str(manifest), "--out", str(tmp_path / "m.tar"),
                             "--models", "nope"]) == 1


def test_a_part_size_that_makes_more_than_999_parts_is_refused_and_leaves_nothing(src, tmp_path):
    manifest, _ = src
    with pytest.raises(models_pack.PackError, match="PART_MB: 0.0005 MiB makes more than 999 parts"):
        models_pack.pack(manifest, tmp_path / "out" / "m.tar", part_mb=0.0005)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_tar_that_is_not_a_models_archive_is_refused(tmp_path):
    import tarfile
    (tmp_path / "x").write_text("hi")
    with tarfile.open(tmp_path / "other.tar", "w") as t:
        t.add(tmp_path / "x", arcname="../x")
    with pytest.raises(models_pack.PackError, match=r"starts with '../x', not ladder-models.json"):
        models_pack.unpack(tmp_path / "other.tar", tmp_path / "dest")


def test_unpack_says_which_models_this_params_yaml_would_not_take_as_they_are(tmp_path, capsys):
    store = tmp_path / "src-store"
    # built from another recipe than params.yaml's smollm2-135m entry, and a name its catalog lacks
    models = {"smollm2-135m": build(store, "smollm2-135m", SPEC, b"W" * 100), "tiny": build(store, "tiny", SPEC, b"T")}
    manifest = tmp_path / "models.json"
    manifest.write_text(json.dumps({"store": str(store), "models": models}))
    models_pack.pack(manifest, tmp_path / "m.tar")
    assert models_pack.main(["unpack", str(tmp_path / "m.tar"), "--store", str(tmp_path / "dest")]) == 0
    out = capsys.readouterr().out
    assert ("unpack: note: smollm2-135m: download.catalog.smollm2-135m here is not the recipe it was built with: "
            "the download stage will rebuild it") in out
    assert "unpack: note: tiny: not in download.catalog of params.yaml" in out
    assert (tmp_path / "dest" / "smollm2-135m" / "model.safetensors").read_bytes() == b"W" * 100
