"""Shared test fixtures: a single-process megatron-core environment on CPU (gloo + cpu_compat)."""

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


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


def pytest_collection_modifyitems(config, items):
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
