"""The start-up table of backends and the capability checks (CPU: the CUDA queries are stubbed)."""

import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models import builder


def _fake_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def _config(**backends):
    return Glm5Config.from_hf(tiny_hf_config(), use_cpu_initialization=True, **backends)


def _row(table: str, key: str) -> str:
    (row,) = [ln for ln in table.splitlines() if ln.strip().startswith(key)]
    return row


def test_cpu_table_names_the_reason_for_every_setting():
    table = builder.describe_backends(_config(**builder.default_backends("cpu")), "cpu")
    assert table.splitlines()[0] == "megatron_glm5 backends (CPU):"
    for key in ("kda_backend", "dsa_backend", "moe_experts_backend", "moe_cuda_graph", "triton kernels"):
        assert "fallback: no CUDA device" in _row(table, key), table


def test_hopper_with_triton_and_fla_runs_every_fast_path(monkeypatch):
    pytest.importorskip("triton")
    pytest.importorskip("fla.ops.kda")
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert builder.backend_fallbacks("cuda") == {}
    backends = builder.default_backends("cuda")
    assert {k: backends[k] for k in builder.FAST_BACKENDS} == builder.FAST_BACKENDS
    table = builder.describe_backends(_config(**backends, bf16=True), "cuda")   # fp32: test_execution_plan.py
    assert table.splitlines()[0] == "megatron_glm5 backends (NVIDIA H200, sm_90):"
    for key in builder.FAST_BACKENDS:
        assert _row(table, key).endswith("fast path"), table


def test_pre_hopper_gpu_runs_the_dsa_reference_and_says_why(monkeypatch):
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    backends = builder.default_backends("cuda")
    assert backends["dsa_backend"] == "torch" and backends["moe_experts_backend"] == "grouped"
    row = _row(builder.describe_backends(_config(**backends), "cuda"), "dsa_backend")
    assert "fallback: NVIDIA A100-SXM4-80GB is sm_80" in row and "sm_90" in row


def test_missing_triton_is_named(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    why = builder.backend_fallbacks("cuda")
    assert set(why) == {"dsa_backend", "kda_backend"}
    assert all("'import triton' failed (ModuleNotFoundError" in v for v in why.values()), why
    backends = builder.default_backends("cuda")
    assert backends["dsa_backend"] == "torch" and backends["kda_backend"] == "torch"


def test_blocked_moe_graphs_say_what_blocks_them(monkeypatch):
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    cfg = _config(moe_cuda_graph=True, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-3)
    row = _row(builder.describe_backends(cfg, "cuda"), "moe_cuda_graph")
    assert "fallback: the MoE layers run eagerly: graphs are blocked by the global aux loss (it reduces over the " \
           "data-parallel group inside the layer)" in row
    cfg = _config(moe_cuda_graph=True, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3)
    assert _row(builder.describe_backends(cfg, "cuda"), "moe_cuda_graph") == \
        _row(builder.describe_backends(_config(moe_cuda_graph=True), "cuda"), "moe_cuda_graph")  # not a blocker
    row = _row(builder.describe_backends(_config(dsa_backend="torch"), "cuda"), "dsa_backend")
    assert "set by flag or config (fast path: fused)" in row


@pytest.mark.parametrize("props,want", [
    (SimpleNamespace(major=9, minor=0, shared_memory_per_block_optin=232448), (200 * 1024, True)),
    (SimpleNamespace(major=8, minor=0, shared_memory_per_block_optin=166912), (166912 - 8192, False)),
    (SimpleNamespace(major=8, minor=9, shared_memory_per_block_optin=101376), (101376 - 8192, False)),
])
def test_sparse_mla_fits_the_device(monkeypatch, props, want):
    """The sparse MLA kernel's shared-memory budget and vector reductions follow the device; every planned tiling
    fits that budget, so the kernel compiles off Hopper too."""
    from megatron_glm5.kernels import sparse_mla as sm
    from megatron_glm5.kernels import triton_support as ts

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    ts.device_limits.cache_clear()
    try:
        budget, vec = ts.device_limits(0)
    finally:
        ts.device_limits.cache_clear()
    assert (budget, vec) == want
    R = 512
    fwd = ts.fit_gather_tiling(sm.FWD_CONFIG, R, budget)
    assert (fwd["BLOCK_H"] + fwd["num_stages"] * fwd["BLOCK_N"]) * R * 2 <= budget
    for dq, dkv, t in sm._bwd_passes(sm.BWD_CONFIG, [(True, False), (False, True), (True, True)], R, budget):
        assert ((4 if dq and dkv else 2) * t["BLOCK_H"] + t["BLOCK_N"]) * R * 2 <= budget, t
