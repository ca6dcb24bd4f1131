"""GLM-5.3-Flash as a megatron-core model.

    input_ids [b, s] -> embedding [s, b, h] (+ image features spliced at image-token positions)
      -> expand to hc_mult streams [s, b, n*h] -> decoder layers (this PP stage) -> mean over streams [s, b, h]
      -> final RMSNorm -> untied output layer -> logits [b, s, vocab] (or per-token loss [b, s] given labels)
    MTP (optional, last stage): megatron-core MultiTokenPredictionBlock on the final-normed hidden state (as in
    megatron's GPTModel); its loss joins the backward through megatron's MTPLossAutoScaler.

Module tree (state-dict names; the HF key table in ``checkpoint/hf_keys.py`` maps them):
    embedding.word_embeddings.weight, vision_model.*, decoder.layers.{j}.*, final_layernorm.weight,
    output_layer.weight, mtp.layers.0.*
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
    MultiTokenPredictionBlock,
)
from megatron.core.transformer.spec_utils import build_module

from megatron_glm5.config import INDEXED_ATTENTION, Glm5Config
from megatron_glm5.models.context_parallel import local_image_features, mtp_loss_terms, roll_left_in_documents
from megatron_glm5.models.layer_specs import get_layer_spec, get_mtp_block_spec, get_stage_layer_range
from megatron_glm5.models.mhc import contract_streams, expand_streams
from megatron_glm5.models.norms import RMSNorm


class Glm5Decoder(MegatronModule):
    """The decoder layers of one PP (VPP) stage. Streams in and out are [s, b, n*h].

    DSA layers whose ``indexer_types`` entry is 'shared' reuse the top-k indices of the previous full DSA layer;
    both must sit on the same stage (checked at build time).
    """

    def __init__(self, config: Glm5Config, vp_stage: Optional[int] = None, pg_collection=None):
        super().__init__(config=config)
        self.layer_range = get_stage_layer_range(config, vp_stage)
        stage_dsa = [i for i in self.layer_range if config.layer_types[i] == INDEXED_ATTENTION]
        for i in stage_dsa:
            if config.indexer_types[i] == "shared" and not any(
                    j < i and config.indexer_types[j] == "full" for j in stage_dsa):
                raise ValueError(
                    f"indexer_types: shared DSA layer {i} has no full DSA layer before it on its pipeline stage "
                    f"(layers {self.layer_range.start}..{self.layer_range.stop - 1}); change the PP layout")
        self.layers = torch.nn.ModuleList([
            build_module(get_layer_spec(config, i), config=config, layer_number=i + 1, vp_stage=vp_stage,
                         pg_collection=pg_collection)
            for i in self.layer_range
        ])
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Sharded keys name layers by their *global* index (``decoder.layers.{i}.``), so a checkpoint saved at one
        PP/VPP layout loads at any other; the dict keys keep the local index (``load_state_dict`` needs them).
        KDA and DSA layers hold different tensors, so there is no stacked layer axis."""
        out = {}
        for j, layer in enumerate(self.layers):
            local, global_ = f"{prefix}layers.{j}.", f"{prefix}layers.{layer.layer_number - 1}."
            layer_sd = layer.sharded_state_dict(local, sharded_offsets, metadata)
            replace_prefix_for_sharding(layer_sd, local, global_)  # dict keys stay local, sharded keys global
            out.update(layer_sd)
        return out

    def _layer_forward(self, layer, hidden_states, packed_seq_params, shared_topk):
        if self.config.recompute_granularity == "full" and self.training:
            def run(h, t):
                out, topk = layer(h, packed_seq_params=packed_seq_params, shared_topk_indices=t)
                return out, topk
            return tensor_parallel.checkpoint(run, False, hidden_states, shared_topk)
        return layer(hidden_states, packed_seq_params=packed_seq_params, shared_topk_indices=shared_topk)

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        shared_topk = None
        for layer in self.layers:
            hidden_states, topk = self._layer_forward(layer, hidden_states, packed_seq_params, shared_topk)
            if topk is not None:
                shared_topk = topk
        return hidden_states


class Glm5Model(MegatronModule):
    """GLM-5.3-Flash (text decoder + optional vision tower + optional MTP) on megatron-core."""

    def __init__(self, config: Glm5Config, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None, pg_collection=None, parallel_output: bool = True,
                 max_sequence_length: int = 1 << 20):
        super().__init__(config=config)
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.parallel_output = parallel_output
        self.hc_mult = config.hc_mult
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size=config.vocab_size,
                                                    max_sequence_length=max_sequence_length,
                                                    position_embedding_type="none")
            if config.vision is not None:
                from megatron_glm5.models.vision import Glm5VisionModel

                self.vision_model = Glm5VisionModel(config)
            else:
                self.vision_model = None
        self.decoder = Glm5Decoder(config, vp_stage=vp_stage, pg_collection=pg_collection)
        self.mtp_process = bool(config.mtp_num_layers) and post_process
        if post_process:
            self.final_layernorm = RMSNorm(config, config.hidden_size, config.layernorm_epsilon)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, config.vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and config.tie_word_embeddings)
            if self.mtp_process:
                if not pre_process:
                    raise ValueError("MTP needs the embedding on the last pipeline stage; use PP=1 with MTP for now")
                self.mtp = MultiTokenPredictionBlock(config=config, spec=get_mtp_block_spec(config),
                                                     vp_stage=vp_stage, pg_collection=pg_collection)
        mark_fp32_islands(self)

    # ------------------------------------------------------------------ pipeline glue
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------ pieces
    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None,
              packed_seq_params=None) -> torch.Tensor:
        """input_ids [b, s] -> embeddings [s, b, h] with image features spliced in. Under context parallelism every
        rank runs the vision tower on all images of its row and splices the features of its chunk's image tokens."""
        emb = self.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is not None:
            if self.vision_model is None:
                raise ValueError("pixel_values given but the config has no vision tower")
            from megatron_glm5.models.vision import splice_image_features

            feats = self.vision_model(pixel_values, image_grid_thw)
            feats = local_image_features(feats, input_ids, packed_seq_params, self.config)
            emb = splice_image_features(input_ids, emb.transpose(0, 1), feats.to(emb.dtype),
                                        self.config).transpose(0, 1).contiguous()
        return emb

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, h] normalised hidden -> [s, b, vocab(/tp)] logits (the untied lm_head, shared with MTP)."""
        weight = self.embedding.word_embeddings.weight if (
            self.config.tie_word_embeddings and self.pre_process) else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def _mtp_embedding(self, input_ids, position_ids):
        return self.embedding(input_ids=input_ids, position_ids=None)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask=None, labels: Optional[torch.Tensor] = None, loss_mask=None,
                packed_seq_params=None, pixel_values=None, image_grid_thw=None):
        """input_ids [b, s] (b = 1 with packed_seq_params for a packed row).

        Returns logits [b, s, vocab] (vocab-parallel unless parallel_output=False) without labels, the per-token
        loss [b, s] with labels; on a non-last PP stage the streams [s, b, n*h].
        """
        if self.pre_process:
            hidden = expand_streams(self.embed(input_ids, pixel_values, image_grid_thw, packed_seq_params),
                                    self.hc_mult)
        else:
            hidden = self.decoder.input_tensor
        hidden = self.decoder(hidden, packed_seq_params=packed_seq_params)
        if not self.post_process:
            return hidden
        hidden = self.final_layernorm(contract_streams(hidden, self.hc_mult))

        if self.mtp_process and labels is not None:
            hidden = self._add_mtp_loss(hidden, input_ids, labels, loss_mask, packed_seq_params)

        logits = self.output_logits(hidden)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self._token_loss(logits, labels)

    def _token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """logits [s, b, vocab(/tp)], labels [b, s] -> per-token loss [b, s] (megatron's vocab-parallel CE)."""
        logits = logits.float()
        if not self.parallel_output:
            # megatron's CE works in place; a gathered output can be a view that autograd must not see modified
            logits = logits.clone()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        return loss.transpose(0, 1).contiguous()

    def _add_mtp_loss(self, hidden, input_ids, labels, loss_mask, packed_seq_params):
        """Run the MTP block on the final-normed ``hidden`` [s, b, h] (megatron-core's GPTModel contract: its
        decoder output is normed) and attach the scaled MTP loss to the backward of ``hidden``. The MTP layer's own
        ``final_layernorm`` (HF ``shared_head.norm``) precedes the shared output layer."""
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        out = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden, attention_mask=None,
                       packed_seq_params=packed_seq_params, embedding=self._mtp_embedding)
        chunks = torch.chunk(out, 1 + self.config.mtp_num_layers, dim=0)
        hidden = chunks[0]
        if loss_mask is None:
            loss_mask = (labels != -100).float() if labels.dtype != torch.bool else labels.float()
        cp_group = parallel_state.get_context_parallel_group()
        mtp_labels = labels
        for depth in range(self.config.mtp_num_layers):
            # contiguous CP chunks: shifts and loss cross chunk edges (models/context_parallel.py)
            mtp_labels = roll_left_in_documents(mtp_labels, packed_seq_params, cp_group)
            loss_mask = roll_left_in_documents(loss_mask, packed_seq_params, cp_group)
            mtp_loss = self._token_loss(self.output_logits(chunks[depth + 1]), mtp_labels.clamp(min=0))
            scale = self.config.mtp_loss_scaling_factor / self.config.mtp_num_layers
            # the row's MTP mean (logging) and this rank's objective: summed in per-token-loss runs (the step divides
            # by the global token count, as megatron's GPTModel), else cp x its share of the row's mean
            self.last_mtp_loss, mtp_objective = mtp_loss_terms(mtp_loss, loss_mask, cp_group,
                                                               self.config.calculate_per_token_loss)
            if self.training:  # megatron's 'mtp_{depth+1} loss' logging, averaged over data(+context) ranks
                MTPLossLoggingHelper.save_loss_to_tracker(
                    self.last_mtp_loss, depth, self.config.mtp_num_layers,
                    avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            hidden = MTPLossAutoScaler.apply(hidden, scale * mtp_objective)
        return hidden

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
