"""The label-scarce study's subsets command on a real shard set: labels read in manifest order,
class-balanced draws that training accepts as data.subset_file, subsets.json naming them."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from conftest import run_cli

from ssl_vit.data.holdout import held_out_indices, read_subset_file
from ssl_vit.data.manifest import load_manifest
from ssl_vit.data.tar_reader import iter_samples
from studies.mpp_label_scarce.subsets import class_balanced_subset, split_labels


def test_subsets_command_writes_balanced_files_training_accepts(tiny_shards, tmp_path):
    shards = load_manifest(tiny_shards).split("train").shards
    labels = np.array([int(s["cls"]) for sh in shards for s in iter_samples(tiny_shards / sh.name)])
    np.testing.assert_array_equal(split_labels(str(tiny_shards)), labels)  # manifest order

    out = tmp_path / "subsets"
    proc = run_cli(["studies/mpp_label_scarce/subsets.py", "--data", str(tiny_shards),
                    "--out", str(out), "--pilot", "6", "0", "--per-class", "2", "5",
                    "--seeds", "1", "2"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "subsets.json").read_text())
    assert index["num_samples"] == 512 and index["holdout_fraction"] == 0.02
    held = held_out_indices(512, 0.02)
    assert index["held_out"] == len(held)
    by_name = {f["file"]: f for f in index["subsets"]}
    assert set(by_name) == {"n6_seed0.json", "n2_seed1.json", "n2_seed2.json", "n5_seed1.json",
                            "n5_seed2.json"}  # fmt: skip
    pilot = read_subset_file(out / "n6_seed0.json", 512, 0.02)  # training takes each file
    assert by_name["n6_seed0.json"]["role"] == "pilot"
    np.testing.assert_array_equal(pilot, class_balanced_subset(labels, 6, 0, exclude=held))
    for name, f in by_name.items():
        idx = read_subset_file(out / name, 512, 0.02)
        n = f["per_class"]
        assert f["count"] == len(idx) == 4 * n
        assert f["class_counts"] == {str(c): n for c in range(4)}
        assert np.array_equal(np.bincount(labels[idx], minlength=4), np.full(4, n))
        assert f["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
        if f["role"] == "evaluated":
            assert not np.intersect1d(idx, pilot).size  # never the pilot's images
            want = class_balanced_subset(labels, n, f["seed"], np.union1d(held, pilot))
            np.testing.assert_array_equal(idx, want)
    assert not np.array_equal(
        read_subset_file(out / "n5_seed1.json", 512, 0.02),
        read_subset_file(out / "n5_seed2.json", 512, 0.02),
    )

    again = tmp_path / "again"  # the same command draws the same files
    assert run_cli(["studies/mpp_label_scarce/subsets.py", "--data", str(tiny_shards),
                    "--out", str(again), "--pilot", "6", "0", "--per-class", "2", "5",
                    "--seeds", "1", "2"]).returncode == 0  # fmt: skip
    for name in by_name:
        assert (again / name).read_bytes() == (out / name).read_bytes()

    proc = run_cli(["studies/mpp_label_scarce/subsets.py", "--data", str(tiny_shards),
                    "--out", str(tmp_path / "big"), "--per-class", "200"])  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "eligible images, 200 asked" in lines[0], proc.stderr
