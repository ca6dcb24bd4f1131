"""Shared test fixtures (a single-process megatron-core environment on CPU: gloo + cpu_compat) and the test tiers.

Tiers (markers, one per test; ``pytest -m TIER``):

* ``gpu``: marked ``@pytest.mark.gpu`` (skipped without a CUDA GPU).
* ``e2e``: runs a program in a subprocess (``training_harness.run``: the trainer; ``subprocess``: a tool or script),
  in the test, a helper of its module or a fixture of its module.
* ``distributed``: runs gloo ranks in spawned processes (``tests.helpers.spawn``, ``torch.multiprocessing``).
* ``numerics``: the modules of :data:`NUMERICS_MODULES` (a module against a reference implementation).
* ``unit``: every other test.

A tier marker set on a test by hand is kept. Under pytest-xdist (``--dist loadgroup``) the tests that use a
module- / class- / session-scoped fixture of their own module share one ``xdist_group``, so that fixture is built
once.
"""

import inspect
import os
import types
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


TIERS = ("unit", "numerics", "distributed", "e2e", "gpu")

# modules that check a module's numbers against a reference implementation (transformers, FLA's naive kernels,
# fp64, the whole row on one rank)
NUMERICS_MODULES = frozenset({
    "test_context_parallel", "test_cross_entropy", "test_fp8", "test_fused_optimizer_step", "test_gpu_model_parity",
    "test_grouped_experts", "test_hf_loading", "test_indexer_training", "test_kda", "test_kernels_on_the_interpreter",
    "test_kpool_dsa", "test_mhc", "test_model_parity", "test_mtp", "test_padding_mask", "test_pool_mass",
    "test_recompute", "test_rms_norm", "test_selected_pool_scores", "test_short_conv", "test_sparse_mla",
    "test_sparse_mla_tiling", "test_token_permutation", "test_video_model", "test_vision",
})


def pytest_configure(config):
    # the tier markers are registered in pytest.ini
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # megatron_glm5's own port picks (the in-process rendezvous of initialize_megatron, the converter's
        # workers) draw from this worker's port range, like the tests' (tests/helpers.py)
        from megatron_glm5 import initialize
        from tests.helpers import free_port

        initialize.free_port = initialize._free_port = free_port


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _is(obj, module: str, name: str) -> bool:
    """``obj`` is ``tests/<module>.py``'s ``name`` (imported as ``tests.<module>`` or ``<module>``)."""
    return (getattr(obj, "__name__", None) == name
            and getattr(obj, "__module__", "").rsplit(".", 1)[-1] == module)


def _launches(fn, test_modules: frozenset, seen: set) -> set:
    """{"e2e", "distributed"}: what ``fn`` (a test or fixture function) and the functions of the test modules it
    names start: a program in a subprocess (``subprocess``, ``training_harness.run``), or spawned gloo ranks
    (``helpers.spawn``, ``torch.multiprocessing``'s ``start_processes`` / ``Process``)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return set()
    seen.add(code)
    scope = getattr(fn, "__globals__", {})
    found = set()
    for c in _code_objects(code):
        names = set(c.co_names)
        imports = {n.rsplit(".", 1)[-1] for n in names if "." in n} | names
        if "subprocess" in names or ("training_harness" in imports and "run" in names):
            found.add("e2e")
        if names & {"start_processes", "Process"} or ("spawn" in names and imports & {"helpers", "parallel_harness"}):
            found.add("distributed")
        for name in names:
            obj = scope.get(name)
            if _is(obj, "training_harness", "run"):
                found.add("e2e")
            elif _is(obj, "helpers", "spawn"):
                found.add("distributed")
            elif isinstance(obj, types.FunctionType) and obj.__module__ in test_modules:
                found |= _launches(obj, test_modules, seen)
    return found


def _own_fixtures(item):
    """The fixture definitions ``item`` uses that its own module defines."""
    module = getattr(item, "module", None)
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            if module is not None and getattr(fixturedef.func, "__module__", None) == module.__name__:
                yield fixturedef


def _assign_tiers(items) -> None:
    test_modules = frozenset(item.module.__name__ for item in items if getattr(item, "module", None) is not None)
    cache = {}
    for item in items:
        own = list(_own_fixtures(item))
        if any(fd.scope != "function" for fd in own):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        if any(item.get_closest_marker(t) is not None for t in TIERS):
            continue
        fns = [getattr(item, "function", None)] + [fd.func for fd in own]
        found = set()
        for fn in fns:
            if fn is not None:
                key = getattr(fn, "__code__", fn)
                if key not in cache:
                    cache[key] = _launches(fn, test_modules, set())
                found |= cache[key]
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        tier = ("e2e" if "e2e" in found else "distributed" if "distributed" in found
                else "numerics" if name in NUMERICS_MODULES else "unit")
        item.add_marker(tier)


def _transformers_reference_on_cpu() -> None:
    """transformers' Glm5Next runs its KDA through FLA's Triton kernels whenever ``fla`` imports (torch's registry
    build brings Triton along), and those need a GPU. Without one, the reference is transformers' own PyTorch path:
    its kernel wrappers keep that function as ``__wrapped__``."""
    from transformers.models.glm5_next import modeling_glm5_next as hf

    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(hf, name, None)
        if fn is not None and getattr(fn, "__wrapped__", None) is not None:
            setattr(hf, name, fn.__wrapped__)


def pytest_sessionstart(session):
    """The tests are an entry point: this project's megatron-core changes, as every tool installs them."""
    from megatron_glm5.initialize import install_patches

    install_patches()


@pytest.hookimpl(tryfirst=True)  # before -m selects and before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    _assign_tiers(items)
    if torch.cuda.is_available():
        # GPU runs on shapes FLA has not tuned yet: GLM5_FLA_TUNE_CONFIGS=N trims its autotuners (kernels/fla_tuning)
        from megatron_glm5.kernels.fla_tuning import limit_fla_autotuning_from_env

        limit_fla_autotuning_from_env()
        return
    _transformers_reference_on_cpu()
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the mark (keywords also hold the folder names)
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mcore():
    """Initialise torch.distributed (1 process) and megatron-core parallel state (TP=PP=EP=CP=1)."""
    from megatron_glm5.initialize import initialize_megatron

    initialize_megatron(tp=1, pp=1, ep=1, cp=1, seed=1234)
    yield


def _make_tiny_data(tmp_path_factory, name: str, text_docs: int, vqa_docs: int):
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp(name)
    proc = subprocess.run([sys.executable, os.path.join(repo, "tools", "make_tiny_data.py"), "--out", str(out),
                           "--text-docs", str(text_docs), "--vqa-docs", str(vqa_docs)], capture_output=True,
                          text=True, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A generated tokenizer, indexed text corpus and VQA set, as tools/make_tiny_data.py writes them."""
    return _make_tiny_data(tmp_path_factory, "tiny_data", 8, 12)


@pytest.fixture(scope="session")
def parallel_data(tmp_path_factory):
    """The data of the parallel-layout runs (tools/make_tiny_data.py: 4 text documents, 10 VQA records)."""
    return _make_tiny_data(tmp_path_factory, "parallel_data", 4, 10)


@pytest.fixture(scope="module")
def parallel_workdir(request, tmp_path_factory):
    """A folder per test module for the parallel-layout runs' checkpoints, configs and TensorBoard logs."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
