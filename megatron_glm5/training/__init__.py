"""A small training package on megatron-core's public parts (Megatron-LM's ``megatron/training`` in small):
``arguments`` (Megatron-LM flag names), ``model_setup`` (model chunks, DDP, optimizer, scheduler), ``loop``
(pretrain / train / train_step / evaluate), ``checkpointing`` (atomic dist checkpoints, exact resume), ``logger``
(TensorBoard + console)."""
