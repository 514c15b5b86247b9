"""`phalanx snapshots DIR|URL`: the snapshots a job would resume from, newest first,
each verified (its seal under the job's key, every file's size and SHA-256) unless
`--no-verify`. The job's token comes as for `phalanx run` (`--token`,
`--token-file`, PHALANX_TOKEN, PHALANX_TOKEN_FILE); a snapshot another job sealed, or
this one before its token changed, is listed as such and never counted.

Exit status: 0 when the newest snapshot verifies (the one a resume would load), 1
when there is none or none verifies, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import os
import time

from phalanx.snapshots.catalog import DamagedSnapshotError, newest_first
from phalanx.snapshots.resume import read, verify
from phalanx.snapshots.seal import SnapshotKey
from phalanx.snapshots.storage import Storage


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="phalanx snapshots",
        description="List a job's snapshots, newest first, and verify them: the first that "
        "verifies is the one a job whose every group was lost resumes from.",
    )
    parser.add_argument("location", metavar="DIR|URL", help="the job's --snapshot-dir")
    parser.add_argument("--no-verify", action="store_true", help="check the seals only (quick)")
    parser.add_argument("--token", help="the job's token (default: PHALANX_TOKEN)")
    parser.add_argument("--token-file", help="a file holding the job's token")
    args = parser.parse_args(argv)
    from phalanx.token import resolve_token

    try:
        token = resolve_token(args.token, args.token_file, os.environ)
        storage = Storage.at(args.location, create=False)
    except (FileNotFoundError, ValueError) as e:
        print(e)
        return 1
    key = SnapshotKey.of(token)
    if not key.authenticated:
        print(
            "no job token given (--token-file, PHALANX_TOKEN): only the snapshots of a job "
            "without a token verify"
        )
    try:
        names = newest_first(storage.names())
    except OSError as e:
        print(f"cannot list {storage.location}: {e}")
        return 1
    if not names:
        print(f"no snapshot in {storage.location}")
        return 1
    chosen = None
    print(f"{'snapshot':<40} {'step':>9} {'lineage':>8} {'group':<12} {'MB':>9}  state")
    for name in names:
        try:
            manifest = read(storage, name, key)
            state = "sealed, files not verified"
            if not args.no_verify:
                verify(storage, manifest)
                state = "ok"
        except DamagedSnapshotError as e:
            print(f"{name:<40} {'':>9} {'':>8} {'':<12} {'':>9}  {e.kind.upper()}: {e}")
            continue
        if chosen is None and state == "ok":
            chosen = manifest
        age = time.time() - manifest.created
        print(
            f"{name:<40} {manifest.step:>9} {manifest.lineage:>8} "
            f"{manifest.replica_id[:12]:<12} {manifest.nbytes / 1e6:>9.1f}  {state} "
            f"({age / 60:.0f} min old, {manifest.world_size} rank(s))"
        )
    if args.no_verify:
        return 0
    if chosen is None:
        print("no snapshot verifies: a job that lost every group would start at step 0")
        return 1
    print(f"a job that lost every group resumes from step {chosen.step} ({chosen.name})")
    return 0
