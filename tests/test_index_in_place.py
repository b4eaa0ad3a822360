"""WebDataset sets made by other tools, indexed in place (data_prep/index_shards.py): brace
patterns, labels from a field or a JSON key, manifests kept apart from read-only shards, and a
pretraining from such a set that matches one from the same samples sharded by make_shards."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from conftest import run_cli
from PIL import Image
from test_train_e2e import overrides

from ssl_vit.data.manifest import ManifestError, load_manifest
from ssl_vit.data.shard_verify import verify_shard_set
from ssl_vit.data.stream import make_eval_loader
from ssl_vit.data.tar_reader import iter_samples
from ssl_vit.data.urls import expand_braces, split_pattern

NAMES = ["cat", "dog", "eel"]


def shardwriter_set(folder: Path, n: int = 90, per_shard: int = 40, fmt: str = "JPEG") -> Path:
    """A set as webdataset's ShardWriter writes it: jpg + cls + json + txt per sample."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(folder / "data-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for i in range(n):
            img = Image.fromarray(rng.integers(0, 255, (12, 14, 3), dtype=np.uint8))
            buf = io.BytesIO()
            img.save(buf, format=fmt)
            meta = {"label": NAMES[i % 3], "id": i}
            w.write({"__key__": f"s{i:05d}", "jpg": buf.getvalue(), "cls": b"%d" % (i % 3),
                     "json": json.dumps(meta).encode(), "txt": b"a caption"})  # fmt: skip
    return folder


def index(*args: str) -> tuple[int, str]:
    proc = run_cli(["data_prep/index_shards.py", "--workers", "2", *args], timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def labels_of(root: str, split: str = "train") -> list[int]:
    batches = make_eval_loader(root, split, batch_size=32, img_size=8, num_workers=0)
    return [int(y) for _, y in batches for y in y]


def test_brace_patterns_expand_as_webdataset_tools_do() -> None:
    assert expand_braces("d-{000..002}.tar") == ["d-000.tar", "d-001.tar", "d-002.tar"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    assert expand_braces("x{0..10..5}") == ["x0", "x5", "x10"]
    assert split_pattern("s3://b/set/{0..1}.tar") == ("s3://b/set", ["0.tar", "1.tar"])
    assert split_pattern("/data/set") is None
    assert split_pattern("pipe:cat /data/{}") is None  # a pipe's {} is its placeholder
    for bad in ("a{0..3", "a{x}", "a{0..99999999}", "/d/{a,b}/x.tar"):
        with pytest.raises(ValueError, match="brace|name|range|folder"):
            split_pattern("/set/" + bad) if bad.startswith("/d") else expand_braces(bad)


def test_a_shardwriter_set_is_indexed_in_place_and_verifies(tmp_path) -> None:
    src = shardwriter_set(tmp_path / "set")
    rc, out = index(str(src), "--index-every", "7")
    assert rc == 0, out
    m = load_manifest(src)
    assert m.indexed and m.layout.label == "cls" and m.class_names == ["0", "1", "2"]
    assert [s.name for s in m.splits["train"].shards] == [
        "data-000000.tar", "data-000001.tar", "data-000002.tar"]  # fmt: skip
    assert m.splits["train"].num_samples == 90 and m.channels == 3 and m.image_size == [12, 14]
    report = verify_shard_set(src)  # sizes, sha256, offsets, block checksums, labels
    assert report.ok, report.problems
    assert labels_of(str(src)) == [i % 3 for i in range(90)]
    # the shards were not touched, and nothing was left beside them but the manifest
    assert sorted(p.name for p in src.iterdir()) == [
        "data-000000.tar", "data-000001.tar", "data-000002.tar", "manifest.json"]  # fmt: skip


def test_json_labels_class_names_and_a_set_without_labels(tmp_path) -> None:
    src = shardwriter_set(tmp_path / "set")
    rc, out = index(str(src), "--label", "json:label")
    assert rc == 0, out
    m = load_manifest(src)
    assert m.class_names == NAMES and m.layout.label == "json:label"
    assert labels_of(str(src)) == [i % 3 for i in range(90)]
    names = tmp_path / "names.txt"
    names.write_text("eel\ndog\ncat\n")
    assert index(str(src), "--label", "json:label", "--class-names", str(names))[0] == 0
    assert labels_of(str(src)) == [2 - i % 3 for i in range(90)]
    assert index(str(src), "--label", "none")[0] == 0
    m = load_manifest(src)
    assert m.class_names is None and labels_of(str(src)) == [-1] * 90
    rc, out = index(str(src), "--label", "json:label", "--class-names", str(tmp_path / "none"))
    assert rc == 1 and "none" in out and "Traceback" not in out


def test_a_read_only_set_keeps_its_manifest_apart_and_patterns_pick_shards(tmp_path) -> None:
    src = shardwriter_set(tmp_path / "set")
    src.chmod(0o555)  # read-only: a manifest can only go elsewhere
    try:
        pattern = str(src / "data-{000000..000001}.tar")
        rc, out = index(f"train={pattern}", f"val={src}/data-000002.tar", "--out",
                        str(tmp_path / "idx"))  # fmt: skip
    finally:
        src.chmod(0o755)
    assert rc == 0, out
    apart = str(tmp_path / "idx" / "manifest.json")
    m = load_manifest(apart)
    assert m.shards_root == str(src) and m.root == str(src) and set(m.splits) == {"train", "val"}
    assert len(labels_of(apart, "val")) == 10 and verify_shard_set(apart).ok
    # a pattern as the root: the manifest beside the shards, reduced to the ones it names
    assert index(str(src))[0] == 0
    sub = load_manifest(str(src / "data-{000001..000002}.tar"))
    assert [s.name for s in sub.splits["train"].shards] == ["data-000001.tar", "data-000002.tar"]
    assert sub.sha256 != load_manifest(src).sha256  # features cached per subset
    assert len(labels_of(str(src / "data-{000001..000002}.tar"))) == 50
    with pytest.raises(
        ManifestError, match=r"data-000003.tar is not listed .*7 of the pattern.*index_shards"
    ):
        load_manifest(str(src / "data-{000000..000009}.tar"))


def test_manifests_kept_apart_cannot_point_at_pipes_or_other_places(tmp_path) -> None:
    src = shardwriter_set(tmp_path / "set", n=20)
    assert index(str(src), "--out", str(tmp_path / "idx"))[0] == 0
    path = tmp_path / "idx" / "manifest.json"
    good = json.loads(path.read_text())
    for bad, word in (("pipe:sh -c 'touch x' {}", "not a path or a URL"),
                      ("relative/folder", "not an absolute path"),
                      ("ftp://host/set", "not a path or a URL")):  # fmt: skip
        path.write_text(json.dumps({**good, "shards_root": bad}))
        with pytest.raises(ManifestError, match=f"shards_root.*{word}"):
            load_manifest(path)
    # an indexed set keeps any plain name, but never a folder part or a leading dot
    for name in ("../secret.tar", ".hidden.tar", "a/b.tar", "x.txt"):
        listing = json.loads(json.dumps(good))
        listing["splits"]["train"]["shards"][0]["name"] = name
        path.write_text(json.dumps(listing))
        with pytest.raises(ManifestError, match="plain file names ending in .tar"):
            load_manifest(path)


def test_bad_sources_fail_in_one_line_and_a_rerun_reads_only_the_rest(tmp_path) -> None:
    src = shardwriter_set(tmp_path / "set")
    shard = src / "data-000002.tar"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    rc, out = index(str(src))
    assert rc == 1 and "data-000002.tar" in out and "Traceback" not in out
    assert not (src / "manifest.json").exists()  # nothing a reader would trust
    shard.write_bytes(whole)
    rc, out = index(str(src))
    assert rc == 0 and "2 shards done before, 1 to read" in out, out
    assert not (src / ".index-work").exists()
    for args, word in (([str(tmp_path / "absent")], "not found"),
                       (["http://127.0.0.1:9/set"], "brace pattern"),
                       (["pipe:cat {}"], "pipe"),
                       ([str(src), "--label", "a b"], "--label")):  # fmt: skip
        rc, out = index(*args)
        assert rc == 1 and word in out and "Traceback" not in out, out
    made = tmp_path / "made"
    made.mkdir()
    (made / "manifest.json").write_text('{"format": "ssl-vit-shards"}')
    shutil.copy(shard, made / "x.tar")
    rc, out = index(str(made))
    assert rc == 1 and "not written by data_prep/index_shards.py" in out


def rewrite_with_shardwriter(shards: Path, out: Path) -> None:
    """The samples of a make_shards set, in order and shard by shard, as another tool would
    have written them: webdataset's ShardWriter, its own names, labels in a JSON key too."""
    out.mkdir()
    m = load_manifest(shards)
    for split, info in m.splits.items():
        pattern = str(out / f"{split[:2]}-%04d.tar")
        with wds.ShardWriter(pattern, maxcount=info.shards[0].num_samples, verbose=0) as w:
            for sh in info.shards:
                for s in iter_samples(shards / sh.name):
                    label = int(s["cls"])
                    w.write({"__key__": s["__key__"], "png": s["png"],
                             "json": json.dumps({"y": m.class_names[label]}).encode()})  # fmt: skip


@pytest.mark.slow
def test_pretraining_from_an_indexed_set_over_http_matches_make_shards(
    tiny_shards, tmp_path, serve_http
) -> None:
    """The same samples, written by webdataset and indexed in place with the manifest kept
    apart, served by a web server and named by brace patterns, pretrain to the same losses
    and kNN accuracy as the make_shards set they came from."""
    wds_dir = tmp_path / "wds"
    rewrite_with_shardwriter(tiny_shards, wds_dir)
    server = serve_http(wds_dir)
    names = tmp_path / "names.txt"
    names.write_text("\n".join(load_manifest(tiny_shards).class_names) + "\n")
    every = str(load_manifest(tiny_shards).index_every)
    rc, out = index(f"train={server.url}/tr-{{0000..0003}}.tar", f"test={server.url}/te-0000.tar",
                    "--out", str(tmp_path / "idx"), "--label", "json:y", "--class-names",
                    str(names), "--stats-every", "1", "--index-every", every)  # fmt: skip
    assert rc == 0, out
    indexed = load_manifest(tmp_path / "idx" / "manifest.json")
    original = load_manifest(tiny_shards)
    assert (indexed.mean, indexed.std, indexed.channels) == (original.mean, original.std, 1)
    results = {}
    for name, root in (
        ("made", str(tiny_shards)),
        ("indexed", str(tmp_path / "idx" / "manifest.json")),
    ):
        run = tmp_path / name
        args = overrides(root, run, tmp_path / f"{name}.db", "train.steps=6",  # type: ignore[arg-type]
                         "data.in_memory=false", "train.compile=false")  # fmt: skip
        proc = run_cli(["pipelines/mpp_pretrain.py", *args])
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        knn = run_cli(["evals/knn.py", "--backbone", str(run), "--data", root, "--k", "5",
                       "--out", str(run / "knn.json"), "--tracking-uri",
                       f"sqlite:///{tmp_path / name}.db"])  # fmt: skip
        assert knn.returncode == 0, knn.stderr[-3000:]
        top1 = {k: v for k, v in json.loads((run / "knn.json").read_text())["metrics"].items()
                if k.startswith("knn_top1")}  # fmt: skip
        results[name] = ([r["train/loss"] for r in rows], top1)
    assert results["indexed"][0] == pytest.approx(results["made"][0], rel=1e-5)
    assert results["indexed"][1] == results["made"][1] and results["made"][1]
    assert sum(n for p, n in server.bytes_sent.items() if p.startswith("tr-")) > 0


def test_a_set_in_a_bucket_or_named_by_a_list_file_is_indexed_where_it_is(tmp_path, s3) -> None:
    """A bucket prefix is listed for its shards; a list file names them (paths relative to
    it); both give the manifest the folder on disk gives."""
    src = shardwriter_set(tmp_path / "set")
    s3.upload_folder(src, "s3://corpora/set")
    listing = tmp_path / "shards.txt"
    listing.write_text("# the set\nset/data-000000.tar\nset/data-000001.tar\nset/data-000002.tar\n")
    assert index(str(src), "--out", str(tmp_path / "disk"))[0] == 0
    for source, out in (("s3://corpora/set", "bucket"), (str(listing), "list")):
        rc, text = index(source, "--out", str(tmp_path / out))
        assert rc == 0, text
        m = load_manifest(tmp_path / out / "manifest.json")
        disk = load_manifest(tmp_path / "disk" / "manifest.json")
        assert m.splits == disk.splits and m.mean == disk.mean
        assert m.shards_root == ("s3://corpora/set" if out == "bucket" else str(src))
    assert labels_of(str(tmp_path / "bucket" / "manifest.json")) == [i % 3 for i in range(90)]
    listing.write_text("set/data-000000.tar\nelsewhere/data-000001.tar\n")
    rc, text = index(str(listing), "--out", str(tmp_path / "two"))
    assert rc == 1 and "2 folders" in text and "Traceback" not in text
