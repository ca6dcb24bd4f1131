"""megatron_glm5.mcore_fixes: each workaround corrects what it names, and megatron-core's own function (put back for
the test) still shows the bug on the installed version, so a version that fixes it makes its test say so."""

import pytest
import torch

from megatron_glm5 import mcore_fixes

needs = pytest.mark.skipif(not mcore_fixes.needs_fixes(), reason="megatron-core outside AFFECTED_VERSIONS")


def _upstream(monkeypatch, name):
    """Put megatron-core's own function back for ``name`` (for this test only)."""
    owner, attr, _ = mcore_fixes.FIXES[name]
    monkeypatch.setattr(owner, attr, mcore_fixes.UPSTREAM[name])


def test_version_guard():
    for version, affected in (("0.16.1", True), ("0.19.2", True), ("0.19.2rc1", True), ("0.18.0", True),
                              ("0.16.0", False), ("0.20.0", False), ("1.0.0", False)):
        assert mcore_fixes.needs_fixes(version) is affected, version


@needs
def test_apply_is_idempotent_and_installs_every_fix():
    assert mcore_fixes.apply_mcore_fixes() == tuple(mcore_fixes.FIXES)
    assert mcore_fixes.apply_mcore_fixes() == tuple(mcore_fixes.FIXES)
    for name, (owner, attr, replacement) in mcore_fixes.FIXES.items():
        assert getattr(owner, attr) is replacement, name
        assert mcore_fixes.UPSTREAM[name] is not replacement, name


def test_nothing_installed_outside_the_range(monkeypatch):
    monkeypatch.setattr(mcore_fixes, "needs_fixes", lambda version=None: False)
    for name in mcore_fixes.FIXES:
        _upstream(monkeypatch, name)
    assert mcore_fixes.apply_mcore_fixes() == ()
    for name, (owner, attr, _) in mcore_fixes.FIXES.items():
        assert getattr(owner, attr) is mcore_fixes.UPSTREAM[name], name


# ------------------------------------------------------------------------------------------------ MoE router
def _router():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                            moe_router_topk=2, moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
                            moe_router_load_balancing_type="none", use_cpu_initialization=True)
    return TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


@needs
def test_expert_loads_leave_out_padding(mcore, monkeypatch):
    """6 tokens ([s=3, b=2]) over 4 experts, the last sequence position padding: the loads count the 4 real
    tokens' experts only; megatron-core's own masking broadcasts the [tokens] mask over the experts (an error)."""
    mcore_fixes.apply_mcore_fixes()
    torch.manual_seed(0)
    router = _router().train()
    logits = torch.randn(3, 2, 4)
    padding = torch.zeros(3, 2, dtype=torch.bool)
    padding[2] = True
    router.local_tokens_per_expert.zero_()
    _, routing_map = router.routing(logits, padding_mask=padding)
    assert routing_map.sum() == 6 * 2
    torch.testing.assert_close(router.local_tokens_per_expert, routing_map[:4].sum(0).float())
    router.local_tokens_per_expert.zero_()
    router.routing(logits)  # no mask: every token counted, as upstream
    torch.testing.assert_close(router.local_tokens_per_expert, routing_map.sum(0).float())

    _upstream(monkeypatch, "router_expert_bias_padding")
    router.local_tokens_per_expert.zero_()
    with pytest.raises(RuntimeError):
        router.routing(logits, padding_mask=padding)


# ------------------------------------------------------------------------------------ distributed optimizer
class _Tiny(torch.nn.Module):
    """Three bias-free linears whose weights (55, 77, 91 elements) fill two gradient buckets of a 60-element
    bucket size: the first bucket is padded to 256 elements, so the third weight starts behind padding."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 7, bias=False)
        self.b = torch.nn.Linear(7, 11, bias=False)
        self.c = torch.nn.Linear(11, 5, bias=False)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _adam_step(ddp, opt):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(torch.randn(4, 13)).square().sum().backward()
    ddp.finish_grad_sync()
    opt.step()


def _distributed_adam(seed: int, steps: int = 0):
    """(module, megatron DistributedOptimizer) after ``steps`` Adam steps on random inputs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    class Module(MegatronModule):
        def __init__(self):
            super().__init__(cfg)
            self.net = _Tiny()

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(seed)
    module = Module()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=60, grad_reduce_in_fp32=True), module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                 params_dtype=torch.float32), [ddp])
    for _ in range(steps):
        _adam_step(ddp, opt)
    module.ddp = [ddp]  # for further steps (a list: not a submodule)
    inner = getattr(opt, "chained_optimizers", [opt])[0]
    assert isinstance(inner, mcore_fixes.distrib_optimizer.DistributedOptimizer)
    assert len(inner.buffers[0].buckets) == 2
    return module, opt, inner


METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}


def _save_optimizer(module, opt, path, metadata):
    from megatron.core import dist_checkpointing

    sd = opt.sharded_state_dict(module.sharded_state_dict(), is_loading=False, metadata=metadata)
    dist_checkpointing.save({"optimizer": sd}, str(path))


def _fresh_optimizer_loaded(path, metadata):
    """(module, inner distributed optimizer, chained optimizer) of a fresh seed-1 Adam loaded from ``path``."""
    from megatron.core import dist_checkpointing

    module, opt, inner = _distributed_adam(seed=1)
    loaded = dist_checkpointing.load(
        {"optimizer": opt.sharded_state_dict(module.sharded_state_dict(), is_loading=True, metadata=metadata)},
        str(path))
    opt.load_state_dict(loaded["optimizer"])
    return module, inner, opt


def _adam_state(inner, module):
    """{param name: {'exp_avg', 'exp_avg_sq'}} of the torch optimizer (one data-parallel rank: whole params)."""
    out = {}
    for name, p in module.named_parameters():
        group, order = inner.model_param_group_index_map[p]
        main = inner.optimizer.param_groups[group]["params"][order]
        out[name] = {k: inner.optimizer.state[main][k].view(p.shape) for k in ("exp_avg", "exp_avg_sq")}
    return out


@needs
def test_fresh_optimizer_builds_its_state_dict_for_loading(mcore, monkeypatch):
    mcore_fixes.apply_mcore_fixes()
    module, opt, inner = _distributed_adam(seed=0)
    sd = opt.sharded_state_dict(module.sharded_state_dict(), is_loading=True, metadata=METADATA)
    assert {g["step"] for g in sd["optimizer"]["param_groups"]} == {0}

    _upstream(monkeypatch, "distrib_optimizer_fresh_state_dict")
    module, opt, _ = _distributed_adam(seed=0)
    with pytest.raises(AssertionError):
        opt.sharded_state_dict(module.sharded_state_dict(), is_loading=True, metadata=METADATA)


@needs
def test_fully_reshardable_save_reads_each_state_at_its_buffer_index(mcore, monkeypatch):
    """The saved Adam moments of every parameter are that parameter's, also behind the first bucket's padding."""
    mcore_fixes.apply_mcore_fixes()
    module, opt, inner = _distributed_adam(seed=0, steps=2)
    want = _adam_state(inner, module)

    def saved():
        sd = opt.sharded_state_dict(module.sharded_state_dict(), is_loading=False, metadata=METADATA)
        out = {}
        for entry in sd["param_state"].values():
            name = entry["exp_avg"].key.split("optimizer.state.exp_avg.", 1)[1]
            out[name] = {k: entry[k].data for k in ("exp_avg", "exp_avg_sq")}
        return out

    got = saved()
    assert got.keys() == want.keys()
    for name in want:
        for k in ("exp_avg", "exp_avg_sq"):
            assert want[name][k].abs().sum() > 0
            assert torch.equal(got[name][k], want[name][k]), (name, k)

    _upstream(monkeypatch, "distrib_optimizer_bucket_padding")
    got = saved()
    assert not all(torch.equal(got[n]["exp_avg"], want[n]["exp_avg"]) for n in want)


@needs
def test_fully_reshardable_load_restores_the_adam_state(mcore, monkeypatch, tmp_path):
    """Saved after 2 steps, loaded into a fresh optimizer: the same moments and step count; megatron-core's own
    copy asks the checkpoint for torch Adam's per-parameter ``step`` (a KeyError)."""
    mcore_fixes.apply_mcore_fixes()
    module, opt, inner = _distributed_adam(seed=0, steps=2)
    want = _adam_state(inner, module)
    _save_optimizer(module, opt, tmp_path, METADATA)

    def load():
        return _fresh_optimizer_loaded(tmp_path, METADATA)[:2]

    module2, inner2 = load()
    got = _adam_state(inner2, module2)
    for name in want:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][k], want[name][k]), (name, k)
    steps = {float(s["step"]) for s in inner2.optimizer.state.values()}
    assert steps == {2.0}

    _upstream(monkeypatch, "distrib_optimizer_load_keeps_step")
    with pytest.raises(KeyError, match="step"):
        load()


def test_dp_reshardable_load_copies_without_autograd(mcore, monkeypatch, tmp_path):
    """The DP-reshardable format (megatron's default): saved after 2 steps, loaded into a fresh optimizer, the same
    weights and moments; megatron-core's own copy runs with autograd on and writes in place into fp32 main params
    that are views of parameters requiring grad (a RuntimeError)."""
    mcore_fixes.apply_mcore_fixes()
    module, opt, inner = _distributed_adam(seed=0, steps=2)
    want = _adam_state(inner, module)
    want_params = {n: p.detach().clone() for n, p in module.named_parameters()}
    _save_optimizer(module, opt, tmp_path, DP_RESHARDABLE)

    def load():
        return _fresh_optimizer_loaded(tmp_path, DP_RESHARDABLE)[:2]

    module2, inner2 = load()
    got = _adam_state(inner2, module2)
    for name in want:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][k], want[name][k]), (name, k)
        group, order = inner2.model_param_group_index_map[dict(module2.named_parameters())[name]]
        main = inner2.optimizer.param_groups[group]["params"][order]
        assert torch.equal(main.detach().view(want_params[name].shape), want_params[name]), name

    _upstream(monkeypatch, "distrib_optimizer_load_keeps_step")
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        load()


def test_resumed_adam_counts_each_step_once(mcore, monkeypatch, tmp_path):
    """2 Adam steps, save, load into a fresh optimizer, 1 step: every parameter's step count is 3; megatron-core's
    load shares one step tensor between the parameters, which torch's Adam then increments once per parameter."""
    mcore_fixes.apply_mcore_fixes()
    module, opt, inner = _distributed_adam(seed=0, steps=2)
    _save_optimizer(module, opt, tmp_path, DP_RESHARDABLE)

    def resume():
        module2, inner2, opt2 = _fresh_optimizer_loaded(tmp_path, DP_RESHARDABLE)
        _adam_step(module2.ddp[0], opt2)
        return inner2

    inner2 = resume()
    assert {float(s["step"]) for s in inner2.optimizer.state.values()} == {3.0}
    assert len(inner2.optimizer.state) > 1

    _upstream(monkeypatch, "distrib_optimizer_step_per_param")
    assert {float(s["step"]) for s in resume().optimizer.state.values()} != {3.0}


def test_dp_reshardable_save_writes_zeros_between_parameters(mcore, monkeypatch):
    """The buffer's gaps between parameters (the tiny module's buckets have them) are saved as zeros; megatron-core
    saves the uninitialised memory of torch.empty there (filled here with NaN to make it visible)."""
    metadata = DP_RESHARDABLE
    mcore_fixes.apply_mcore_fixes()
    module, opt, inner = _distributed_adam(seed=0, steps=1)

    def padding(state):
        return [v.data for e in mcore_fixes._padding_entries(state) for v in e.values()
                if isinstance(getattr(v, "data", None), torch.Tensor)]

    fixed = padding(opt.sharded_state_dict(module.sharded_state_dict(), is_loading=False, metadata=metadata))
    assert fixed and all(bool((t == 0).all()) for t in fixed)

    _upstream(monkeypatch, "distrib_optimizer_zero_padding")
    real_empty = torch.empty
    monkeypatch.setattr(mcore_fixes.distrib_optimizer.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    upstream = padding(opt.sharded_state_dict(module.sharded_state_dict(), is_loading=False, metadata=metadata))
    assert upstream and all(bool(t.isnan().all()) for t in upstream)


# ------------------------------------------------------------------------------------------- dataset caches
def _indexed(prefix, n_docs, seed):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(n_docs):
        doc = rng.integers(3, 150, size=int(rng.integers(5, 30)))
        b.add_document(torch.tensor(doc), [len(doc)])
    b.finalize(prefix + ".idx")


def _gpt_train_rows(prefix, cache, tok):
    import types

    from megatron_glm5.config import tiny_config
    from megatron_glm5.data.builder import build_train_valid_test_datasets

    args = types.SimpleNamespace(mock_data=False, data_path=[prefix], split="1,0,0", seq_length=16, seed=1,
                                 train_iters=8, global_batch_size=4, eval_iters=0, eval_interval=0,
                                 dataset_type="gpt", data_cache_path=cache)
    ds = build_train_valid_test_datasets(args, tiny_config(), tok)[0]
    return [ds[i]["tokens"].tolist() for i in range(len(ds))]


@needs
def test_dataset_index_cache_follows_its_source_data(monkeypatch, tmp_path):
    """The same prefix re-written with other documents: the fix rebuilds the cached GPTDataset indices (the rows
    equal a fresh build's); megatron-core's own builder loads the old data's cache: other rows, or an IndexError."""
    from megatron_glm5.data.tiny_data import make_tiny_tokenizer
    from megatron_glm5.data.tokenizer import build_tokenizer

    mcore_fixes.apply_mcore_fixes()
    tok = build_tokenizer(make_tiny_tokenizer(str(tmp_path), vocab_size=160))
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    _indexed(prefix, 30, seed=0)
    _gpt_train_rows(prefix, cache, tok)
    _indexed(prefix, 30, seed=1)  # new data, same prefix, same flags: same cache file names
    fresh = _gpt_train_rows(prefix, str(tmp_path / "fresh"), tok)
    assert _gpt_train_rows(prefix, cache, tok) == fresh
    _indexed(prefix, 30, seed=2)
    fresh = _gpt_train_rows(prefix, str(tmp_path / "fresh2"), tok)
    _upstream(monkeypatch, "dataset_cache_gpt")
    try:
        stale = _gpt_train_rows(prefix, cache, tok)
    except IndexError:  # the old sample index cuts rows out of the new documents' lengths
        stale = None
    assert stale != fresh


@needs
def test_dataset_index_cache_is_read_without_pickle(monkeypatch, tmp_path):
    """A cache array that is a pickle (here of plain ints): the fix refuses it in one line and never unpickles;
    megatron-core's own loader unpickles it."""
    import numpy as np
    from megatron.core.datasets import gpt_dataset

    from megatron_glm5.data import DataError
    from megatron_glm5.data.index_cache import load_index_array

    mcore_fixes.apply_mcore_fixes()
    path = str(tmp_path / "x-GPTDataset-train-shuffle_index.npy")
    np.save(path, np.array([1, [2]], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="holds pickled Python objects"):
        load_index_array(path)
    with pytest.raises(ValueError, match="allow_pickle"):
        gpt_dataset.safe_numpy_load(path, allow_pickle=True)  # the deferred read, fixed
    _upstream(monkeypatch, "dataset_cache_gpt_deferred_load")
    assert gpt_dataset.safe_numpy_load(path, allow_pickle=True)[1] == [2]


_SITES = r'''
import json, sys
from megatron_glm5 import mcore_fixes
from megatron_glm5.models import token_permutation
from torch.distributed.checkpoint import default_planner, filesystem
from megatron.core.dist_checkpointing import serialization

sites = {**{"fix:" + k: (o, a) for k, (o, a, _) in mcore_fixes.FIXES.items()},
         **{"permutation:" + k: (o, a) for k, (o, a, _) in token_permutation.PATCHES.items()},
         "dcp:read_metadata": (filesystem.FileSystemReader, "read_metadata"),
         "dcp:load_bytes": (default_planner.DefaultLoadPlanner, "load_bytes"),
         "dcp:load_common": (serialization, "load_common")}
before = {k: getattr(o, a) for k, (o, a) in sites.items()}
import megatron_glm5.models.builder, megatron_glm5.models.model, megatron_glm5.models.layer_specs  # noqa: E401
from megatron_glm5.config import Glm5Config, glm5_flash_config, tiny_config, tiny_hf_config
tiny_config(); glm5_flash_config(); Glm5Config.from_hf(tiny_hf_config(mtp=True), moe_experts_backend="grouped")
after_config = sorted(k for k, (o, a) in sites.items() if getattr(o, a) is not before[k])
from megatron_glm5.initialize import install_patches
install_patches()
after_install = sorted(k for k, (o, a) in sites.items() if getattr(o, a) is not before[k])
print(json.dumps({"config": after_config, "install": after_install, "sites": sorted(sites)}))
'''


@needs
def test_building_a_config_patches_nothing_and_the_entry_points_install_everything():
    """In a fresh process: importing the model modules and building configs leaves every megatron-core / torch DCP
    function this project replaces as it was; ``install_patches`` (what every entry point calls) replaces all."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _SITES], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["config"] == []
    assert got["install"] == got["sites"] and len(got["sites"]) == len(mcore_fixes.FIXES) + 4 + 3


def test_token_permutation_version_guard(monkeypatch):
    from megatron_glm5.models import token_permutation

    for name, (owner, attr, _) in token_permutation.PATCHES.items():  # megatron-core's own, for this test
        monkeypatch.setattr(owner, attr, token_permutation._upstream_dtoh if attr == "_maybe_dtoh_and_synchronize"
                            else getattr(token_permutation.moe_utils, attr))
    assert token_permutation.install("0.20.0") == ()
    for name, (owner, attr, replacement) in token_permutation.PATCHES.items():
        assert getattr(owner, attr) is not replacement, name
    assert token_permutation.install("0.19.2") == tuple(token_permutation.PATCHES)
    for name, (owner, attr, replacement) in token_permutation.PATCHES.items():
        assert getattr(owner, attr) is replacement, name


# ------------------------------------------------------------------------------------- DSA indexer-loss logging
def _indexer_loss_log(upstream: bool):
    """pp2 on gloo: stage 0 holds no DSA layer (tracked nothing), stage 1 tracked two slots; both log."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    from megatron_glm5.initialize import initialize_megatron

    initialize_megatron(pp=2)
    if upstream:
        DSAIndexerLossLoggingHelper.reduce_loss_in_tracker = mcore_fixes.UPSTREAM["dsa_indexer_loss_every_stage"]
    if torch.distributed.get_rank() == 1:
        DSAIndexerLossLoggingHelper.save_loss_to_tracker(torch.tensor(0.25), 1, 2)
        DSAIndexerLossLoggingHelper.save_loss_to_tracker(torch.tensor(0.75), 2, 2)
    if upstream:  # stage 0 returns at once; stage 1 would wait in its all-reduce: ask whether it would
        values = DSAIndexerLossLoggingHelper.tracker.get("values")
        return None if values is None else values.tolist()
    totals = {}
    DSAIndexerLossLoggingHelper.track_indexer_metrics(loss_scale=1.0, iteration=1, writer=None,
                                                      total_loss_dict=totals)
    return float(totals["indexer loss"])


@needs
def test_indexer_loss_log_with_a_stage_without_dsa_layers(mcore):
    """Megatron-LM logs 'indexer loss' on every rank; upstream, a pipeline stage that tracked no indexer loss skips
    the pipeline all-reduce the others enter (a hang until the group times out). With the fix both stages log the
    mean over the two slots, 0.5."""
    from tests.parallel_harness import spawn

    assert spawn(_indexer_loss_log, 2, True) == [None, [0.25, 0.75]]  # upstream: only stage 1 would all-reduce
    assert spawn(_indexer_loss_log, 2, False) == [0.5, 0.5]
