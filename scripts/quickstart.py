#!/usr/bin/env python
"""CPU quickstart: load a (tiny) HF GLM-5.3 checkpoint into megatron_glm5, run a packed multimodal row end to end
(forward, loss with MTP, backward, a few AdamW steps) and write the logits.

    python scripts/quickstart.py --hf-dir DIR --out OUT_DIR [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time



def synthetic_packed_row(cfg_json: dict, doc_lens=(40, 56, 32), seed: int = 0):
    """A packed row of documents (the first with one image when the model has a vision tower) and per-document
    shifted labels (the last token of each document predicts nothing)."""
    import torch

    from megatron_glm5.data.synthetic import cu_seqlens_of, packed_documents

    docs, pv, grid = packed_documents(cfg_json, doc_lens, image_doc=0 if "vision_config" in cfg_json else None,
                                      seed=seed)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    batch = dict(input_ids=torch.cat(docs)[None], cu_seqlens=cu_seqlens_of(doc_lens), labels=labels)
    if pv is not None:
        batch.update(pixel_values=pv, image_grid_thw=grid)
    return batch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args(argv)

    import torch

    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.packing import make_packed_seq_params

    cfg_json = json.load(open(os.path.join(a.hf_dir, "config.json")))
    t0 = time.time()
    model = build_model_from_hf(a.hf_dir, dtype=torch.float32, device="cpu")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"quickstart: loaded {a.hf_dir} ({n_params / 1e6:.2f}M params, {model.config.num_layers} layers, "
          f"MTP={bool(model.config.mtp_num_layers)}) in {time.time() - t0:.1f}s")
    b = synthetic_packed_row(cfg_json)
    psp = make_packed_seq_params(b["cu_seqlens"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    mask = (b["labels"] != -100).float()
    for step in range(a.steps):
        t1 = time.time()
        loss_tok = model(b["input_ids"], labels=b["labels"].clamp(min=0), loss_mask=mask, packed_seq_params=psp,
                         pixel_values=b.get("pixel_values"), image_grid_thw=b.get("image_grid_thw"))
        loss = (loss_tok * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mtp = getattr(model, "last_mtp_loss", None)
        print(f"quickstart: step {step + 1}/{a.steps} loss {loss.item():.4f}"
              + (f" mtp_loss {mtp.item():.4f}" if mtp is not None else "")
              + f" grad_norm {gnorm.item():.3f} ({(time.time() - t1) * 1e3:.0f} ms)")
    model.eval()
    with torch.no_grad():
        logits = model(b["input_ids"], packed_seq_params=psp, pixel_values=b.get("pixel_values"),
                       image_grid_thw=b.get("image_grid_thw"))
    os.makedirs(a.out, exist_ok=True)
    torch.save({"logits": logits.float()}, os.path.join(a.out, "logits.pt"))
    print(f"quickstart: wrote logits {tuple(logits.shape)} to {os.path.join(a.out, 'logits.pt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
