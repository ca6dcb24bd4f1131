"""GPU kernels of the fast paths, one file per kernel, each with its plain PyTorch reference beside it.

Every kernel here is optional: the modules call it only on CUDA tensors when their config selects the fast backend,
and the CPU paths never import triton.
"""
