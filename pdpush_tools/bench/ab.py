"""``make ab REVS="A B"``: the same probe against two or more revisions, interleaved, each running its own code.

A change's effect on a request's path is smaller than this host's run-to-run spread, so it is measured by
running the revisions round after round on the same machine, in the opposite order every other round (so that
running second is no revision's advantage), and counting in how many rounds one beat the other, beside the
medians. Each revision is a git worktree with its own build of native/ (one per distinct content), and each
process of a run (the probe and the daemons it starts) imports that worktree's pdpush: each probe says which
files it imported, and a run whose files are not its revision's is refused.

That last point is not what ``PYTHONPATH`` alone gives: ``pip install -e .`` with scikit-build-core puts a finder
at the front of ``sys.meta_path`` that maps ``pdpush`` and ``pdpush_native`` to the installed tree whatever
``PYTHONPATH`` says, so two "revisions" run that way are the same code. A ``sitecustomize`` on the path
(``_FINDERLESS``) takes that finder out in every process of the run.

A probe uses only the API the revisions share: the daemons' launch, ``PrefillClient`` and ``DecodeClient``. It is
run as a file from this tree, with the revision's tree first on the path. ``ab_probe.py`` (``--probe begin``, the
default) times one-chunk requests' begin, finish and open; ``ab_bytes_probe.py`` (``--probe bytes``) moves bytes:
end to end and transport only at one layer size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FINDERLESS = '''# pdpush_tools/bench/ab.py: the revision on PYTHONPATH, not the editable install, is what this process imports
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "_editable_" not in getattr(type(f), "__module__", "")]
'''
# the probe process's CPU per request: its prefill and decode clients, its read-backs (the same code for every
# revision where pdpush_tools/bench/common.py is)
KEYS = ("begin_ms", "finish_ms", "open_ms", "begin_to_done_ms", "probe_cpu_us_per_request")
# each probe: its file beside this one, and the keys it reports (every one lower-is-better)
PROBES = {"begin": ("ab_probe.py", KEYS), "bytes": ("ab_bytes_probe.py", ("e2e_ms", "begun_ms", "transport_ms"))}


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _native_key(tree: Path) -> str:
    """What a build of ``tree``'s native/ depends on: every file's content as it is on disk (committed or not),
    this Python's ABI and the UCX asked for."""
    h = hashlib.sha256(f"{sys.implementation.cache_tag} {os.environ.get('PDPUSH_UCX', '')}".encode())
    for f in sorted(p for p in (tree / "native").rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(f.relative_to(tree)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def prepare(rev: str, work: Path) -> tuple[Path, Path]:
    """``rev``'s tree (``.``: this working tree as it is; else a worktree of the commit) and a build of its native/
    (one per distinct content, kept in ``work``)."""
    if rev == ".":
        tree = ROOT
    else:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        tree = work / sha
        if not (tree / ".git").exists() or _git("rev-parse", "HEAD", cwd=tree) != sha:
            _git("worktree", "add", "--force", "--detach", str(tree), sha)
    site = work / f"native-{_native_key(tree)}"
    if not (site / "pdpush_native").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        str(tree / "native")], check=True)
    return tree, site


def probe_path(work: Path, site: Path, tree: Path) -> str:
    """A probe's PYTHONPATH: the finder-less sitecustomize, the revision's native build, this tree's pdpush_tools
    alone (a link to it), then the revision's tree (its pdpush)."""
    tools = work / "tools"
    tools.mkdir(parents=True, exist_ok=True)
    if not (tools / "pdpush_tools").exists():
        (tools / "pdpush_tools").symlink_to(ROOT / "pdpush_tools")
    return os.pathsep.join(map(str, (work / "finderless", site, tools, tree)))


def run_probe(tree: Path, site: Path, work: Path, gap_s: float, requests: int, probe: str = "begin",
              extra: tuple[str, ...] = ()) -> dict:
    """One probe run importing ``tree``'s pdpush and ``site``'s pdpush_native, and this tree's measuring code
    (pdpush_tools: every revision measured by the same code; the revision's own credited its observer's changes to
    the product), in a directory of its own (a daemon's ``python -m`` looks in its working directory first);
    refused where it imported anything else."""
    env = {**os.environ, "PYTHONPATH": probe_path(work, site, tree)}
    cwd = work / "cwd"
    cwd.mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, str(Path(__file__).with_name(PROBES[probe][0])), str(gap_s), str(requests),
                          *extra],
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"the probe of {tree} failed ({out.returncode}): {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not (Path(got["pdpush"]).is_relative_to(tree) and Path(got["pdpush_native"]).is_relative_to(site)
            and Path(got["pdpush_tools"]).resolve().is_relative_to(ROOT / "pdpush_tools")):
        raise RuntimeError(f"the probe of {tree} imported {got['pdpush']}, {got['pdpush_native']} and "
                           f"{got['pdpush_tools']}")
    return got


def compare(revs: list[str], rounds: int, gap_s: float, requests: int, work: Path, probe: str = "begin",
            extra: tuple[str, ...] = ()) -> dict:
    """``rounds`` rounds, each running the probe (``PROBES[probe]``, given ``extra`` after its gap and requests)
    once per revision, in ``revs``' order and reversed every other round; per revision the medians of its rounds,
    and per key and pair of neighbours the rounds the later revision beat the earlier in. A revision that does not
    read back what it pushed ends the comparison."""
    if len(set(revs)) != len(revs) or rounds < 1 or probe not in PROBES:
        raise ValueError(f"distinct revisions, one round or more and a probe of {list(PROBES)}: {revs}, {rounds} "
                         f"rounds, {probe!r}")
    keys = PROBES[probe][1]
    work = work.resolve()
    (work / "finderless").mkdir(parents=True, exist_ok=True)
    (work / "finderless" / "sitecustomize.py").write_text(_FINDERLESS)
    built = {rev: prepare(rev, work) for rev in revs}
    runs: dict[str, list[dict]] = {rev: [] for rev in revs}
    for i in range(rounds):
        for rev in (revs if i % 2 == 0 else revs[::-1]):
            runs[rev].append(run_probe(*built[rev], work, gap_s, requests, probe, extra))
            if not runs[rev][-1]["verified"]:
                raise RuntimeError(f"{rev}: a request read back differed from what was pushed")
    res = {"revs": revs, "probe": probe, "probe_args": list(extra), "rounds": rounds, "gap_ms": gap_s * 1000,
           "requests": requests,
           "trees": {rev: _git("describe", "--always", "--dirty", cwd=built[rev][0]) for rev in revs},
           "files": {rev: runs[rev][0]["pdpush"] for rev in revs},
           "medians": {rev: {k: statistics.median(r[k] for r in runs[rev]) for k in keys} for rev in revs},
           "runs": runs}
    res["later_won"] = {f"{a} -> {b}": {k: sum(y[k] < x[k] for x, y in zip(runs[a], runs[b], strict=True)) for k in keys}
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
    ap.add_argument("--probe", choices=list(PROBES), default="begin",
                    help="begin: one-chunk requests, the begin's path; bytes: 32 layers of --layer-kib, end to end "
                         "and transport only")
    ap.add_argument("--layer-kib", type=int, help="the bytes probe's layer size (default 1024): a multiple of 4 "
                                                 "up to 1024, of 1024 above")
    a = ap.parse_args(argv)
    if a.probe != "bytes" and a.layer_kib is not None:
        ap.error("--layer-kib is the bytes probe's")
    kib = 1024 if a.layer_kib is None else a.layer_kib
    if kib < 4 or kib % (4 if kib <= 1024 else 1024):  # 4 KiB a token, pages of at most 256 tokens (1 MiB)
        ap.error(f"--layer-kib {kib}: a multiple of 4 KiB up to 1024, of 1024 above")
    if len(set(a.revs)) < 2 or len(set(a.revs)) != len(a.revs) or a.rounds < 1:
        ap.error("name two distinct revisions or more, and one round or more")
    extra = (str(kib),) if a.probe == "bytes" else ()
    res = compare(a.revs, a.rounds, a.gap_ms / 1000, a.requests, a.work, a.probe, extra)
    for rev in a.revs:
        print(rev, res["trees"][rev], json.dumps({k: round(v, 3) for k, v in res["medians"][rev].items()}))
    for pair, won in res["later_won"].items():
        print(f"{pair}: rounds the later was lower, of {a.rounds}:", json.dumps(won))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
