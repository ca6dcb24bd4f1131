"""The megatron-core releases each kind of change of :mod:`megatron_glm5.extensions` is written for (first, last;
inclusive). Imports nothing: the registry and the version guard (:mod:`megatron_glm5.mcore_version`) both read it."""

TRAINER_VERSIONS = ("0.19.2", "0.19.2")
"""First and last megatron-core release whose ``megatron.training`` functions, checkpoint reads and CUDA calls the
trainer hooks, read guards and CPU redirects replace or wrap as they are written here (refused outside it)."""

FIXES_VERSIONS = ("0.16.1", "0.19.2")
"""First and last megatron-core release known to have every defect of ``mcore_fixes.py`` (left out outside it)."""

PERMUTATION_VERSIONS = ("0.16.1", "0.19.2")
"""First and last megatron-core release whose ``token_dispatcher`` calls the functions ``models/token_permutation.py``
replaces as they are there (left out outside it)."""
