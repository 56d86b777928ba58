"""The commit and date a benchmark's results JSON records (figures in the docs name the commit)."""

from __future__ import annotations

import datetime
import pathlib
import subprocess

HERE = pathlib.Path(__file__).parent


def provenance() -> dict:
    """The commit (and whether the tree had changes) and the date of this run."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", ".")),
            "date": datetime.date.today().isoformat()}
