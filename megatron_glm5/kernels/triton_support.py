"""The kernels' one optional import of Triton: on a machine without it ``triton`` and ``tl`` are None and
``HAVE_TRITON`` is False, and the models run the PyTorch references."""

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "tl", "triton"]
