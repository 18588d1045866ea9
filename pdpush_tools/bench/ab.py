"""``make ab REVS="A B"``: the same probe against two or more revisions, interleaved, each running its own code.

A change's effect on a request's path is smaller than this host's run-to-run spread, so it is measured by
alternating the revisions round after round on the same machine and counting in how many rounds one beat the
other, beside the medians. Each revision is a git worktree (its own native build where its native/ differs from
the installed one's), and each process of a run (the probe and the daemons it starts) imports that worktree's
pdpush.

That last point is not what ``PYTHONPATH`` alone gives: ``pip install -e .`` with scikit-build-core puts a finder
at the front of ``sys.meta_path`` that maps ``pdpush`` and ``pdpush_native`` to the installed tree whatever
``PYTHONPATH`` says, so two "revisions" run that way are the same code. A ``sitecustomize`` on the path
(``_FINDERLESS``) takes that finder out in every process of the run.

The probe (``begin_probe``) uses only the API the revisions share: the daemons' launch, ``PrefillClient`` and
``DecodeClient``. It is run as a file from this tree, with the revision's tree first on the path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FINDERLESS = '''# pdpush_tools/bench/ab.py: the revision on PYTHONPATH, not the editable install, is what this process imports
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "_editable_" not in getattr(type(f), "__module__", "")]
'''
KEYS = ("begin_ms", "finish_ms", "open_ms", "begin_to_done_ms", "engine_cpu_us_per_request")


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def prepare(rev: str, work: Path) -> Path:
    """A worktree of ``rev`` (``.``: this working tree as it is) with pdpush_native importable from it: its own build
    of native/ where that differs from this tree's, else this tree's installed build. Returns the path to put first."""
    if rev == ".":
        tree = ROOT
    else:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        tree = work / sha[:12]
        if not tree.exists():
            _git("worktree", "add", "--detach", str(tree), sha)
    native = hashlib.sha256(_git("ls-files", "-s", "native", cwd=tree).encode()).hexdigest()[:12]
    site = work / f"native-{native}"
    if not site.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        str(tree / "native")], check=True)
    return Path(f"{site}{os.pathsep}{tree}")


def run_probe(path: Path, finderless: Path, gap_s: float, requests: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{finderless}{os.pathsep}{path}"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("ab_probe.py")), str(gap_s), str(requests)],
                         env=env, cwd=tempfile.gettempdir(), check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(revs: list[str], rounds: int, gap_s: float, requests: int, work: Path) -> dict:
    """``rounds`` rounds, each running the probe once per revision in order; per revision the medians of its
    rounds, and per key and pair of neighbours the rounds the later revision beat the earlier in."""
    finderless = work / "finderless"
    finderless.mkdir(parents=True, exist_ok=True)
    (finderless / "sitecustomize.py").write_text(_FINDERLESS)
    paths = {rev: prepare(rev, work) for rev in revs}
    runs: dict[str, list[dict]] = {rev: [] for rev in revs}
    for _ in range(rounds):
        for rev in revs:
            runs[rev].append(run_probe(paths[rev], finderless, gap_s, requests))
            if not runs[rev][-1]["verified"]:
                raise RuntimeError(f"{rev}: a request read back differed from what was pushed")
    res = {"revs": revs, "rounds": rounds, "gap_ms": gap_s * 1000, "requests": requests,
           "files": {rev: runs[rev][0]["pdpush"] for rev in revs},
           "medians": {rev: {k: statistics.median(r[k] for r in runs[rev]) for k in KEYS} for rev in revs},
           "runs": runs}
    res["later_won"] = {f"{a} -> {b}": {k: sum(y[k] < x[k] for x, y in zip(runs[a], runs[b], strict=True)) for k in KEYS}
                        for a, b in zip(revs, revs[1:], strict=False)}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+", help="git revisions ('.': this working tree as it is), oldest first")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gap-ms", type=float, default=30.0, help="between a probe's requests")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--work", type=Path, default=ROOT / "bench-out" / "ab")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if len(a.revs) < 2:
        ap.error("name two revisions or more")
    res = compare(a.revs, a.rounds, a.gap_ms / 1000, a.requests, a.work)
    for rev in a.revs:
        print(rev, res["files"][rev], json.dumps({k: round(v, 3) for k, v in res["medians"][rev].items()}))
    for pair, won in res["later_won"].items():
        print(f"{pair}: rounds the later was lower, of {a.rounds}:", json.dumps(won))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
