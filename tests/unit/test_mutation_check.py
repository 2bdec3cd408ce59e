"""``scripts/mutation_check.py`` itself: a hang is a timeout (never a kill), and its copy never outlives it.

The check runs on a small repository of its own here (a module and one test), with three
mutations: one its test notices (killed), one that makes its test hang (timeout), one that
changes nothing (survived). Stopped with SIGTERM in the middle of a test run, it removes its
temporary copy and the test run it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mutation_check.py"

_DRIVER = textwrap.dedent('''
    import importlib.util, sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("mutation_check", sys.argv[1])
    check = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = check
    spec.loader.exec_module(check)
    check.ROOT = Path(sys.argv[2])
    wanted = sys.argv[3].split(",")
    check.MUTATIONS = [m for m in [
        check.Mutation("noticed", "pkg.py", "VALUE = 1", "VALUE = 3", ("test_pkg.py",)),
        check.Mutation("hangs", "pkg.py", "VALUE = 1", "VALUE = 2", ("test_pkg.py",)),
        check.Mutation("unnoticed", "pkg.py", "VALUE = 1", "VALUE = 1  # the same", ("test_pkg.py",)),
    ] if m.name in wanted]
    sys.exit(check.main(["--timeout", sys.argv[4]]))
''')


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pkg.py").write_text("VALUE = 1\n")
    (repo / "test_pkg.py").write_text(textwrap.dedent("""
        import os, time
        import pkg

        def test_value():
            if pkg.VALUE == 2:
                open(os.path.join(os.environ["MARKS"], "hanging"), "w").close()
                time.sleep(600)
            assert pkg.VALUE in (1, 2)
    """))
    (tmp_path / "driver.py").write_text(_DRIVER)
    return repo


def _start(tmp_path: Path, repo: Path, names: str, timeout: float) -> subprocess.Popen[str]:
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(temp), "MARKS": str(tmp_path)}
    return subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(SCRIPT), str(repo), names, str(timeout)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_hang_is_a_timeout_not_a_kill(tmp_path: Path) -> None:
    proc = _start(tmp_path, _repo(tmp_path), "noticed,hangs,unnoticed", timeout=10)
    out, err = proc.communicate(timeout=300)
    report = json.loads(out)
    status = {m["mutation"]: m["status"] for m in report["mutations"]}
    assert status == {"noticed": "killed", "hangs": "timeout", "unnoticed": "survived"}, (status, err)
    assert report["summary"]["killed"] == 1 and report["summary"]["timeout"] == 1
    assert proc.returncode == 1  # not every mutation was killed
    assert list((tmp_path / "tmp").iterdir()) == []  # the copy is gone


def test_a_stopped_check_removes_its_copy_and_its_test_run(tmp_path: Path) -> None:
    proc = _start(tmp_path, _repo(tmp_path), "hangs", timeout=600)
    deadline = time.monotonic() + 120
    while not (tmp_path / "hanging").exists():  # the mutated test is running (and would run 600 s)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    copies = list((tmp_path / "tmp").iterdir())
    assert len(copies) == 1 and copies[0].name.startswith("shardkit-mutation-")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "mutation check stopped" in err
    assert list((tmp_path / "tmp").iterdir()) == []
    # The pytest it started (its own process group) is gone too: nothing runs the copy's test any more.
    running = subprocess.run(["pgrep", "-f", str(copies[0])], capture_output=True, text=True)
    assert running.stdout.strip() == "", running.stdout


def test_every_mutation_of_the_list_applies_to_the_code_as_it_is() -> None:
    # A snippet the code no longer holds makes its mutation "stale": it checks nothing until the
    # list is updated, so an edit of the code that moves one must update the list with it.
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_check_list", SCRIPT)
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check_list"] = check
    try:
        spec.loader.exec_module(check)
        root = SCRIPT.parents[1]
        counts = {m.name: (root / m.file).read_text().count(m.before) for m in check.MUTATIONS}
    finally:
        del sys.modules["mutation_check_list"]
    assert len(counts) == len(check.MUTATIONS) >= 70, len(counts)
    stale = {name: n for name, n in counts.items() if n != 1}
    assert not stale, f"snippets found other than once (name: times): {stale}"
    for m in check.MUTATIONS:
        compile((root / m.file).read_text().replace(m.before, m.after), m.file, "exec")
