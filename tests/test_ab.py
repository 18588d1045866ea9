"""make ab: each revision's processes import that revision's pdpush (real daemons; speed is not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pdpush_tools.bench import ab


def test_the_revision_on_the_path_wins_over_the_editable_install(tmp_path):
    """``pip install -e .`` puts a finder before PYTHONPATH: without ab's sitecustomize a "revision" on the path ran
    the installed tree."""
    fake = tmp_path / "rev" / "pdpush"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (tmp_path / "finderless").mkdir()
    (tmp_path / "finderless" / "sitecustomize.py").write_text(ab._FINDERLESS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'finderless'}{os.pathsep}{tmp_path / 'rev'}"}
    out = subprocess.run([sys.executable, "-c", "import pdpush; print(pdpush.__file__)"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(fake / "__init__.py")


def test_two_revisions_interleaved_each_read_back_and_counted(tmp_path):
    res = ab.compare([".", "."], rounds=1, gap_s=0.001, requests=3, work=tmp_path)
    assert res["files"]["."].startswith(str(ab.ROOT)) and len(res["runs"]["."]) == 2
    assert all(r["verified"] and r["begin_ms"] > 0 for r in res["runs"]["."])
    json.dumps(res)
