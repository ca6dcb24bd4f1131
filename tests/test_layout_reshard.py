"""A checkpoint *saved* at TP2 / EP2 / PP2 (two gloo processes, weights read with the HF loader at that layout)
loads at TP1 equal to the HF checkpoint loaded directly at TP1."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import free_port

LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}


def _save_worker(rank, world, port, hf_dir, out, layout):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_glm5.checkpoint.hf_io import load_hf_checkpoint
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.initialize import destroy_megatron, initialize_megatron
    from megatron_glm5.models.builder import build_model

    tp, pp, ep = layout
    try:
        initialize_megatron(tp=tp, pp=pp, ep=ep)
        cfg = Glm5Config.from_hf(hf_dir, use_cpu_initialization=True, perform_initialization=False,
                                 tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, sequence_parallel=False)
        model = build_model(cfg, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        load_hf_checkpoint(model, hf_dir)  # strict: every local key present, nothing of this shard left over
        dist_checkpointing.save(model.sharded_state_dict(), out)
    finally:
        destroy_megatron()


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint

    from megatron_glm5.config import tiny_hf_config

    return write_checkpoint(str(tmp_path_factory.mktemp("reshard") / "hf"), tiny_hf_config(), fmt="fp32", seed=8)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_saved_at_other_layout_loads_at_tp1(name, hf_ckpt, tmp_path, mcore):
    from megatron.core import dist_checkpointing

    from megatron_glm5.checkpoint.hf_io import load_hf_checkpoint
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.builder import build_model

    out = str(tmp_path / name)
    os.makedirs(out)
    mp.start_processes(_save_worker, args=(2, free_port(), hf_ckpt, out, LAYOUTS[name]), nprocs=2, join=True,
                       start_method="spawn")

    def fresh():
        cfg = Glm5Config.from_hf(hf_ckpt, use_cpu_initialization=True, perform_initialization=False)
        return build_model(cfg)

    ref = fresh()
    load_hf_checkpoint(ref, hf_ckpt)
    got = fresh()
    loaded = dist_checkpointing.load(got.sharded_state_dict(), out)
    loaded.pop("checkpoint_version", None)  # the common state Megatron-LM's loader reads
    got.load_state_dict(loaded, strict=True)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    n = 0
    for k, v in ref_sd.items():
        if torch.is_tensor(v) and not k.endswith("local_tokens_per_expert"):
            assert torch.equal(v, got_sd[k]), k
            n += 1
    assert n > 100
