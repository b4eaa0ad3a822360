"""Source kinds (folders, list files, IDX) and image hygiene, on files written here."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from PIL import Image

from ssl_vit.data.imaging import BadImage, ImageOptions, process_bytes, process_pixels
from ssl_vit.data.sources import FASHION_MNIST_CLASSES, SourceError, open_source


def png(path: Path, color=(200, 10, 10), size=(8, 6), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return path


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if gz else open
    suffix = ".gz" if gz else ""
    n, h, w = images.shape
    with opener(folder / f"{prefix}-images-idx3-ubyte{suffix}", "wb") as f:
        f.write((0x803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, h, w)))
        f.write(images.astype(np.uint8).tobytes())
    with opener(folder / f"{prefix}-labels-idx1-ubyte{suffix}", "wb") as f:
        f.write(
            (0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.astype(np.uint8).tobytes()
        )


# ----------------------------------------------------------------------------- sources


def test_class_folders_sorted_labels_and_flat_folder(tmp_path):
    for cls in ("zebra", "ant", "mole"):
        png(tmp_path / "set" / cls / "a.png")
    png(tmp_path / "set" / "ant" / "deep" / "b.png")
    (tmp_path / "set" / "ant" / "notes.txt").write_text("not an image extension: ignored")
    listing = open_source(tmp_path / "set")
    assert listing.class_names == ["ant", "mole", "zebra"]
    got = {it.rel: it.label for it in listing.items}
    assert got == {"ant/a.png": 0, "ant/deep/b.png": 0, "mole/a.png": 1, "zebra/a.png": 2}

    png(tmp_path / "flat" / "x.png")
    png(tmp_path / "flat" / "y.png")
    flat = open_source(tmp_path / "flat")
    assert flat.class_names is None and [it.label for it in flat.items] == [None, None]


def test_split_folders_keep_their_split(tmp_path):
    png(tmp_path / "train" / "cat" / "1.png")
    png(tmp_path / "val" / "dog" / "2.png")
    listing = open_source(tmp_path)
    assert listing.class_names == ["cat", "dog"]
    assert {(it.rel, it.split, it.label) for it in listing.items} == {
        ("train/cat/1.png", "train", 0),
        ("val/dog/2.png", "val", 1),
    }


@pytest.mark.parametrize("kind", ["txt", "csv", "jsonl"])
def test_list_files(tmp_path, kind):
    png(tmp_path / "img" / "a.png")
    png(tmp_path / "img" / "b c.png")
    rows = [("img/a.png", "dog"), ("img/b c.png", "cat")]
    if kind == "txt":
        text = "# comment\n" + "".join(f"{p}\t{lab}\n" for p, lab in rows)
    elif kind == "csv":
        text = "path,label\n" + "".join(f"{p},{lab}\n" for p, lab in rows)
    else:
        text = "".join(json.dumps({"path": p, "label": lab}) + "\n" for p, lab in rows)
    (tmp_path / f"list.{kind}").write_text(text)
    listing = open_source(tmp_path / f"list.{kind}")
    assert listing.class_names == ["cat", "dog"]
    assert [(it.rel, it.label) for it in listing.items] == [("img/a.png", 1), ("img/b c.png", 0)]
    assert Path(listing.items[1].path).is_file()


def test_list_integer_labels_unlabelled_rows_and_class_names(tmp_path):
    png(tmp_path / "a.png")
    png(tmp_path / "b.png")
    (tmp_path / "l.txt").write_text("a.png 2\nb.png\n")
    listing = open_source(tmp_path / "l.txt", class_names=["x", "y", "z"])
    assert [it.label for it in listing.items] == [2, None]
    assert listing.class_names == ["x", "y", "z"]
    with pytest.raises(SourceError, match="out of range"):
        open_source(tmp_path / "l.txt", class_names=["x", "y"])
    png(tmp_path / "f" / "cat" / "a.png")
    with pytest.raises(SourceError, match="gives 2 names but the source has 1"):
        open_source(tmp_path / "f", class_names=["x", "y"])


@pytest.mark.parametrize("gz", [True, False])
def test_idx_keeps_split_and_names(tmp_path, gz):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (5, 4, 3))
    write_idx(tmp_path / "digits", "train", imgs, np.array([0, 1, 2, 3, 9]), gz)
    write_idx(tmp_path / "digits", "t10k", imgs[:2], np.array([4, 5]), gz)
    listing = open_source(tmp_path / "digits")
    assert listing.grayscale and listing.class_names == [str(i) for i in range(10)]
    assert [it.split for it in listing.items] == ["test"] * 2 + ["train"] * 5
    assert np.array_equal(listing.items[2].pixels, imgs[0])
    assert listing.items[2].key == "train_000000" and listing.items[6].label == 9
    # A folder named like Fashion-MNIST gets its class names.
    write_idx(tmp_path / "fashion-mnist", "train", imgs, np.zeros(5), gz)
    assert open_source(tmp_path / "fashion-mnist").class_names == FASHION_MNIST_CLASSES


def test_idx_prefixes_give_split_names_the_manifest_accepts(tmp_path):
    """EMNIST names its files `emnist-letters-train-...`: the split is train; a prefix that
    is no split name, or two datasets giving one split, is one line before any shard."""
    imgs = np.zeros((2, 4, 4))
    write_idx(tmp_path / "emnist", "emnist-letters-train", imgs, np.array([1, 2]), gz=True)
    write_idx(tmp_path / "emnist", "emnist-letters-test", imgs[:1], np.array([3]), gz=True)
    write_idx(tmp_path / "emnist", "extra_2", imgs[:1], np.array([0]), gz=False)
    write_idx(tmp_path / "emnist", "extra_2", imgs[:1], np.array([0]), gz=True)  # gunzip -k
    listing = open_source(tmp_path / "emnist")
    assert [it.split for it in listing.items] == ["extra_2", "test", "train", "train"]
    write_idx(tmp_path / "emnist", "emnist-digits-train", imgs, np.array([1, 2]), gz=False)
    with pytest.raises(SourceError) as caught:
        open_source(tmp_path / "emnist")
    assert str(caught.value).endswith(
        "split 'train' also comes from emnist-digits-train-images-idx3-ubyte; "
        "give make_shards one IDX dataset per folder"
    )
    write_idx(tmp_path / "odd", "my data", imgs, np.array([1, 2]), gz=False)
    with pytest.raises(SourceError, match="the IDX prefix 'my data' is not a split name"):
        open_source(tmp_path / "odd")


def test_truncated_idx_is_a_source_error(tmp_path):
    write_idx(tmp_path, "train", np.zeros((3, 4, 4)), np.zeros(3), gz=False)
    f = tmp_path / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(SourceError, match="truncated"):
        open_source(tmp_path)


def test_missing_source(tmp_path):
    with pytest.raises(SourceError, match="not found"):
        open_source(tmp_path / "nope")


# ----------------------------------------------------------------------------- hygiene

RGB = ImageOptions(mode="RGB")


def test_exif_orientation_applied():
    img = Image.new("RGB", (8, 4), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 2, 4))  # white stripe on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: display is rotated 90 degrees clockwise
    enc = process_bytes(encode(img, "JPEG", exif=exif, quality=95), RGB)
    out = decode(enc.data)
    assert out.size == (4, 8) and enc.original_size == (8, 4)  # (H, W) as displayed
    top = np.asarray(out)[:2].mean()  # the left stripe is now at the top
    assert top > 200 and np.asarray(out)[-2:].mean() < 50


def test_cmyk_palette_one_bit_become_rgb():
    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # pure red in CMYK
    out = decode(process_bytes(encode(cmyk, "JPEG", quality=95), RGB).data)
    r, g, b = np.asarray(out).reshape(-1, 3).mean(0)
    assert out.mode == "RGB" and r > 230 and g < 30 and b < 30
    pal = Image.new("RGB", (4, 4), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE)
    assert pal.mode == "P"
    out = decode(process_bytes(encode(pal, "PNG"), RGB).data)
    assert out.mode == "RGB" and tuple(int(v) for v in np.asarray(out)[0, 0]) == (10, 200, 30)
    bit = Image.new("1", (4, 4), 1)
    out = decode(process_bytes(encode(bit, "PNG"), ImageOptions(mode="L")).data)
    assert out.mode == "L" and np.asarray(out).min() == 255


def test_sixteen_bit_is_scaled_not_clipped():
    a = np.array([[0, 257 * 128, 65535, 1000]], dtype=np.uint16)
    out = decode(process_bytes(encode(Image.fromarray(a), "PNG"), ImageOptions(mode="L")).data)
    assert np.asarray(out).tolist() == [[0, 128, 255, 4]]


def test_alpha_composited_on_white():
    a = np.zeros((2, 2, 4), dtype=np.uint8)
    a[0, 0] = (255, 0, 0, 255)  # opaque red
    a[1, 1] = (0, 0, 0, 128)  # half-transparent black
    out = np.asarray(decode(process_bytes(encode(Image.fromarray(a), "PNG"), RGB).data))
    assert tuple(out[0, 0]) == (255, 0, 0)
    assert tuple(out[0, 1]) == (255, 255, 255)  # fully transparent -> white, not black
    assert 120 <= out[1, 1, 0] <= 135


def test_multi_frame_takes_first_frame():
    frames = [Image.new("L", (4, 4), v) for v in (30, 220)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    out = decode(process_bytes(buf.getvalue(), ImageOptions(mode="L")).data)
    assert abs(int(np.asarray(out).mean()) - 30) <= 1


def test_max_pixels_guard():
    data = encode(Image.new("L", (100, 100)), "PNG")
    with pytest.raises(BadImage, match="max-pixels"):
        process_bytes(data, ImageOptions(mode="L", max_pixels=9999))
    assert process_bytes(data, ImageOptions(mode="L", max_pixels=10000)).size == (100, 100)


@pytest.mark.parametrize(
    "how,size,expected",
    [("shorter", 10, (10, 20)), ("longer", 10, (5, 10)), ("center-crop", 10, (10, 10))],
)
def test_resize_modes(how, size, expected):
    img = Image.new("RGB", (40, 20), (5, 5, 5))
    enc = process_bytes(encode(img, "PNG"), ImageOptions(mode="RGB", resize=how, size=size))
    assert enc.size == expected and decode(enc.data).size == expected[::-1]
    assert enc.original_size == (20, 40)


def test_center_crop_keeps_the_middle():
    a = np.zeros((10, 30, 3), dtype=np.uint8)
    a[:, 10:20] = 255  # the middle third is white
    enc = process_bytes(encode(Image.fromarray(a), "PNG"), ImageOptions("RGB", "center-crop", 10))
    assert np.asarray(decode(enc.data)).mean() > 250


def test_encodings_and_keep_original():
    img = Image.new("RGB", (16, 16), (40, 80, 120))
    jpg = encode(img, "JPEG", quality=90)
    kept = process_bytes(jpg, ImageOptions(mode="RGB"))
    assert kept.data == jpg and kept.ext == "jpg"  # nothing to fix: original bytes
    for fmt, ext in (("png", "png"), ("jpg", "jpg"), ("webp", "webp")):
        enc = process_bytes(jpg, ImageOptions(mode="RGB", fmt=fmt, quality=80))
        assert enc.ext == ext and decode(enc.data).format == {"jpg": "JPEG"}.get(ext, ext.upper())
    lo = process_bytes(jpg, ImageOptions(mode="RGB", fmt="jpg", quality=5)).data
    hi = process_bytes(jpg, ImageOptions(mode="RGB", fmt="jpg", quality=100)).data
    assert len(lo) < len(hi)
    # A grayscale JPEG stored as RGB must be re-encoded (same format) rather than kept.
    gray = encode(Image.new("L", (8, 8), 90), "JPEG")
    enc = process_bytes(gray, ImageOptions(mode="RGB"))
    assert enc.data != gray and enc.ext == "jpg" and decode(enc.data).mode == "RGB"


def test_pixels_png_and_stats():
    a = np.array([[0, 255], [10, 20]], dtype=np.uint8)
    enc = process_pixels(a, ImageOptions(mode="L"), want_stats=True)
    assert enc.ext == "png" and np.array_equal(np.asarray(decode(enc.data)), a)
    expected = [0] * 256
    for v in (0, 255, 10, 20):
        expected[v] += 1
    assert enc.histogram == expected


def test_make_shards_reads_a_folder_in_object_storage_where_it_is(tmp_path, s3, serve_http):
    """An image folder in a bucket shards as the same folder on disk does (byte-identical
    shards), with no copy first; a web server without a listing is refused in one line."""
    from test_shard_index import corpus

    src = corpus(tmp_path / "photos", 30)
    s3.upload_folder(src, "s3://corpora/photos")
    local, remote = tmp_path / "local", tmp_path / "remote"
    for source, out in ((str(src), local), ("s3://corpora/photos", remote)):
        proc = run_cli(["data_prep/make_shards.py", source, str(out), "--workers", "2",
                        "--shard-size", "8"])  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    tars = sorted(p.name for p in local.glob("*.tar"))
    assert tars and tars == sorted(p.name for p in remote.glob("*.tar"))
    assert all((local / t).read_bytes() == (remote / t).read_bytes() for t in tars)
    made = json.loads((remote / "manifest.json").read_text())["created_by"]
    assert made["source"] == "s3://corpora/photos"
    server = serve_http(src)  # serves files, but no listing a crawler could follow
    proc = run_cli(["data_prep/make_shards.py", server.url, str(tmp_path / "web")])
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _images_and_labels(folder: Path) -> list[tuple[bytes, bytes]]:
    from ssl_vit.data.tar_reader import iter_samples

    return sorted(
        (s["png"], s["cls"]) for t in sorted(folder.glob("*.tar")) for s in iter_samples(t)
    )


def test_make_shards_reshards_a_webdataset_set_from_a_folder_bucket_or_pattern(
    tmp_path, s3, serve_http
):
    """An existing shard set is a source too (to re-shard or resize): the same images and
    labels come out, byte-identical from a folder, a bucket and a brace pattern over http."""
    from test_shard_index import corpus

    made = tmp_path / "made"
    proc = run_cli(["data_prep/make_shards.py", str(corpus(tmp_path / "photos", 30)), str(made),
                    "--shard-size", "8", "--workers", "1"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    s3.upload_folder(made, "s3://corpora/made")
    server = serve_http(made)
    shards = sorted(p.name for p in made.glob("train-*.tar"))
    pattern = f"{server.url}/train-{{000000..{len(shards) - 1:06d}}}.tar"
    outs = {}
    for name, source in (("folder", str(made)), ("bucket", "s3://corpora/made"),
                         ("pattern", pattern)):  # fmt: skip
        out = outs[name] = tmp_path / name
        proc = run_cli(["data_prep/make_shards.py", source, str(out), "--shard-size", "5",
                        "--workers", "2"])  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert _images_and_labels(outs["folder"]) == _images_and_labels(made)
    tars = sorted(p.name for p in outs["folder"].glob("*.tar"))
    assert len(tars) == 6  # 30 samples, 5 per shard
    for name in ("bucket", "pattern"):
        assert [(outs[name] / t).read_bytes() for t in tars] == [
            (outs["folder"] / t).read_bytes() for t in tars
        ]


def test_make_shards_reads_a_list_file_of_image_urls(tmp_path, serve_http):
    """A list file of images on a web server (at a URL, paths relative to it) shards as the
    same list read from disk."""
    from test_shard_index import corpus

    src = corpus(tmp_path / "photos", 12)
    rows = sorted(str(p.relative_to(src)) for p in src.rglob("*.png"))
    (src / "list.txt").write_text("".join(f"{r}\t{r.split('/')[0]}\n" for r in rows))
    server = serve_http(src)
    outs = []
    for source in (str(src / "list.txt"), f"{server.url}/list.txt"):
        outs.append(tmp_path / f"out{len(outs)}")
        proc = run_cli(["data_prep/make_shards.py", source, str(outs[-1]), "--workers", "1"])
        assert proc.returncode == 0, proc.stderr
    assert _images_and_labels(outs[0]) == _images_and_labels(outs[1])
    assert len(_images_and_labels(outs[1])) == 12
    # a list read from a server is data: it may not leave its folder nor open a bucket
    with open(src / "list.txt", "a") as f:
        f.write(f"../{src.name}/{rows[0]}\tclass0\ns3://bucket/x.png\tclass0\n")
    proc = run_cli(["data_prep/make_shards.py", f"{server.url}/list.txt", str(tmp_path / "o3")])
    assert proc.returncode == 0, proc.stderr
    errors = (tmp_path / "o3" / "errors.jsonl").read_text().splitlines()
    assert len(errors) == 2 and all("names only http(s) URLs" in e for e in errors)
