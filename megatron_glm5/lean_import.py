"""Start-up of tools that run no model code (the checkpoint converter): megatron-core without its compiled fusions.

megatron-core decorates its fusion functions (bias + GeLU/GeGLU/SwiGLU, ...) with ``megatron.core.jit.jit_fuser``,
which is ``torch.compile`` on torch >= 2.2, when their modules are imported, and ``megatron.core``'s package import
imports them all: each ``torch.compile`` call imports TorchDynamo and the Inductor configuration, about 2 s of
start-up on a 2-core CPU machine (a third of the converter's import time). megatron's own switch,
``megatron.core.jit.disable_jit_fuser()``, cannot be called before that import (it lives in the package it would
have to precede). :func:`import_megatron_without_compile` imports megatron-core with ``torch.compile`` replaced by a
pass-through decorator for the length of the import and then turns megatron's switch off as well, so the fusion
functions stay plain eager functions in this process (the same results; only speed differs, and a converter never
calls them: its model lives on the meta device). Call it before anything imports megatron-core; once megatron-core
is imported it does nothing. Its registry record: ``lean_import`` of :mod:`megatron_glm5.extensions` (transient).
"""

from __future__ import annotations

import sys


def import_megatron_without_compile() -> bool:
    """Import megatron-core with its import-time ``torch.compile`` calls skipped (see the module docstring).
    Returns False (and changes nothing) when megatron-core was already imported."""
    if "megatron.core" in sys.modules:
        return False
    import torch

    real = torch.compile

    def passthrough(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = passthrough
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = real
    return True
