"""Processes that used shardkit exit with shardkit's process groups freed (``_shardkit/teardown.py``).

A Gloo group's worker threads still running when the interpreter finalizes can abort the
process (SIGABRT, ``terminate called without an active exception``) after its work is done.
The abort itself is a race; what these tests check is the condition that rules it out: at
interpreter exit no Gloo worker thread of a group shardkit created or holds is left, whether
the script destroyed its process group or not, and whether it imported shardkit before or
after ``init_process_group``. The script's own group is the script's: shardkit never
destroys it, so a script that does not destroy it (or whose group torch itself still holds,
see ``teardown``) exits with that group's threads, and only those. Each case is a real
``torchrun`` job of 2 ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed

# A job takes 10-20 s on a quiet machine; at load average 35 on 2 cores, starting two
# interpreters under torchrun alone took minutes (one run took 4 min in all).
JOB_SECONDS = 600

# Registered before shardkit is imported, so atexit runs it after shardkit's own exit hook,
# as late as a Python handler can look. The count of the script's own group's threads waits
# for it to settle: on a busy machine (load average 25 on 2 cores) a Gloo thread can run for a
# while under its parent's name before it names itself, and a count taken at once misses it.
_OBSERVER = """
import atexit, os

def _gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:  # the thread ended between the listing and the read
            pass
    return sum(n.startswith(("pt_gloo", "gloo")) for n in names)

def _settled_gloo_threads():
    # A thread just started still has its parent's name until it names itself, which on a busy
    # machine can take a while: count until the same number was seen for a whole second.
    import time
    count, since, deadline = _gloo_threads(), time.monotonic(), time.monotonic() + 60
    while time.monotonic() - since < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
        now = _gloo_threads()
        if now != count:
            count, since = now, time.monotonic()
    return count

def _gloo_threads_at_exit():
    print(f"rank {os.environ['RANK']}: gloo threads at exit: {_gloo_threads()}", flush=True)

atexit.register(_gloo_threads_at_exit)
import torch
import torch.distributed as dist
"""

_IMPORT = "import checkpoint\nimport sharded_tensor as st\nfrom sharding import single_split\n"

# Random initialization on the meta device makes torch import torch._dynamo, which imports
# torch.distributed.nn.functional: the import that keeps a group alive when it happens
# after init_process_group. An async save caches the checkpoint's own Gloo group.
_WORK = """
ranks = [f"rank:{r}/cpu" for r in range(dist.get_world_size())]
with torch.device("meta"):
    torch.nn.Embedding(16, 4)
t = st.randn(8, 4, sharding_spec=single_split(0, ranks))
checkpoint.async_save({"t": t}, os.environ["CKPT"]).result()
"""


def _script(*, import_first: bool, destroy: bool) -> str:
    parts = [_OBSERVER]
    if import_first:
        parts.append(_IMPORT)
    parts.append('dist.init_process_group("gloo")\n')
    # Counted after a first collective: the group starts its worker threads with it.
    parts.append("dist.barrier()\n")
    parts.append('print(f"rank {os.environ[\'RANK\']}: gloo threads of the script\'s group: "\n'
                 '      f"{_settled_gloo_threads()}", flush=True)\n')
    if not import_first:
        parts.append(_IMPORT)
    parts.append(_WORK)
    if destroy:
        parts.append("dist.destroy_process_group()\n")
    return "".join(parts)


@pytest.mark.timeout(JOB_SECONDS + 60)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc/self/task (Linux)")
@pytest.mark.parametrize(("import_first", "destroy"), [
    pytest.param(True, True, id="documented-pattern"),
    pytest.param(True, False, id="no-destroy"),
    pytest.param(False, True, id="imported-after-init"),
])
def test_no_gloo_thread_left_at_exit(tmp_path: Path, import_first: bool, destroy: bool) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_script(import_first=import_first, destroy=destroy)))
    env = {**os.environ, "CKPT": str(tmp_path / "ckpt"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=JOB_SECONDS,
                            check=False)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    counts = dict(re.findall(r"rank (\d): gloo threads at exit: (\d+)", result.stdout))
    own = dict(re.findall(r"rank (\d): gloo threads of the script's group: (\d+)", result.stdout))
    assert sorted(own) == ["0", "1"] and all(int(n) > 0 for n in own.values()), log
    # Left at exit: nothing when the script destroyed its group and nothing else holds it; else
    # the script's group alone (shardkit neither destroys it nor leaves a group of its own).
    left = own if not destroy or not import_first else {"0": "0", "1": "0"}
    assert counts == left, log
