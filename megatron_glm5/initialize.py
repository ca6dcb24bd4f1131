"""Process-group setup shared by the tools, the training script and the tests."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_patches() -> None:
    """This project's changes to megatron-core, installed by every entry point (idempotent), each for the
    megatron-core releases it is written for (:mod:`megatron_glm5.mcore_version`): checkpoint reads that run no code
    from the checkpoint (:func:`megatron_glm5.checkpoint.safe_load.install_dcp_read_guards`; another release is
    refused with one line, :class:`~megatron_glm5.mcore_version.UnsupportedMegatronCore`), the fixes of
    :mod:`megatron_glm5.mcore_fixes` and the MoE token permutation of :mod:`megatron_glm5.models.token_permutation`
    in megatron-core's dispatchers (outside their releases left out, said in one line on stderr), and the torch
    versions of the Apex / Transformer Engine calls megatron-core falls back from (:mod:`megatron_glm5.mcore_extensions`:
    multi-tensor norm and scale, gradient-accumulation fusion). Each is a record of :mod:`megatron_glm5.extensions`
    (``--help-extensions`` lists them)."""
    from megatron_glm5 import mcore_extensions, mcore_version
    from megatron_glm5.checkpoint.safe_load import install_dcp_read_guards
    from megatron_glm5.mcore_fixes import AFFECTED_VERSIONS, apply_mcore_fixes
    from megatron_glm5.models import token_permutation

    mcore_version.require_version(mcore_version.TRAINER_VERSIONS,
                                  "the checkpoint read guards (checkpoint/safe_load.py: megatron-core's common.pt)")
    install_dcp_read_guards()
    if mcore_version.skip_notice(AFFECTED_VERSIONS, "the megatron-core fixes of mcore_fixes.py"):
        apply_mcore_fixes()
    if mcore_version.skip_notice(token_permutation.SUPPORTED_VERSIONS,
                                 "the MoE token permutation (models/token_permutation.py)"):
        token_permutation.install()
    mcore_extensions.install()


def initialize_megatron(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, vpp: int | None = None,
                        seed: int = 1234, backend: str | None = None, etp: int | None = None) -> None:
    """Initialise torch.distributed (from torchrun's env, or a 1-process group) and megatron's parallel state.

    ``tp`` tensor, ``pp`` pipeline, ``vpp`` virtual pipeline stages per rank (None: no interleaving), ``ep``
    expert, ``etp`` expert-tensor (None: = tp), ``cp`` context parallel size; the data-parallel size is what is
    left: ``world / (tp * pp * cp)`` (experts: ``world / (etp * ep * pp)``). A layout that does not divide the world
    size raises ``ValueError`` with one line. On a machine without CUDA this also enables
    :mod:`megatron_glm5.cpu_compat` and uses gloo; it installs this project's megatron-core changes
    (:func:`install_patches`).
    """
    if not torch.cuda.is_available():
        from megatron_glm5.cpu_compat import enable_cpu_compat

        enable_cpu_compat()
    install_patches()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    etp = tp if etp is None else etp
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("etp", etp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp * pp * cp}")
    if world % (etp * ep * pp):
        raise ValueError(f"world size {world} is not divisible by etp*ep*pp = {etp * ep * pp} (expert layout)")
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(f"vpp {vpp} needs pp > 1")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ensure_initialized(require_tp1: bool = False, who: str = "this tool") -> None:
    """Initialise a 1-process megatron parallel state (TP=PP=EP=CP=1) unless one exists.

    ``require_tp1``: refuse an existing state whose TP/PP/EP/CP sizes are not all 1 (tools that build the whole
    model on the meta device; the world may hold several data-parallel writer processes)."""
    install_patches()
    if not parallel_state.model_parallel_is_initialized():
        initialize_megatron()
        return
    if require_tp1:
        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_expert_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size())
        if sizes != (1, 1, 1, 1):
            raise RuntimeError(f"{who} needs megatron parallel state TP=PP=EP=CP=1, found TP/PP/EP/CP {sizes}; "
                               "run it in its own process")


free_port = _free_port  # a free loopback TCP port for a torch.distributed rendezvous (workers, tests)
