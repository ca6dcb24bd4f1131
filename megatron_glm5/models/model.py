"""GLM-5.3-Flash as a megatron-core language model (built like megatron-core's ``GPTModel``).

    first stage:  input_ids [b, s] -> embedding [s, b, h] (+ image / video features spliced at their placeholders)
                  -> (sequence parallel: scatter along s) -> expand to hc_mult streams [s, b, n*h]
    every stage:  decoder layers of this PP (VPP) stage (megatron-core's TransformerBlock), streams in and out
                  [s(/tp), b, n*h]
    last stage:   mean over streams [s, b, h] -> final RMSNorm -> (MTP block) -> untied output layer
                  -> logits [b, s, vocab(/tp)] (or per-token loss [b, s] given labels)

Pipelines: the model of one (virtual) stage is built with ``pre_process`` / ``post_process`` (megatron's
``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` of that stage, see ``builder.build_model_chunks``); a
non-first stage reads its input from ``set_input_tensor`` (what megatron's schedules received from the previous
stage). The streams between stages are ``[s(/tp), b, n*h]``, so the config sets ``variable_seq_lengths`` for the
schedules' shape exchange. MTP (optional) runs on the last stage, which then also holds a copy of the word
embedding, synchronised with the first stage's by megatron's ``LanguageModule`` mechanics (initial all-reduce
over the embedding group, gradients all-reduced there by ``finalize_model_grads``, the copy tied in the sharded
state dict).

Module tree (state-dict names; the HF key table in ``checkpoint/hf_keys.py`` maps them):
    embedding.word_embeddings.weight, vision_model.*, decoder.layers.{j}.*, final_layernorm.weight,
    output_layer.weight, mtp.layers.0.*
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    MultiTokenPredictionBlock,
    _compute_mtp_acceptance_counts,
    tie_word_embeddings_state_dict,
)
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megatron_glm5.config import Glm5Config
from megatron_glm5.kernels.cross_entropy import vocab_parallel_cross_entropy
from megatron_glm5.models.context_parallel import (
    local_image_features,
    local_video_features,
    mtp_loss_terms,
    roll_left_in_documents,
    video_span_depth_of,
)
from megatron_glm5.models.embedding_grad import clear_zero_out_wgrad, fuse_embedding_grad
from megatron_glm5.models.layer_specs import get_layer_spec, get_mtp_block_spec, get_stage_layer_range
from megatron_glm5.models.mhc import contract_streams, expand_streams
from megatron_glm5.models.norms import RMSNorm


class Glm5Decoder(TransformerBlock):
    """The decoder layers of one PP (VPP) stage: megatron-core's ``TransformerBlock`` over GLM layers
    (:class:`~megatron_glm5.models.layer.Glm5TransformerLayer`, one spec per layer from ``layer_types`` /
    ``mlp_layer_types``). Its hidden state is the mHC streams ``[s(/tp), b, n*h]``, in and out.

    ``TransformerBlock`` runs the layer loop, the pipeline input (``set_input_tensor``, read when not
    ``pre_process``) and activation recompute: ``recompute_granularity='full'`` with ``recompute_method='uniform'``
    checkpoints groups of ``recompute_num_layers`` layers, ``'block'`` the first ``recompute_num_layers`` layers of
    the stage one by one (megatron's ``checkpointed_forward``); ``'selective'`` is handled inside each layer and
    megatron's ``MoELayer`` ('moe', 'shared_experts'). The final norm is not the block's: it follows the mean over
    the streams in :class:`Glm5Model` (``final_layernorm.weight`` at the model's top level).

    DSA layers whose ``indexer_types`` entry is 'shared' reuse the top-k of the previous full DSA layer, which
    rides from layer to layer as the block's ``context`` (see ``Glm5TransformerLayer.forward``); that layer must
    sit on the same (virtual) stage (checked when the config is built and again here).
    """

    def __init__(self, config: Glm5Config, vp_stage: Optional[int] = None, pg_collection=None,
                 pre_process: bool = True, post_process: bool = True):
        from megatron_glm5.config.parallelism import check_shared_indexers

        layer_range = get_stage_layer_range(config, vp_stage)
        check_shared_indexers(config, layer_range, "this pipeline stage")
        spec = TransformerBlockSubmodules(layer_specs=[get_layer_spec(config, i) for i in layer_range],
                                          layer_norm=None)
        super().__init__(config, spec, post_layer_norm=False, pre_process=pre_process, post_process=post_process,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.layer_range = layer_range
        built = [layer.layer_number - 1 for layer in self.layers]
        if built != list(layer_range):
            raise ValueError(f"megatron's layer offset numbers this stage's layers {built}, the layout "
                             f"{list(layer_range)}")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron's ``TransformerBlock`` sharded state dict with non-homogeneous layers: sharded keys name layers
        by their *global* index (``decoder.layers.{i}.``), so a checkpoint saved at one PP/VPP layout loads at any
        other; the dict keys keep the local index (``load_state_dict`` needs them). KDA and DSA layers hold
        different tensors, so there is no stacked layer axis."""
        metadata = {**(metadata or {}), "non_homogeneous_layers": True}
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def forward(self, hidden_states: Optional[torch.Tensor], attention_mask=None, **kwargs) -> torch.Tensor:
        """``hidden_states`` ``[s(/tp), b, n*h]`` (on a non-first pipeline stage the tensor given to
        :meth:`set_input_tensor` is used) -> streams of the same shape. ``padding_mask`` ``[b, s(/tp)]`` bool
        (True = padding) reaches the MoE routers; ``packed_seq_params`` the mixers. Other keyword arguments are
        ``TransformerBlock.forward``'s."""
        out = super().forward(hidden_states, attention_mask, **kwargs)
        if len(self.layers) == 0 and self.pre_process:  # a stage without decoder layers ('E|tttt|L'): a new node
            out = out.clone()
        return out


class Glm5Model(LanguageModule):
    """GLM-5.3-Flash (text decoder + optional vision tower + optional MTP) on megatron-core, one (virtual)
    pipeline stage of it.

    Args:
        config: the model config (parallel sizes and pipeline layout included).
        pre_process: this stage holds the embedding and the vision tower (first stage).
        post_process: this stage holds the final norm, the output layer, the loss and the MTP block (last stage).
        vp_stage: virtual pipeline stage of this model chunk (None without virtual stages).
        pg_collection: process groups (default: megatron's global ones); the model reads TP, CP and DP x CP (the MTP
            loss's logging) from it.
        parallel_output: keep logits split over the vocabulary (TP) when no labels are given.
        max_sequence_length: informational (the LM has no position embedding).
    """

    def __init__(self, config: Glm5Config, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, pg_collection=None, parallel_output: bool = True,
                 max_sequence_length: int = 1 << 20):
        super().__init__(config=config, pg_collection=pg_collection)
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.parallel_output = parallel_output
        self.hc_mult = config.hc_mult
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.share_embeddings_and_output_weights = bool(config.tie_word_embeddings)
        self.mtp_process = bool(config.mtp_num_layers) and post_process
        self.vision_model = None
        if pre_process or self.mtp_process:
            # not scattered along s inside: image features are spliced into the full sequence first
            self.embedding = LanguageModelEmbedding(config, vocab_size=config.vocab_size,
                                                    max_sequence_length=max_sequence_length,
                                                    position_embedding_type="none",
                                                    scatter_to_sequence_parallel=False, tp_group=self.tp_group)
            if config.gradient_accumulation_fusion:
                fuse_embedding_grad(self.embedding.word_embeddings)
        if pre_process and config.vision is not None:
            from megatron_glm5.models.vision import Glm5VisionModel

            self.vision_model = Glm5VisionModel(config)
        self.decoder = Glm5Decoder(config, vp_stage=vp_stage, pg_collection=self.pg_collection,
                                   pre_process=pre_process, post_process=post_process)
        if post_process:
            self.final_layernorm = RMSNorm(config, config.hidden_size, config.layernorm_epsilon)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, config.vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights,
                tp_group=self.tp_group)
            if self.mtp_process:
                self.mtp = MultiTokenPredictionBlock(config=config, spec=get_mtp_block_spec(config),
                                                     vp_stage=vp_stage, pg_collection=self.pg_collection)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()
        if config.gradient_accumulation_fusion and hasattr(self, "embedding"):
            clear_zero_out_wgrad(self.embedding.word_embeddings, getattr(self, "output_layer", None))
        mark_fp32_islands(self)

    # ------------------------------------------------------------------ pipeline glue
    def set_input_tensor(self, input_tensor):
        """megatron's schedules pass a list with the previous stage's output (the streams)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"Glm5Model takes one input tensor from the previous stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word embedding on stages that hold one (first stage, and the MTP stage), else the output weight
        (megatron's GPTModel contract: MTP needs the embedding on the last stage)."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    # ------------------------------------------------------------------ pieces
    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None,
              packed_seq_params=None, pixel_values_videos=None, video_grid_thw=None) -> torch.Tensor:
        """input_ids [b, s] -> embeddings [s, b, h] (this CP rank's chunk, not scattered over TP) with the image and
        video features spliced in (transformers' names: ``pixel_values`` [image patches, C*T*P*P] with
        ``image_grid_thw`` [k, 3], ``pixel_values_videos`` [video patches, C*T*P*P] with ``video_grid_thw`` [v, 3],
        each in placeholder order). The vision tower runs once on the images and videos together (every frame is
        its own attention segment, so this equals transformers' separate image and video passes); image features go
        to the image tokens outside video spans, video features to those inside them. Under context parallelism
        every rank runs the tower on all images and videos of its row and splices the features of its chunk's
        tokens. The tower is replicated over TP: every TP rank computes the same features, so its gradients are
        equal on all TP ranks without a reduction (the sequence-parallel scatter after the splice all-gathers the
        gradient)."""
        emb = self.embedding(input_ids=input_ids, position_ids=None)
        if (pixel_values is None) != (image_grid_thw is None) or \
                (pixel_values_videos is None) != (video_grid_thw is None):
            raise ValueError("pixel_values / image_grid_thw and pixel_values_videos / video_grid_thw come in pairs")
        if pixel_values is None and pixel_values_videos is None:
            return emb
        if self.vision_model is None:
            raise ValueError("pixel_values / pixel_values_videos given but the config has no vision tower")
        from megatron_glm5.models.vision import splice_image_features, splice_video_features

        parts = [(pv, grid) for pv, grid in ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
                 if pv is not None]
        feats = self.vision_model(torch.cat([pv for pv, _ in parts]), torch.cat([g.to(torch.long) for _, g in parts]))
        n_image = 0 if pixel_values is None else \
            int(image_grid_thw.to(torch.long).prod(-1).sum()) // self.vision_model.spatial_merge_size ** 2
        depth = video_span_depth_of(packed_seq_params)
        x = emb.transpose(0, 1)
        if pixel_values is not None:
            img = local_image_features(feats[:n_image], input_ids, packed_seq_params, self.config)
            x = splice_image_features(input_ids, x, img.to(emb.dtype), self.config, video_span_depth=depth)
        if pixel_values_videos is not None:
            vid = local_video_features(feats[n_image:], input_ids, packed_seq_params, self.config)
            x = splice_video_features(input_ids, x, vid.to(emb.dtype), self.config, video_span_depth=depth)
        return x.transpose(0, 1).contiguous()

    def _scatter_sp(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> this TP rank's [s/tp, b, h] under sequence parallelism (identity otherwise)."""
        if self.config.sequence_parallel:
            return tensor_parallel.scatter_to_sequence_parallel_region(x, group=self.tp_group)
        return x

    def _scatter_sp_mask(self, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """[b, s] -> this TP rank's [b, s/tp] under sequence parallelism (bool; None stays None)."""
        if mask is None or not self.config.sequence_parallel:
            return None if mask is None else mask.bool()
        return self._scatter_sp(mask.transpose(0, 1).contiguous()).transpose(0, 1).bool()

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] normalised hidden -> [s, b, vocab(/tp)] logits (the output layer, shared with MTP; under
        sequence parallelism it all-gathers the sequence first)."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def _mtp_embedding(self, input_ids, position_ids):
        """What megatron's MTP layer calls to embed the shifted tokens: [s(/tp), b, h] like the decoder input."""
        return self._scatter_sp(self.embedding(input_ids=input_ids, position_ids=None))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask=None, labels: Optional[torch.Tensor] = None, loss_mask=None,
                packed_seq_params=None, pixel_values=None, image_grid_thw=None,
                padding_mask: Optional[torch.Tensor] = None, pixel_values_videos=None, video_grid_thw=None):
        """input_ids [b, s] (b = 1 with packed_seq_params for a packed row).

        Returns logits [b, s, vocab] (vocab-parallel unless parallel_output=False) without labels, the per-token loss
        [b, s] (vocab-parallel cross entropy, :meth:`compute_language_model_loss`) with labels; on a non-last PP stage
        the streams [s(/tp), b, n*h] for the next stage. ``attention_mask`` and ``position_ids`` are ignored
        (causality and document boundaries come from the mixers and ``packed_seq_params``; the LM is NoPE).
        ``padding_mask`` [b, s] bool (True = padding, e.g. the tokens a CP split appends; megatron GPTModel's
        argument): the MoE routers (decoder and MTP) leave those tokens out of the expert loads and aux losses, so
        padding changes neither the expert-bias update nor the aux loss. Give it on every pipeline stage.
        ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw``: the row's images and
        videos as transformers' processor lays them out (read on the first stage only, see :meth:`embed`).
        """
        if self.pre_process:
            emb = self.embed(input_ids, pixel_values, image_grid_thw, packed_seq_params, pixel_values_videos,
                             video_grid_thw)
            hidden = expand_streams(self._scatter_sp(emb), self.hc_mult)
        else:
            hidden = None  # the decoder reads the previous stage's streams
        moe_padding = self._scatter_sp_mask(padding_mask)
        hidden = self.decoder(hidden, packed_seq_params=packed_seq_params, padding_mask=moe_padding)
        if not self.post_process:
            return hidden
        hidden = self.final_layernorm(contract_streams(hidden, self.hc_mult))

        if self.mtp_process and labels is not None:
            hidden = self._add_mtp_loss(hidden, input_ids, labels, loss_mask, packed_seq_params, moe_padding)

        logits = self.output_logits(hidden)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy [b, s] of logits [s, b, vocab(/tp)] and labels [b, s]: megatron-core's
        vocab-parallel function, computed by ``kernels/cross_entropy.py`` (one pass over the logits each way on
        CUDA, the logits left unmodified); gathered logits (``parallel_output=False``) are the whole vocabulary."""
        group = self.pg_collection.tp if self.parallel_output else None
        return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), group).transpose(0, 1).contiguous()

    def _add_mtp_loss(self, hidden, input_ids, labels, loss_mask, packed_seq_params, padding_mask=None):
        """Run the MTP block on the final-normed ``hidden`` [s(/tp), b, h] (megatron-core's GPTModel contract: its
        decoder output is normed) and attach the scaled MTP loss to the backward of ``hidden``. The MTP layer's own
        ``final_layernorm`` (HF ``shared_head.norm``) precedes the shared output layer. ``padding_mask`` [b, s(/tp)]
        (this rank's rows of ``hidden``) reaches the MTP layers' MoE routers."""
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        out = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden, attention_mask=None,
                       padding_mask=padding_mask, packed_seq_params=packed_seq_params,
                       embedding=self._mtp_embedding)
        chunks = torch.chunk(out, 1 + self.config.mtp_num_layers, dim=0)
        hidden = chunks[0]
        if loss_mask is None:
            loss_mask = (labels != -100).float() if labels.dtype != torch.bool else labels.float()
        cp_group = self.pg_collection.cp
        mtp_labels = labels
        for depth in range(self.config.mtp_num_layers):
            # contiguous CP chunks: shifts and loss cross chunk edges (models/context_parallel.py)
            mtp_labels = roll_left_in_documents(mtp_labels, packed_seq_params, cp_group)
            loss_mask = roll_left_in_documents(loss_mask, packed_seq_params, cp_group)
            mtp_logits = self.output_logits(chunks[depth + 1])
            mtp_loss = self.compute_language_model_loss(mtp_labels.clamp(min=0), mtp_logits)
            scale = self.config.mtp_loss_scaling_factor / self.config.mtp_num_layers
            # the row's MTP mean (logging) and this rank's objective: summed in per-token-loss runs (the step divides
            # by the global token count, as megatron's GPTModel), else cp x its share of the row's mean
            self.last_mtp_loss, mtp_objective = mtp_loss_terms(mtp_loss, loss_mask, cp_group,
                                                               self.config.calculate_per_token_loss)
            if self.training:
                # megatron's 'mtp_{depth+1} loss' (averaged over data(+context) ranks) and acceptance-rate logging:
                # this rank's correct / counted predictions, summed over those ranks
                correct, total = _compute_mtp_acceptance_counts(mtp_logits, mtp_labels, loss_mask, self.output_layer,
                                                                None, self.tp_group)
                MTPLossLoggingHelper.save_metrics_to_tracker(
                    self.last_mtp_loss, correct, total, depth, self.config.mtp_num_layers,
                    avg_group=self.pg_collection.dp_cp)
            hidden = MTPLossAutoScaler.apply(hidden, scale * mtp_objective)
        return hidden

    # ------------------------------------------------------------------ MoE bookkeeping
    def moe_routers(self) -> Dict[str, torch.nn.Module]:
        """``{global layer name: TopKRouter}`` of this stage's MoE layers (decoder and MTP).

        Each router's ``local_tokens_per_expert`` ``[num_moe_experts]`` (float) counts the tokens this rank routed
        to every expert since the last reset; megatron's ``finalize_model_grads`` all-reduces it over
        TP x CP x DP (``parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)``),
        updates ``expert_bias`` by ``moe_router_bias_update_rate`` and zeroes the counts."""
        out = {}
        for layer in self.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                out[f"decoder.layers.{layer.layer_number - 1}.mlp.router"] = router
        if self.mtp_process:
            for i, mtp_layer in enumerate(self.mtp.layers):
                router = getattr(mtp_layer.mtp_model_layer.mlp, "router", None)
                if router is not None:
                    out[f"mtp.layers.{i}.mtp_model_layer.mlp.router"] = router
        return out

    # ------------------------------------------------------------------ checkpointing
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron's ``LanguageModule`` sharded state dict; the last stage's copy of the word embedding (MTP at
        PP > 1) is tied to the first stage's (a replica, as in megatron's GPTModel)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.mtp_process and not self.pre_process:
            key = f"{prefix}embedding.word_embeddings.weight"
            tie_word_embeddings_state_dict(sharded, self.embedding.word_embeddings.weight, key,
                                           tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        return sharded

    # ------------------------------------------------------------------ dtype
    def _apply(self, fn, recurse=True):
        """Every cast to a 16-bit float (``.bfloat16()`` — what megatron-core's ``Float16Module`` calls —,
        ``.half()``, ``.to(dtype)``) leaves the fp32 islands in fp32: parameters marked ``keep_fp32`` (mHC
        base/scale, KDA A_log/dt_bias/conv, router weight, indexer ape) and the fp32 buffers (router expert bias and
        token counts). Device moves apply to them as usual."""
        params = [(p, p.data) for p in self.parameters() if getattr(p, "keep_fp32", False)]
        buffers = [(m, name, b) for m in self.modules() for name, b in m._buffers.items()
                   if b is not None and b.dtype == torch.float32]
        super()._apply(fn, recurse)
        half = (torch.float16, torch.bfloat16)
        for p, old in params:
            if p.dtype in half and old.dtype == torch.float32:
                p.data = old.to(device=p.device)
        for m, name, old in buffers:
            new = m._buffers[name]
            if new is not None and new.dtype in half:
                m._buffers[name] = old.to(device=new.device)
        return self

    def to_dtype(self, dtype: torch.dtype) -> "Glm5Model":
        """Cast to ``dtype``; the fp32 islands stay fp32 (see ``_apply``)."""
        return self.to(dtype)


def mark_fp32_islands(model: torch.nn.Module) -> None:
    """Mark the parameters the reference keeps in fp32 that live in megatron-core modules (the MoE router weight)."""
    for name, p in model.named_parameters():
        if name.endswith("mlp.router.weight"):
            p.keep_fp32 = True
