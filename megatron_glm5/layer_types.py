"""The names of the per-layer schedules of a GLM-5.3 text config (HF ``layer_types`` / ``mlp_layer_types``), shared
by the config and the parallel-layout checks it calls."""

LINEAR_ATTENTION = "linear_attention"
"""A KDA (Kimi Delta Attention) layer."""
INDEXED_ATTENTION = "indexed_attention"
"""A KPool-indexed DSA layer."""
DENSE_MLP = "dense"
"""A dense MLP of ``ffn_hidden_size``."""
SPARSE_MLP = "sparse"
"""An MoE layer."""
