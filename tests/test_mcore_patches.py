"""This project's changes to megatron-core and megatron.training are installed by the entry points only, each for the
megatron-core releases it is written for (megatron_glm5/mcore_version.py): another release is refused with one line
(the trainer hooks, the checkpoint read guards, the CPU redirects) or the change is left out with one line on stderr
(mcore_fixes, the MoE token permutation); nothing is installed by importing or configuring."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_glm5 import mcore_version
from megatron_glm5.mcore_version import TRAINER_VERSIONS, UnsupportedMegatronCore
from tests.training_harness import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER = "0.20.0"  # a release none of the changes is written for


def _refusers():
    from megatron_glm5 import cpu_compat
    from megatron_glm5.initialize import install_patches
    from megatron_glm5.training import (
        checkpoint_checks,
        data_loaders,
        flops,
        indexer_stages,
        megatron_hooks,
        memory_report,
        save_guard,
    )

    def cpu_redirects():
        enabled = cpu_compat._ENABLED
        cpu_compat._ENABLED = False
        try:
            cpu_compat.enable_cpu_compat()
        finally:
            cpu_compat._ENABLED = enabled

    return {
        "checkpoint read guards": install_patches,
        "CPU redirects": cpu_redirects,
        "trainer hooks": megatron_hooks.install,
        "checkpoint writer's queue": megatron_hooks.install_checkpoint_writer_queue,
        "--test-kill-during-save": lambda: megatron_hooks.install_test_kill_during_save(3),
        "FLOP count": flops.install,
        "save guards": save_guard.install,
        "memory report": memory_report.install,
        "learning-rate schedule check": checkpoint_checks.install_schedule_check,
        "indexer stage switch": indexer_stages.install,
        "Energon loader state": lambda: data_loaders._save_state_with_checkpoints(None, None, 0),
    }


def _trainer_state():
    """What the hooks replace in megatron.training / megatron-core, by identity."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training import checkpointing, training

    return [training.save_checkpoint, training.get_megatron_optimizer, training.load_checkpoint,
            training.num_floating_point_operations, training.maybe_finalize_async_save, checkpointing.maybe_msc,
            training.report_theoretical_memory, training.report_memory,
            checkpointing.dist_checkpointing, dataset_utils.compile_helpers, filesystem_async._results_queue,
            OptimizerParamScheduler._check_and_set]


@pytest.mark.parametrize("what", list(_refusers()))
def test_another_megatron_core_is_refused_with_one_line_and_nothing_installed(monkeypatch, what):
    monkeypatch.setattr(mcore_version, "MCORE_VERSION", OTHER)
    before = _trainer_state()
    with pytest.raises(UnsupportedMegatronCore) as e:
        _refusers()[what]()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"megatron-core {OTHER} is installed; "), msg
    assert msg.endswith(f"is written for megatron-core {TRAINER_VERSIONS[0]}: install megatron-core=="
                        f"{TRAINER_VERSIONS[1]}"), msg
    assert all(a is b for a, b in zip(before, _trainer_state()))


def test_fixes_and_token_permutation_are_left_out_with_one_line_each(monkeypatch, capsys):
    """Outside their releases mcore_fixes and the token permutation are not installed (megatron-core's own code
    runs), each said once in one line on stderr."""
    from megatron_glm5 import mcore_fixes
    from megatron_glm5.initialize import install_patches
    from megatron_glm5.models import token_permutation

    calls = []
    monkeypatch.setattr(mcore_version, "MCORE_VERSION", OTHER)
    monkeypatch.setattr(mcore_version, "TRAINER_VERSIONS", ("0.19.2", OTHER))  # the read guards accept it here
    monkeypatch.setattr(mcore_version, "_NOTICES", set())
    monkeypatch.setattr(mcore_fixes, "apply_mcore_fixes", lambda: calls.append("fixes"))
    monkeypatch.setattr(token_permutation, "install", lambda: calls.append("permutation"))
    install_patches()
    install_patches()
    assert calls == []
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"megatron_glm5: megatron-core {OTHER} is installed; the megatron-core fixes of mcore_fixes.py is written for "
        f"megatron-core {mcore_fixes.AFFECTED_VERSIONS[0]} to {mcore_fixes.AFFECTED_VERSIONS[1]} and is not installed "
        "(megatron-core's own code runs)",
        f"megatron_glm5: megatron-core {OTHER} is installed; the MoE token permutation (models/token_permutation.py) "
        f"is written for megatron-core {token_permutation.SUPPORTED_VERSIONS[0]} to "
        f"{token_permutation.SUPPORTED_VERSIONS[1]} and is not installed (megatron-core's own code runs)"], err


def test_supported_release_installs(monkeypatch):
    from megatron_glm5 import mcore_fixes
    from megatron_glm5.initialize import install_patches
    from megatron_glm5.models import token_permutation

    calls = []
    monkeypatch.setattr(mcore_fixes, "apply_mcore_fixes", lambda: calls.append("fixes"))
    monkeypatch.setattr(token_permutation, "install", lambda: calls.append("permutation"))
    install_patches()
    assert calls == ["fixes", "permutation"]


def test_importing_and_configuring_changes_nothing():
    """Importing the package, building a config and a model's pieces installs no change (a fresh process)."""
    code = (
        "import megatron.core.transformer.moe.router as r, megatron.core.optimizer.distrib_optimizer as d\n"
        "import megatron.core.transformer.moe.token_dispatcher as t\n"
        "from megatron.training import training\n"
        "before = [r.TopKRouter._apply_expert_bias, d.DistributedOptimizer.state_dict, t.permute,\n"
        "          training.save_checkpoint, training.get_megatron_optimizer]\n"
        "import megatron_glm5, megatron_glm5.training.entry, megatron_glm5.training.megatron_hooks\n"
        "from megatron_glm5.config import tiny_config\n"
        "tiny_config()\n"
        "after = [r.TopKRouter._apply_expert_bias, d.DistributedOptimizer.state_dict, t.permute,\n"
        "         training.save_checkpoint, training.get_megatron_optimizer]\n"
        "assert all(a is b for a, b in zip(before, after)), (before, after)\n"
        "print('unchanged')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0 and "unchanged" in proc.stdout, proc.stderr[-3000:]


def test_pretrain_on_another_megatron_core_is_one_line(tmp_path):
    """pretrain_glm5_vlm.py with megatron-core reporting another release: exit 1, one line, no traceback."""
    (tmp_path / "sitecustomize.py").write_text(  # quiet as the entry is, then megatron-core reports OTHER
        "from megatron_glm5.errors import quiet_library_warnings\nquiet_library_warnings()\n"
        f"import megatron.core.package_info as p\np.__version__ = {OTHER!r}\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_glm5_vlm.py"), *TINY, "--mock-data",
                           "--train-iters", "4"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"},
                          timeout=300)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(err) == 1 and err[0].startswith(f"pretrain_glm5_vlm.py: error: megatron-core {OTHER} is installed; ") \
        and err[0].endswith(f"install megatron-core=={TRAINER_VERSIONS[1]}"), err


_WRITER_QUEUE_CHILD = """
import sys, time
from megatron_glm5.training import megatron_hooks
from megatron.core.dist_checkpointing.strategies import filesystem_async
if sys.argv[1] == "hooked":
    megatron_hooks.install_checkpoint_writer_queue()
queue = filesystem_async.get_write_results_queue()  # what megatron-core's async writer calls on its first save
print(queue._manager._process.pid, flush=True)  # the manager process that serves the queue
time.sleep(600)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("mode", ["hooked", "megatron"])
def test_checkpoint_writer_queue_process_dies_with_the_trainer(mode):
    """The writer's results-queue manager process is gone once its trainer is killed (SIGKILL) with the hook;
    megatron-core's own manager outlives it (what the hook is for)."""
    child = subprocess.Popen([sys.executable, "-c", _WRITER_QUEUE_CHILD, mode], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    managers = []
    try:
        managers = [int(child.stdout.readline())]
        assert _alive(managers[0])
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.time() + 10
        while _alive(managers[0]) and time.time() < deadline:
            time.sleep(0.1)
        assert _alive(managers[0]) == (mode == "megatron")
    finally:
        if child.poll() is None:
            child.kill()
        for pid in managers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
