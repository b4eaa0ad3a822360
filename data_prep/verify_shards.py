"""Check a shard set against its manifest.json; exit 1 on any mismatch. See --help."""

from __future__ import annotations

import argparse
import sys

from ssl_vit.data.manifest import ManifestError
from ssl_vit.data.shard_verify import add_block_checksums, verify_shard_set


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="verify_shards.py",
        description="Verify a shard set made by data_prep/make_shards.py or indexed by "
        "data_prep/index_shards.py: every shard's size, sha256, block checksums, sample count "
        "and labels against its manifest, one decoded image per shard (channels and size), and "
        "errors.jsonl against num_skipped; for a web server, whether it answers Range "
        "requests. Prints a summary; exits 1 on any mismatch.",
    )
    p.add_argument(
        "root",
        help="the shard set: a folder or URL holding manifest.json "
        "(http(s)://, s3://, gs://, file://, 'pipe:CMD {}'), a manifest file kept apart from "
        "its shards, or a brace pattern naming some of them",
    )
    p.add_argument("--no-decode", action="store_true", help="skip decoding a sample per shard")
    p.add_argument(
        "--add-block-checksums",
        action="store_true",
        help="once the set verifies, record the block checksums that readers check every read "
        "against in its manifest (a local set made before they existed)",
    )
    a = p.parse_args(argv)
    report = verify_shard_set(a.root, decode=not a.no_decode)
    for line in report.lines:
        print(line)
    for w in report.warnings:
        print(f"warning: {w}")
    for problem in report.problems:
        print(f"verify_shards.py: error: {a.root}: {problem}", file=sys.stderr)
    print(f"{a.root}: {'OK' if report.ok else f'FAILED ({len(report.problems)} problems)'}")
    if report.ok and a.add_block_checksums:
        try:
            added = add_block_checksums(a.root)
        except ManifestError as e:
            print(f"verify_shards.py: error: {e}", file=sys.stderr)
            return 1
        print(f"{a.root}: block checksums added for {added} shards")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
