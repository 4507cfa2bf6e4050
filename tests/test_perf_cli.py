"""The command line of ``python -m giftcomm.perf`` and the helpers every perf tool and study
shares (giftcomm.perf.common, giftcomm.perf.sizes)."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import giftcomm
from giftcomm.perf import __main__ as cli
from giftcomm.perf.common import Progress, split_list, topology
from giftcomm.perf.sizes import format_size, parse_size, size_range


def test_unknown_command_names_it_lists_the_commands_and_exits_2(capsys):
    assert cli.main(["foo"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'foo'" in err
    assert all(name in err for name in ("allreduce", "codec", "calibrate"))


@pytest.mark.parametrize("cmd", ["train", "fidelity", "errors", "model", "netbed", "plot"])
def test_a_moved_command_says_where_it_went(cmd, capsys):
    assert cli.main([cmd, "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"python -m studies {cmd} --quick" in err and "moved" in err


def test_help_and_version(capsys):
    assert cli.main([]) == 0 and "allreduce" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"giftcomm {giftcomm.__version__}"


def test_module_entry_point_exit_status():
    res = subprocess.run([sys.executable, "-m", "giftcomm.perf", "nope"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown command 'nope'" in res.stderr


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert giftcomm.__version__ == version("giftcomm")


@pytest.mark.parametrize("text,nbytes", [("64M", 64 << 20), ("16MiB", 16 << 20), ("16MB", 16 << 20), ("1K", 1024),
                                         ("1kib", 1024), ("512", 512), ("8B", 8), ("1G", 1 << 30)])
def test_one_size_grammar(text, nbytes):
    assert parse_size(text) == nbytes


def test_size_helpers():
    assert format_size(64 << 20) == "64M" and format_size(1000) == "1000"
    assert size_range(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    with pytest.raises(ValueError):
        parse_size("lots")
    assert split_list(" e4m3, bf16,,") == ["e4m3", "bf16"]


def test_progress_draws_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    log = io.StringIO()  # a redirected stderr: nothing at all, no carriage returns
    with Progress(3, "x ", stream=log) as bar:
        for _ in range(3):
            bar.update("step")
    assert log.getvalue() == ""
    tty = Tty()
    with Progress(2, "x ", stream=tty) as bar:
        bar.update("a")
    assert "\r" in tty.getvalue() and "[1/2]" in tty.getvalue()
    off = Tty()
    Progress(2, stream=off, enabled=False).update("a")
    assert off.getvalue() == ""


def test_topology_of_a_loopback_group_and_of_runs_of_ranks():
    class Fake:
        size = 6

        def node_ids(self):
            return np.array([0, 0, 0, 1, 1, 1])

    nodes, topo = topology(Fake())
    assert nodes.tolist() == [0, 0, 0, 1, 1, 1] and (topo.ranks, topo.nodes, topo.local_size) == (6, 2, 3)
    _, topo = topology(Fake(), local_size=2)
    assert (topo.nodes, topo.local_size) == (3, 2)
    _, topo = topology(Fake(), local_size=4)  # uneven: 4 + 2
    assert (topo.nodes, topo.local_size) == (2, 0)


def test_geometry_cost_is_a_perf_command_and_no_library_module_imports_it(capsys):
    """The geometry cost benchmark lives with the other measurements (giftcomm.perf), run as
    ``python -m giftcomm.perf geometry-cost``; the library's core does not import it."""
    import re
    from pathlib import Path

    with pytest.raises(SystemExit) as err:
        cli.main(["geometry-cost", "-h"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "geometry-cost" in out and "transforms" in out and "sync" in out
    assert "geometry-cost" in cli._usage()
    root = Path(giftcomm.__file__).parent
    importers = [str(p.relative_to(root)) for p in root.rglob("*.py") if p.parent.name != "perf"
                 and re.search(r"geometry_cost|perf\.geometry_cost|geometry\.cost\b", p.read_text())]
    assert importers == []


ROOT = Path(__file__).resolve().parents[1]
NUM = r" +[0-9]+\.[0-9]+"


def _side_by_side(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "giftcomm.perf", "side-by-side", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_side_by_side_times_this_tree_against_itself_under_mpiexec():
    """Both trees this checkout, P = 2, a tiny size: every contender's line with the two medians and
    new/old, the compared call's with the same runs' best baseline, and the trees' order alternating."""
    res = _side_by_side("allreduce", "--trees", str(ROOT), str(ROOT), "--ranks", "2", "--rounds", "2",
                        "--sizes", "1K", "--calls", "3", "--inner-rounds", "2", "--warmup", "1")
    assert res.returncode == 0, res.stderr + res.stdout
    out = res.stdout
    assert re.search(rf"^P=2 +1K  giftcomm e4m3 +old{NUM} us new{NUM} us  new/old{NUM}x  best baseline/this "
                     rf"old{NUM}x new{NUM}x", out, re.M), out
    for label in ("MPI fp32", "giftcomm bf16"):
        assert re.search(rf"^P=2 +1K  {label} +old{NUM} us new{NUM} us  new/old{NUM}x$", out, re.M), out
    assert "round 1/2 done (old then new)" in out and "round 2/2 done (new then old)" in out
    assert "did not run" not in out


def test_side_by_side_ddp_mode_runs_one_tree():
    res = _side_by_side("ddp", "--ranks", "2", "--rounds", "1", "--width", "32", "--depth", "1", "--batch", "4",
                        "--calls", "1", "--inner-rounds", "1", "--warmup", "1")
    assert res.returncode == 0, res.stderr + res.stdout
    assert re.search(rf"^P=2  step  giftcomm hook e4m3 auto +{NUM[2:]} ms  best baseline/this{NUM}x", res.stdout,
                     re.M), res.stdout
    assert re.search(rf"^P=2  step  DDP default \(gloo\) +{NUM[2:]} ms$", res.stdout, re.M), res.stdout


def test_side_by_side_report_takes_medians_and_ratios(capsys):
    """new/old of the medians over rounds; best baseline/this per tree; a contender left out is
    n/a and named with its reason."""
    from giftcomm.perf.side_by_side import report

    def result(a: float, b: float | None, c: float, note: dict[str, str] | None = None) -> dict:
        return {"rows": {"1024": {"x": a, "base1": b, "base2": c}}, "notes": note or {}, "ran": {"1024": "ring"}}

    got = {"old": [result(4e-6, 2e-6, 8e-6), result(6e-6, 3e-6, 9e-6), result(5e-6, 2.5e-6, 7e-6)],
           "new": [result(2e-6, None, 4e-6, {"base1": "ValueError: nope"})] * 3}
    report(2, ["old", "new"], got, [("1024", "1K")], ["x", "base1", "base2"], "us", 1e6)
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"P=2 +1K  x +old +5\.00 us new +2\.00 us  new/old  0\.40x  best baseline/this old  0\.50x "
                        r"new  2\.00x  ran ring ring", out[0]), out
    assert re.search(r"base1 +old +2\.50 us new +n/a us  new/old   n/a$", out[1]), out
    assert out[-1] == "# P=2 new: base1 did not run: ValueError: nope"


def test_side_by_side_refuses_a_folder_without_giftcomm(tmp_path):
    from giftcomm.perf.side_by_side import main

    with pytest.raises(SystemExit, match="holds no giftcomm package"):
        main(["allreduce", "--trees", str(tmp_path), str(ROOT)])
