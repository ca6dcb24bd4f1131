"""What ``pretrain_glm5_vlm.py`` adds to Megatron-LM's trainer (``megatron.training``): ``entry`` (hands the
providers to ``megatron.training.pretrain``), ``arguments`` (the GLM flags and the architecture's defaults for
Megatron-LM's parser), ``megatron_hooks`` (this model's additions to the trainer, installed in one place),
``optimizer`` (torch fused Adam, SGD state), ``data_loaders`` (the packed image+text loaders),
``data_accounting`` (each micro batch's checks and the data totals)."""
