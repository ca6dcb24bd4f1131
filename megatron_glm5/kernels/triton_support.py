"""The kernels' one optional import of Triton: on a machine without it ``triton`` and ``tl`` are None and
``HAVE_TRITON`` is False, and the models run the PyTorch references."""

import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "cache_dir", "tl", "triton"]


def cache_dir() -> str:
    """The folder of Triton's disk cache: compiled kernels and, with ``TRITON_CACHE_AUTOTUNING=1`` (set by the
    training entry), autotuning results. Triton's own setting where it has one (``TRITON_CACHE_DIR``, default
    ``~/.triton/cache``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return str(knobs.cache.dir)
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
