"""The registry of every runtime change (megatron_glm5/extensions.py): what the installers rebind in megatron-core,
megatron.training and torch is exactly what its records name, each through its version guard."""

import json
import os
import subprocess
import sys

import pytest

from megatron_glm5 import extensions, mcore_version
from megatron_glm5.mcore_version import UnsupportedMegatronCore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every install an entry point makes on a CPU machine, the __dict__ of every megatron / torch module and class
# compared by identity before and after
_DIFF = r"""
import json, sys, types
import torch
import megatron.training.training, megatron.training.checkpointing, megatron.training.arguments  # noqa
import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa
import megatron_glm5.mcore_fixes, megatron_glm5.models.token_permutation, megatron_glm5.training.entry  # noqa
import megatron_glm5.checkpoint.safe_load, torch.distributed.checkpoint.filesystem  # noqa
import warnings
warnings.simplefilter("ignore")

def owners():
    out = {}
    for name, m in list(sys.modules.items()):
        if isinstance(m, types.ModuleType) and (name.startswith("megatron.") or name.startswith("torch")):
            out[name] = m
            for k, v in list(vars(m).items()):
                if isinstance(v, type) and getattr(v, "__module__", None) == name:
                    out[name + "." + k] = v
    out["torch.Tensor"] = torch.Tensor
    return out

objs = owners()
before = {n: dict(vars(o)) for n, o in objs.items()}
from megatron_glm5.cpu_compat import enable_cpu_compat
from megatron_glm5.initialize import install_patches
from megatron_glm5.training import flops, megatron_hooks, memory_report, moe_load_logging, quiet, save_guard
enable_cpu_compat()
install_patches()
megatron_hooks.install(); flops.install(); memory_report.install(); moe_load_logging.install(); save_guard.install()
megatron_hooks.install_checkpoint_writer_queue(); quiet.install_prints()
again = {n: dict(vars(o)) for n, o in objs.items()}
install_patches()
megatron_hooks.install(); memory_report.install(); save_guard.install(); quiet.install_prints()
changed = sorted(n + "." + k for n in objs for k in set(before[n]) | set(again[n])
                 if k != "__annotations__" and again[n].get(k, "<none>") is not before[n].get(k, "<none>"))
twice = sorted(n + "." + k for n, o in objs.items() for k in vars(o) if vars(o)[k] is not again[n].get(k))
print(json.dumps({"changed": changed, "twice": twice}))
"""


@pytest.fixture(scope="module")
def rebound():
    proc = subprocess.run([sys.executable, "-c", _DIFF], capture_output=True, text=True, cwd=REPO, timeout=400,
                          env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_rebound_attribute_has_a_record_and_every_record_is_rebound(rebound):
    targets = {t for r in extensions.REGISTRY if not r.transient for t in r.targets}
    unrecorded = sorted(set(rebound["changed"]) - targets)
    assert unrecorded == [], unrecorded
    # on a CPU without Apex every record's targets are installed (none of them needs CUDA, Apex or TE)
    missing = sorted(targets - set(rebound["changed"]))
    assert missing == [], missing
    assert len(targets) == len(rebound["changed"]) > 90


def test_installing_again_rebinds_nothing(rebound):
    assert rebound["twice"] == []


def test_the_converters_lean_import_restores_torch_compile():
    code = ("import torch; real = torch.compile\n"
            "from megatron_glm5.lean_import import import_megatron_without_compile\n"
            "assert import_megatron_without_compile() is True and torch.compile is real\n"
            "from megatron.core import jit; print(jit.jit_fuser is jit.noop_decorator)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
    assert extensions.BY_NAME["lean_import"].transient


def test_every_record_is_described_and_names_its_installer():
    import importlib

    assert len({r.name for r in extensions.REGISTRY}) == len(extensions.REGISTRY)
    for r in extensions.REGISTRY:
        assert r.kind in ("wrap", "replace", "hook") and r.what and r.why and r.targets, r.name
        assert r.versions in ("trainer", "fixes", "permutation", "any"), r.name
        module, fn = r.installer.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), fn)), r.installer
        if r.versions == "fixes" and r.bug:
            path, test = r.test.split("::")
            assert f"def {test}(" in open(os.path.join(REPO, path)).read(), r.test


def test_an_unknown_megatron_core_is_refused_in_one_line_and_nothing_bound(monkeypatch):
    class Owner:
        attr = "megatron-core's own"

    monkeypatch.setattr(mcore_version, "MCORE_VERSION", "0.20.0")
    record = extensions.BY_NAME["compile_helpers"]
    with pytest.raises(UnsupportedMegatronCore) as e:
        extensions.apply(record, "ours", owner=Owner, attr="attr")
    assert str(e.value) == ("megatron-core 0.20.0 is installed; the trainer hooks (training/megatron_hooks.py) is "
                            "written for megatron-core 0.19.2: install megatron-core==0.19.2")
    assert Owner.attr == "megatron-core's own"
    fix = extensions.BY_NAME["router_expert_bias_padding"]  # a defect workaround is left out instead
    monkeypatch.setattr(mcore_version, "_NOTICES", set())
    assert extensions.apply(fix, "ours", owner=Owner, attr="attr") is False
    assert Owner.attr == "megatron-core's own"


def test_apply_binds_once():
    class Owner:
        attr = "upstream"

    record = extensions.BY_NAME["compile_helpers"]
    assert extensions.apply(record, "ours", owner=Owner, attr="attr") is True
    assert extensions.apply(record, "again", owner=Owner, attr="attr") is False
    assert Owner.attr == "ours"
    Owner.attr = "someone else's"  # e.g. a test's monkeypatch: bound again over it
    assert extensions.apply(record, "ours 2", owner=Owner, attr="attr") is True and Owner.attr == "ours 2"


def test_help_extensions_prints_the_table_without_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['pretrain_glm5_vlm.py', "
                           "'--help-extensions']; runpy.run_path('pretrain_glm5_vlm.py', run_name='__main__')"],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == extensions.table().strip()
    for r in extensions.REGISTRY:
        assert f"\n{r.name} [{r.kind}]" in proc.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys; from megatron_glm5 import extensions; "
                            "extensions.table(); print('torch' in sys.modules, 'megatron' in sys.modules)"],
                           capture_output=True, text=True, cwd=REPO, timeout=120,
                           env={**os.environ, "PYTHONPATH": REPO})
    assert probe.stdout.strip() == "False False", probe.stderr[-2000:]
