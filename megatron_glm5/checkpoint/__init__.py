"""Checkpoint key table, FP8 dequantisation and HF safetensors I/O."""
