"""make ab: each revision's processes import that revision's pdpush (real daemons; speed is not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_every_revision_is_measured_by_this_trees_measuring_code(tmp_path):
    """A revision's own pdpush, but this tree's pdpush_tools: the revision's own measuring code (its observer, its
    naps) credited its changes to the product."""
    tree = tmp_path / "rev"
    for pkg in ("pdpush", "pdpush_tools"):
        (tree / pkg).mkdir(parents=True)
        (tree / pkg / "__init__.py").write_text("")
    (tmp_path / "finderless").mkdir()
    (tmp_path / "finderless" / "sitecustomize.py").write_text(ab._FINDERLESS)
    env = {**os.environ, "PYTHONPATH": ab.probe_path(tmp_path, tmp_path / "site", tree)}
    out = subprocess.run([sys.executable, "-c", "import pdpush, pdpush_tools; print(pdpush.__file__); "
                          "print(pdpush_tools.__file__)"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == str(tree / "pdpush" / "__init__.py")
    assert Path(out[1]).resolve() == ab.ROOT / "pdpush_tools" / "__init__.py"


def test_a_revision_runs_its_own_code_through_real_daemons_and_is_read_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = ab.compare(["."], rounds=2, gap_s=0.001, requests=3, work=Path("rel"))  # (a relative folder, resolved)
    runs = res["runs"]["."]
    assert len(runs) == 2 and all(r["verified"] and r["begin_ms"] > 0 for r in runs)
    assert all(Path(r["pdpush"]).is_relative_to(ab.ROOT) for r in runs)
    assert all(Path(r["pdpush_native"]).is_relative_to(tmp_path / "rel") for r in runs)  # its build, not the install
    json.dumps(res)


def test_the_bytes_probe_moves_and_reads_back_its_requests(tmp_path):
    res = ab.compare(["."], rounds=1, gap_s=0.001, requests=2, work=tmp_path, probe="bytes", extra=("64",))
    (run,) = res["runs"]["."]
    assert run["verified"] and all(run[k] > 0 for k in ab.PROBES["bytes"][1])
    assert res["probe"] == "bytes" and set(res["medians"]["."]) == set(ab.PROBES["bytes"][1])


def test_a_revision_named_twice_is_refused():
    with pytest.raises(ValueError):
        ab.compare([".", "."], rounds=1, gap_s=0.001, requests=1, work=Path("unused"))
    with pytest.raises(ValueError):
        ab.compare(["."], rounds=1, gap_s=0.001, requests=1, work=Path("unused"), probe="nonesuch")
