"""The execution plan: the table for the CPU quickstart and for a CUDA bf16 config (the device faked on CPU), the
modules following the plan they are built with, and no module reading a backend switch any other way."""

import ast
import os
import sys
import types

import pytest
import torch

import megatron_glm5
from megatron_glm5.config import Glm5Config, tiny_config, tiny_hf_config
from megatron_glm5.execution_plan import resolve_execution_plan


def _rows(plan):
    return {key: (value, state) for key, value, state in plan.rows}


def test_cpu_quickstart_plan_table():
    """The quickstart's tiny model on a CPU: every switch on its PyTorch reference, each row saying why."""
    plan = resolve_execution_plan(tiny_config(), "cpu")
    assert plan.table().splitlines() == [
        "megatron_glm5 backends (CPU):",
        "  kda_backend          torch      fallback: no CUDA device: the PyTorch reference",
        "  dsa_backend          torch      fallback: no CUDA device: the PyTorch reference",
        "  moe_experts_backend  sequential fallback: no CUDA device: the PyTorch reference",
        "  moe_cuda_graph       False      fallback: no CUDA device: the PyTorch reference",
        "  triton kernels       False      fallback: no CUDA device: the PyTorch references (mHC, expert GLU, RMSNorm, "
        "cross entropy, short convolution, indexer scores)",
        "  dtype                fp32       fp32 model",
    ]
    assert (plan.kda_backend, plan.dsa_backend, plan.moe_experts_backend) == ("torch", "torch", "sequential")
    assert not (plan.moe_cuda_graph or plan.kda_save_intermediates or plan.triton_kernels or plan.rms_norm_fused
                or plan.mhc_fused or plan.indexer_fused_scores)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device on this machine as far as the plan asks: available, named, triton and FLA importable."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name in ("triton", "fla", "fla.ops", "fla.ops.kda"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    from megatron_glm5.kernels import triton_support

    monkeypatch.setattr(triton_support, "HAVE_TRITON", True)


def test_cuda_bf16_plan_table(fake_gpu, monkeypatch):
    """A bf16 training config on a (faked) sm_90 device: every fast path, the table saying so, and where Triton
    keeps what the first step compiles."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton-cache")
    cfg = Glm5Config.from_hf(tiny_hf_config(), use_cpu_initialization=True, bf16=True)
    plan = resolve_execution_plan(cfg, "cuda", capability=(9, 0))
    assert plan.table().splitlines() == [
        "megatron_glm5 backends (NVIDIA H100 80GB HBM3, sm_90):",
        "  kda_backend          fla_fused  fast path",
        "  kda_conv_kernel      triton     fast path",
        "  kda_save_intermediates True       fast path",
        "  dsa_backend          fused      fast path",
        "  moe_experts_backend  grouped    fast path",
        "  moe_cuda_graph       True       fast path",
        "  triton kernels       True       fast path (mHC, expert GLU, RMSNorm, cross entropy, short convolution, "
        "indexer scores)",
        "  dtype                bf16       bf16 model",
        "  the first step compiles the Triton kernels (and tunes FLA's) not yet in Triton's cache "
        "(/shared/triton-cache): minutes on a fresh machine",
    ]
    assert plan.rms_norm_fused and plan.mhc_fused and plan.indexer_fused_scores and plan.kda_save_intermediates
    assert plan.moe_graph_blockers == ()


def test_cuda_plan_falls_back_with_reasons(fake_gpu):
    """sm_80: DSA on its reference; fp32: the PyTorch KDA (FLA's kernels take TF32 products) and megatron-core's
    experts, so no MoE graphs (SequentialMLP
    reads the token counts on the host: a capture fails); recompute: eager MoE layers while it is on; an explicit
    choice is kept and named as such."""
    cfg = Glm5Config.from_hf(tiny_hf_config(), use_cpu_initialization=True, recompute_granularity="full",
                             recompute_method="uniform", recompute_num_layers=1)
    rows = _rows(resolve_execution_plan(cfg, "cuda", capability=(8, 0)))
    assert rows["dsa_backend"] == ("torch", "fallback: NVIDIA H100 80GB HBM3 is sm_80; the sparse MLA kernel is tuned "
                                            "for sm_90 (Hopper): the masked dense reference, memory quadratic in "
                                            "length")
    assert rows["kda_backend"] == ("torch", "fallback: fp32: FLA's KDA kernels take TF32 products; the PyTorch "
                                            "chunked KDA keeps fp32")
    assert "kda_save_intermediates" not in rows
    assert rows["moe_experts_backend"] == ("sequential", "fallback: megatron-core's SequentialMLP: grouped GEMMs are "
                                                         "blocked by fp32 (the grouped GEMMs run in bf16)")
    assert rows["moe_cuda_graph"] == ("False", "fallback: the MoE layers run eagerly: graphs are blocked by "
                                               "recompute_granularity=full, the sequential experts (megatron-core's "
                                               "SequentialMLP reads the token counts on the host)")
    cfg = Glm5Config.from_hf(tiny_hf_config(), use_cpu_initialization=True, recompute_granularity="full",
                             recompute_method="uniform", recompute_num_layers=1, bf16=True)
    plan = resolve_execution_plan(cfg, "cuda", capability=(9, 0))   # recompute alone: asked again each step
    assert plan.moe_cuda_graph and plan.moe_graph_blockers == ("recompute_granularity=full",)
    cfg = Glm5Config.from_hf(tiny_hf_config(), use_cpu_initialization=True, moe_experts_backend="grouped",
                             moe_cuda_graph=True)                  # fp32, grouped asked for: it falls back
    rows = _rows(resolve_execution_plan(cfg, "cuda", capability=(9, 0)))
    assert rows["moe_experts_backend"] == ("grouped", "fallback: GroupedExperts runs megatron-core's SequentialMLP: "
                                                      "grouped GEMMs are blocked by fp32 (the grouped GEMMs run in "
                                                      "bf16)")
    assert rows["moe_cuda_graph"][0] == "False" and "the sequential experts" in rows["moe_cuda_graph"][1]
    cfg = Glm5Config.from_hf(tiny_hf_config(), use_cpu_initialization=True, bf16=True, dsa_backend="sparse")
    assert _rows(resolve_execution_plan(cfg, "cuda", capability=(9, 0)))["dsa_backend"] == \
        ("sparse", "set by flag or config (fast path: fused)")


def test_modules_run_the_plan_they_are_built_with(mcore):
    from megatron_glm5.models.builder import build_model

    cfg = Glm5Config.from_hf(tiny_hf_config(with_vision=False), use_cpu_initialization=True)
    plan = resolve_execution_plan(cfg, "cpu").replace(dsa_backend="sparse", moe_experts_backend="grouped",
                                                      moe_cuda_graph=True)
    cfg.execution_plan = plan
    model = build_model(cfg)
    modules = list(model.modules())
    dsa = [m for m in modules if type(m).__name__ == "Glm5DSAttention"]
    experts = [m for m in modules if type(m).__name__ == "GroupedExperts"]
    assert dsa and all(m.backend == "sparse" for m in dsa)
    assert experts and all(m.plan == plan for m in experts)  # (megatron-core hands the experts a copy of the config)
    assert all(m.plan == plan for m in modules if type(m).__name__ in ("RMSNorm", "HyperConnection", "KPoolIndexer"))
    assert any(getattr(m, "mlp_graphs", None) is not None for m in modules)
    assert cfg.kda_backend is None and cfg.dsa_backend is None  # the config left them to the plan


# -------------------------------------------------------------------------------------------- static check
SWITCHES = {"kda_backend", "dsa_backend", "moe_experts_backend", "moe_cuda_graph", "kda_conv_kernel",
            "kda_save_intermediates", "mhc_stream_grad_fusion"}
"""The config's backend fields: only the plan (and the config / the flags that fill it) read them."""
CLASS_SWITCHES = {"use_fused_kernels", "use_fused_scores", "fuse_topk_keys", "score_chunk_elements", "force_grouped"}
"""Former class-attribute switches: gone for good."""
PROBES = {"get_device_capability", "HAVE_TRITON"}
"""Device and kernel-availability probes: the plan's, and the kernels' own guards."""
ALLOWED = {"megatron_glm5/execution_plan.py", "megatron_glm5/training/arguments.py"}


def _reads(path):
    """(line, what) of every switch read in ``path`` that does not go through a plan."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SWITCHES | CLASS_SWITCHES | PROBES:
            base = node.value
            if isinstance(base, ast.Call):  # plan_of(config).x
                base = base.func
            through_plan = (isinstance(base, ast.Name) and "plan" in base.id) or \
                (isinstance(base, ast.Attribute) and "plan" in base.attr)
            if node.attr in PROBES and "/kernels/" in path:
                continue  # a kernel guarding its own launch
            if not through_plan:
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                    node.args[1].value in SWITCHES | CLASS_SWITCHES:
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            for t in targets:
                if isinstance(t, ast.Name) and t.id in CLASS_SWITCHES:
                    out.append((node.lineno, t.id))
    return out


def test_no_module_reads_a_backend_switch_except_through_the_plan():
    root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_glm5.__file__)))
    bad, seen = [], 0
    for folder, _, files in os.walk(os.path.join(root, "megatron_glm5")):
        for f in files:
            rel = os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/")
            if not f.endswith(".py") or rel in ALLOWED or rel.startswith("megatron_glm5/config/"):
                continue
            seen += 1
            bad += [f"{rel}:{line}: {what}" for line, what in _reads(os.path.join(folder, f))]
    assert seen > 50 and bad == []


def test_the_static_check_finds_a_switch_read(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n    use_fused_kernels = True\n\n"
                   "def f(config, plan):\n    return config.dsa_backend, plan.dsa_backend, getattr(config, 'kda_backend')\n")
    assert [what for _, what in _reads(str(src))] == ["use_fused_kernels", "config.dsa_backend",
                                                      "getattr(config, 'kda_backend')"]


@pytest.mark.parametrize("flags, kda, kda_state", [
    ([], "torch", "fallback: fp32: FLA's KDA kernels take TF32 products; the PyTorch chunked KDA keeps fp32"),
    (["--bf16"], "fla_fused", "fast path"),
    (["--kda-backend", "fla"], "fla", "set by flag or config (fast path: fla_fused)"),
])
def test_trainer_config_runs_what_its_table_says(mcore, fake_gpu, monkeypatch, flags, kda, kda_state):
    """The trainer's config (``model_config_from_args`` on a faked sm_90 device) leaves every backend the flags do
    not set to the plan: the table's KDA row is the plan's choice for the dtype (fp32: the PyTorch KDA, not the fast
    path), and the modules built from that plan run exactly the table's rows (KDA / DSA backend, expert class, MoE
    graph wrappers)."""
    from megatron_glm5.models.builder import build_model
    from megatron_glm5.models.grouped_experts import GroupedExperts
    from megatron_glm5.models.kda import KimiDeltaAttention
    from megatron_glm5.models.kpool_dsa import Glm5DSAttention
    from megatron_glm5.training.arguments import model_config_from_args, parse_args

    args = parse_args(["--model-preset", "glm5-tiny", "--seq-length", "32", "--micro-batch-size", "2",
                       "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--mock-data"] + flags, world_size=1)
    cfg = model_config_from_args(args, "cuda")
    assert (cfg.kda_backend, cfg.dsa_backend, cfg.moe_experts_backend, cfg.moe_cuda_graph,
            cfg.kda_save_intermediates) == (args.kda_backend, None, None, None, None)
    plan = resolve_execution_plan(cfg, "cuda", capability=(9, 0))
    rows = _rows(plan)
    assert rows["kda_backend"] == (kda, kda_state)
    bf16 = "--bf16" in flags
    assert rows["dsa_backend"] == ("fused", "fast path")
    assert rows["moe_experts_backend"][0] == ("grouped" if bf16 else "sequential")
    assert rows["moe_cuda_graph"][0] == str(bf16)
    monkeypatch.undo()                                   # build the plan's modules on this CPU
    cfg.use_cpu_initialization = True
    cfg.execution_plan = plan
    modules = list(build_model(cfg).modules())
    kda_modules = [m for m in modules if isinstance(m, KimiDeltaAttention)]
    dsa_modules = [m for m in modules if isinstance(m, Glm5DSAttention)]
    layers = [m for m in modules if getattr(m, "is_moe_layer", False)]
    assert kda_modules and {m.backend for m in kda_modules} == {rows["kda_backend"][0]}
    assert {m.save_intermediates for m in kda_modules} == {rows.get("kda_save_intermediates", ("False",))[0] == "True"}
    assert dsa_modules and {m.backend for m in dsa_modules} == {rows["dsa_backend"][0]}
    assert any(isinstance(m, GroupedExperts) for m in modules) == (rows["moe_experts_backend"][0] == "grouped")
    assert layers and {m.mlp_graphs is not None for m in layers} == {rows["moe_cuda_graph"][0] == "True"}
