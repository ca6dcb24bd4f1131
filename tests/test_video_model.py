"""Video through the model: fp32 logits equal transformers' Glm5NextForConditionalGeneration on inputs built by
transformers' own processor (Glm5NextProcessor with Glm5NextVideoProcessor: frame sampling at the processor's fps,
timestamps, ``<begin_video> (<begin_image> <image>*k <end_image> "t seconds")* <end_video>``), for a packed row of
a text document, a document with an image and a video, and a document with another video, and for one sample
un-packed; tools/hf_forward.py with the same input names; the context-parallel cut of a row with a video.

Tolerance: max |dlogit| <= 1e-5 x max |logit| against transformers' fp32 logits, top-1 100 %. This tiny random
model amplifies rounding in the video features (a 1e-6 relative change moves the logits by ~7e-6; transformers' own
fp32 logits differ from its fp64 logits by up to 1.6e-5 x max |logit|), so the patch embedding runs transformers'
Conv3d, as the HF model does, rather than the equal matmul. Also printed and bounded: the distance of both to
transformers in fp64 (its experts in eager mode), ours no further than 1.5 x transformers' own fp32 logits are.
"""

import json
import os
import sys

import numpy as np
import pytest
import torch

from megatron_glm5.data.synthetic import cu_seqlens_of
from tests.helpers import rel_max

sys.path.insert(0, os.path.dirname(__file__))

TOL_FP32 = 1e-5  # max |dlogit| <= TOL_FP32 x max |logit| against transformers' fp32 logits (module docstring)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from megatron_glm5.config import tiny_hf_config

    path = str(tmp_path_factory.mktemp("video") / "tiny_fp32")
    return write_checkpoint(path, tiny_hf_config(), fmt="fp32", seed=5)


def processor(ckpt):
    """transformers' Glm5NextProcessor over the checkpoint's tokenizer and image processor, with a video processor
    of the checkpoint's patch sizes and a small token budget per frame (tiny tests)."""
    from transformers import AutoTokenizer, Glm5NextProcessor
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    cfg = json.load(open(os.path.join(ckpt, "config.json")))["vision_config"]
    video = Glm5NextVideoProcessor(patch_size=cfg["patch_size"], temporal_patch_size=cfg["temporal_patch_size"],
                                   merge_size=cfg["spatial_merge_size"], fps=2, min_image_tokens=4,
                                   max_image_tokens=64)
    return Glm5NextProcessor(image_processor=Glm5NextImageProcessor.from_pretrained(ckpt),
                             tokenizer=AutoTokenizer.from_pretrained(ckpt), video_processor=video)


def clip(frames, height, width, fps, seed):
    """A generated RGB clip (uint8 [frames, H, W, 3]) and its VideoMetadata."""
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(seed)
    video = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    meta = VideoMetadata(total_num_frames=frames, fps=float(fps), width=width, height=height,
                         duration=frames / fps, frames_indices=list(range(frames)))
    return video, meta


IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"


def encode(proc, text, images=None, videos=None, seed=0, keep_all=False):
    """The processor's tensors for one document: input_ids [1, n] and the image / video inputs it produced (with
    ``keep_all`` everything it returned: attention_mask and mm_token_type_ids too)."""
    kw = {}
    if images:
        kw["images"] = [np.random.default_rng(seed + i).integers(0, 256, (h, w, 3), dtype=np.uint8)
                        for i, (h, w) in enumerate(images)]
    if videos:
        clips = [clip(*v, seed=seed + 10 + i) for i, v in enumerate(videos)]
        kw["videos"] = [c[0] for c in clips]
        kw["videos_kwargs"] = {"video_metadata": [c[1] for c in clips], "do_sample_frames": True}
    out = proc(text=[text], return_tensors="pt", **kw)
    if keep_all:
        return dict(out)
    keys = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {k: out[k] for k in keys if k in out}


def documents(proc):
    """Three documents of one packed row: text; an image then a video (8 frames at 4 fps -> 4 sampled frames,
    2 temporal patches); a video of 10 frames at 2 fps of another size (all 10 sampled: 5 temporal patches)."""
    return [
        encode(proc, "plain text before any picture, then more words"),
        encode(proc, f"look {IMAGE} and then watch {VIDEO} what moves?", images=[(56, 56)],
               videos=[(8, 56, 84, 4)], seed=1),
        encode(proc, f"a clip: {VIDEO} the end", videos=[(10, 42, 56, 2)], seed=2),
    ]


def pack(docs):
    """One packed row of ``docs``: input_ids [1, s], cu_seqlens, and the images / videos in placeholder order."""
    row = {"input_ids": torch.cat([d["input_ids"] for d in docs], 1),
           "cu_seqlens": cu_seqlens_of([d["input_ids"].shape[1] for d in docs])}
    for pv, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        parts = [d for d in docs if pv in d]
        if parts:
            row[pv] = torch.cat([d[pv] for d in parts])
            row[grid] = torch.cat([d[grid] for d in parts])
    return row


def hf_model(path, dtype=torch.float32):
    from transformers import Glm5NextForConditionalGeneration

    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return Glm5NextForConditionalGeneration.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                            **experts).eval()


def hf_logits(hf, docs):
    """transformers' logits of every document run on its own, concatenated [s, vocab] fp32 (pixels cast to the
    model's dtype)."""
    dtype = next(hf.parameters()).dtype
    with torch.no_grad():
        return torch.cat([hf(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in d.items()}).logits[0]
                          for d in docs], 0).float()


def _mm(batch):
    return {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if k in batch}


def check_logits(got, ref32, ref64, label):
    """``got`` fp32 [s, vocab] against transformers' fp32 and fp64 logits (the bounds of the module docstring)."""
    ours64, hf64, ours32 = rel_max(got, ref64), rel_max(ref32, ref64), rel_max(got, ref32)
    top1 = (got.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    print(f"\n[video parity, {label}] max|dlogit| / max|logit|: ours fp32 vs transformers fp64 {ours64:.2e}, "
          f"transformers fp32 vs fp64 {hf64:.2e}, ours fp32 vs transformers fp32 {ours32:.2e}; top-1 {top1:.1%}")
    assert ours64 <= 1.5 * hf64, (label, ours64, hf64)
    assert ours32 <= TOL_FP32, (label, ours32)
    assert top1 == 1.0, label


@pytest.fixture(scope="module")
def inputs(tiny_ckpt):
    proc = processor(tiny_ckpt)
    docs = documents(proc)
    return docs, pack(docs)


def test_processor_inputs_hold_video_frames_and_timestamps(tiny_ckpt, inputs):
    """The row really is what the model needs to be tested on: two videos of several temporal patches each, whose
    frames are image-token runs inside video spans, beside an image outside them."""
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.vision import image_token_mask, video_token_mask

    docs, row = inputs
    cfg = Glm5Config.from_hf(json.load(open(os.path.join(tiny_ckpt, "config.json"))))
    assert row["video_grid_thw"][:, 0].tolist() == [2, 5] and row["image_grid_thw"].shape == (1, 3)
    ids = row["input_ids"]
    assert int(image_token_mask(ids, cfg).sum()) == int(row["image_grid_thw"].prod(-1).sum()) // 4
    assert int(video_token_mask(ids, cfg).sum()) == int(row["video_grid_thw"].prod(-1).sum()) // 4
    assert int((ids == cfg.image_start_token_id).sum()) == 1 + 2 + 5  # the image, one per frame of each video
    text = processor(tiny_ckpt).tokenizer.decode(docs[1]["input_ids"][0])
    assert "0.0 seconds" in text and "1.0 seconds" in text


def test_video_logits_match_transformers(tiny_ckpt, inputs, mcore):
    """fp32 logits of a packed row (text | image + video | video) and of one un-packed sample (image + video) equal
    transformers' (documents run on their own) within fp32 rounding (module docstring), top-1 100 %."""
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.packing import make_packed_seq_params

    docs, row = inputs
    hf32, hf64 = hf_model(tiny_ckpt), hf_model(tiny_ckpt, torch.float64)
    ours = build_model_from_hf(tiny_ckpt, dtype=torch.float32, device="cpu").eval()
    assert ours.config.index_topk < min(d["input_ids"].shape[1] for d in docs[1:]), "sparse selection in play"
    with torch.no_grad():
        got = ours(row["input_ids"], packed_seq_params=make_packed_seq_params(row["cu_seqlens"]), **_mm(row))[0]
    check_logits(got, hf_logits(hf32, docs), hf_logits(hf64, docs), "packed row")
    with torch.no_grad():
        got = ours(docs[1]["input_ids"], **_mm(docs[1]))[0]
    check_logits(got, hf_logits(hf32, docs[1:2]), hf_logits(hf64, docs[1:2]), "one sample")
    # the video features really reach the logits: other video pixels move the video document's logits
    with torch.no_grad():
        other = dict(_mm(docs[2]), pixel_values_videos=docs[2]["pixel_values_videos"].flip(0))
        moved = ours(docs[2]["input_ids"], **other)[0]
    assert rel_max(moved, hf_logits(hf32, docs[2:3])) > 1e-3


def test_hf_forward_tool_takes_video(tiny_ckpt, inputs, tmp_path, mcore):
    """tools/hf_forward.py reads transformers' input names: the processor's whole output for one sample (with
    attention_mask and mm_token_type_ids) and a packed row with cu_seqlens give transformers' logits."""
    from megatron_glm5.cli import hf_forward

    docs, row = inputs
    proc = processor(tiny_ckpt)
    sample = encode(proc, f"look {IMAGE} and then watch {VIDEO} what moves?", images=[(56, 56)],
                    videos=[(8, 56, 84, 4)], seed=1, keep_all=True)
    assert {"attention_mask", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw"} <= set(sample)
    assert torch.equal(sample["input_ids"], docs[1]["input_ids"])
    hf32 = hf_model(tiny_ckpt)
    for name, batch, ref_docs in (("sample", sample, docs[1:2]), ("row", row, docs)):
        inp, out = tmp_path / f"{name}.pt", tmp_path / f"{name}_out.pt"
        torch.save(batch, inp)
        assert hf_forward.main(["--hf-dir", tiny_ckpt, "--input", str(inp), "--output", str(out)]) == 0
        got = torch.load(out)["logits"][0]
        ref = hf_logits(hf32, ref_docs)
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert rel_max(got, ref) <= TOL_FP32, name
        assert bool((got.argmax(-1) == ref.argmax(-1)).all()), name


def test_hf_forward_tool_rejects_bad_video_input(tiny_ckpt, inputs, tmp_path, mcore, capsys):
    """Bad video inputs: one line naming the field, exit 2, no output written, the input file unchanged."""
    import hashlib

    from megatron_glm5.cli import hf_forward

    docs, _ = inputs
    d = docs[2]
    image_id = json.load(open(os.path.join(tiny_ckpt, "config.json")))["image_token_id"]
    one_less = d["input_ids"].clone()
    one_less[0, int((one_less[0] == image_id).nonzero()[0])] = 7  # a frame placeholder turned into text
    cases = {
        "pixels_without_grid": ({"input_ids": d["input_ids"], "pixel_values_videos": d["pixel_values_videos"]},
                                "pixel_values_videos and video_grid_thw must be given together"),
        "grid_of_more_frames": (dict(d, video_grid_thw=d["video_grid_thw"] + torch.tensor([[1, 0, 0]])),
                                "pixel_values_videos must be a float tensor"),
        "one_placeholder_less": (dict(d, input_ids=one_less), "video tokens"),
        "video_as_image": ({"input_ids": d["input_ids"], "pixel_values": d["pixel_values_videos"],
                            "image_grid_thw": d["video_grid_thw"]}, "image tokens"),
        "types_say_image": (dict(d, mm_token_type_ids=(d["input_ids"] == image_id).long()),
                            "mm_token_type_ids disagree"),
    }
    out = tmp_path / "out.pt"
    for name, (batch, phrase) in cases.items():
        inp = tmp_path / f"{name}.pt"
        torch.save(batch, inp)
        digest = hashlib.sha256(inp.read_bytes()).hexdigest()
        rc = hf_forward.main(["--hf-dir", tiny_ckpt, "--input", str(inp), "--output", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, name
        assert len(err) == 1 and err[0].startswith("hf_forward: error:") and phrase in err[0], (name, err)
        assert "Traceback" not in err[0] and not out.exists(), name
        assert hashlib.sha256(inp.read_bytes()).hexdigest() == digest, name


# ----------------------------------------------------------------------------------------------- context parallel
def training_row(docs):
    """A packed training row of ``docs``: tokens / labels (shifted inside each document) / loss_mask / cu_seqlens
    and the images / videos (collate's layout)."""
    row = pack(docs)
    labels = torch.cat([torch.cat([d["input_ids"][0, 1:], torch.tensor([-100])]) for d in docs])[None]
    out = {"tokens": row.pop("input_ids"), "labels": labels, "loss_mask": (labels != -100).float()}
    out.update(row)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_split_places_video_tokens(inputs, cp):
    """Every chunk's image / video token masks (read with its ``video_span_depth``) are the row's masks cut to the
    chunk, and its feature offsets count the image / video tokens before it, wherever the edges fall."""
    from megatron_glm5.config import tiny_config
    from megatron_glm5.data.context_parallel import split_batch_for_cp
    from megatron_glm5.models.vision import image_token_mask, video_token_mask

    cfg = tiny_config()
    row = training_row(inputs[0])
    img, vid = image_token_mask(row["tokens"], cfg)[0], video_token_mask(row["tokens"], cfg)[0]
    depths = []
    for rank in range(cp):
        local, psp = split_batch_for_cp(row, cp, rank, cfg)
        a, n = psp.chunk_offset, local["tokens"].shape[1]
        pad = torch.zeros(psp.global_seq_len - img.numel(), dtype=torch.bool)
        assert torch.equal(image_token_mask(local["tokens"], cfg, psp.video_span_depth)[0],
                           torch.cat([img, pad])[a:a + n])
        assert torch.equal(video_token_mask(local["tokens"], cfg, psp.video_span_depth)[0],
                           torch.cat([vid, pad])[a:a + n])
        assert (psp.image_token_offset, psp.video_token_offset) == (int(img[:a].sum()), int(vid[:a].sum()))
        assert torch.equal(local["pixel_values_videos"], row["pixel_values_videos"])
        depths.append(psp.video_span_depth)
    assert 1 in depths  # some chunk begins inside a video


@pytest.fixture(scope="module")
def cp_reference(tmp_path_factory, mcore):
    """An MTP checkpoint, the processor-built video row, and 2 SGD steps of one rank on the whole row."""
    from megatron_glm5.cli.make_tiny_hf_checkpoint import write_checkpoint
    from megatron_glm5.config import tiny_hf_config
    from megatron_glm5.models.packing import make_packed_seq_params
    from test_parallel_cp import _build, _train

    root = tmp_path_factory.mktemp("video_cp")
    ckpt = write_checkpoint(str(root / "hf"), tiny_hf_config(mtp=True), fmt="fp32", mtp=True, seed=7)
    row = training_row(documents(processor(ckpt)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks (see test_parallel_cp)
    try:
        steps, weights = _train(_build(ckpt), row, make_packed_seq_params(row["cu_seqlens"]), steps=2)
    finally:
        torch.set_num_threads(threads)
    paths = str(root / "row.pt"), str(root / "ref.pt")
    torch.save(row, paths[0])
    torch.save((steps, weights), paths[1])
    return ckpt, paths


def _cp_worker(ckpt, row_path, ref_path):
    world = int(os.environ["WORLD_SIZE"])
    from megatron.core import parallel_state as ps

    from megatron_glm5.data.context_parallel import split_batch_for_cp
    from megatron_glm5.initialize import initialize_megatron
    from test_parallel_cp import _build, _train

    initialize_megatron(tp=1, cp=world)
    model = _build(ckpt, cp=world)
    local, psp = split_batch_for_cp(torch.load(row_path), world, ps.get_context_parallel_rank(), model.config)
    got, weights = _train(model, local, psp, steps=2)
    ref, ref_weights = torch.load(ref_path)
    errs = {f"step{i} lm loss": abs(g[0] - r[0]) / abs(r[0]) for i, (g, r) in enumerate(zip(got, ref))}
    errs["step0 grad"] = max(rel_max(g, ref[0][2][n]) for n, g in got[0][2].items())
    errs["vision grad"] = max(rel_max(g, ref[0][2][n]) for n, g in got[0][2].items() if "vision_model" in n)
    errs["weights"] = max(rel_max(w, ref_weights[n]) for n, w in weights.items())
    return (errs, psp.video_span_depth, psp.video_token_offset, [s[0] for s in got])


def test_video_row_cp2_equals_one_rank(cp_reference):
    """The processor-built row (text | image + video | video) cut in two contiguous chunks whose edge falls inside
    a video: every rank runs the vision tower on the row's images and videos and splices its chunk's features; the
    lm loss of 2 SGD steps, the first step's gradients of every parameter (the vision tower's included, averaged
    over CP) and the weights after the steps equal one rank's on the whole row."""
    from tests.helpers import spawn

    ckpt, (row_path, ref_path) = cp_reference
    results = spawn(_cp_worker, 2, ckpt, row_path, ref_path, timeout=600)
    (errs0, depth0, off0, losses), (errs1, depth1, off1, _) = results[0], results[1]
    print(f"\n[video cp2] lm loss {losses}; rank 1 starts inside a video (depth {depth1}, {off1} video tokens before)")
    assert (depth0, off0) == (0, 0) and depth1 == 1 and off1 > 0, "the chunk edge must fall inside a video"
    worst = {k: max(errs0[k], errs1[k]) for k in errs0}
    print("[video cp2] " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert all(v <= 1e-5 for v in worst.values()), worst


# ----------------------------------------------------------------------------------------------- training
VIDEO_TRAIN_SCRIPT = '''
"""pretrain_glm5_vlm.py's model provider and forward step over a test-only dataset of packed video rows."""
import sys

import torch

import pretrain_glm5_vlm as P


class VideoRows(torch.utils.data.Dataset):
    """Packed rows of seq_length tokens: a document holding a video of 2 temporal patches of 4 x 4 patches
    (<begin_video> (<begin_image> <image>*4 <end_image> "t sec")*2 <end_video> between text), then a text
    document. Every row is the same (memorisation); labels are the next token inside each document."""

    def __init__(self, n, s, cfg):
        self.n = n
        g = torch.Generator().manual_seed(0)
        text = lambda k: torch.randint(10, 200, (k,), generator=g)
        frame = lambda t: [cfg.image_start_token_id] + [cfg.image_token_id] * 4 + [cfg.image_end_token_id, 20 + t]
        video = [cfg.video_start_token_id] + frame(0) + frame(1) + [cfg.video_end_token_id]
        doc = torch.cat([text(5), torch.tensor(video), text(6)])
        docs = [doc, text(s - doc.numel())]
        self.tokens = torch.cat(docs)
        special = torch.tensor([cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id,
                                cfg.video_start_token_id, cfg.video_end_token_id])
        self.labels = torch.cat([torch.cat([d[1:], d[:1]]) for d in docs])
        last = torch.cumsum(torch.tensor([d.numel() for d in docs]), 0) - 1
        self.loss_mask = (~torch.isin(self.labels, special)).float()
        self.loss_mask[last] = 0
        self.cu = torch.tensor([0, doc.numel(), s], dtype=torch.int32)
        vc = cfg.vision
        self.pixels = torch.randn(2 * 4 * 4, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                                  generator=g)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": self.tokens, "labels": self.labels, "loss_mask": self.loss_mask, "cu_seqlens": self.cu,
                "pixel_values_videos": self.pixels, "video_grid_thw": torch.tensor([[2, 4, 4]])}


def provider(num_samples, vp_stage=None):
    from megatron.training import get_args

    from megatron_glm5.training.arguments import model_config_from_args
    from megatron_glm5.training.data_loaders import external_loaders

    args = get_args()
    ds = VideoRows(num_samples[0], args.seq_length, model_config_from_args(args, "cpu"))
    return external_loaders((ds, None, None), args)


provider.is_distributed = True

if __name__ == "__main__":
    from megatron_glm5.training.entry import run_pretrain

    sys.exit(run_pretrain(provider, P.model_provider, P.forward_step, argv=sys.argv[1:], prog="video_rows"))
'''


def test_video_rows_train(tmp_path):
    """pretrain_glm5_vlm.py's forward step on packed video rows (tiny preset, Megatron-LM's trainer, 8 steps, with
    --log-throughput): the run ends 0, the lm loss of the repeated row falls, and the vision tower's weights move
    although no row holds an image (weight decay 0: only the video's gradients reach the tower)."""
    from training_harness import TINY, read_dist_checkpoint, run, scalars

    script = tmp_path / "video_rows.py"
    script.write_text(VIDEO_TRAIN_SCRIPT)
    argv = [a for a in TINY]
    argv[argv.index("--seq-length") + 1] = "48"
    proc = run(argv + ["--mock-data", "--dataloader-type", "external", "--train-iters", "8", "--weight-decay", "0",
                       "--save", str(tmp_path / "ck"), "--save-interval", "4", "--log-throughput",
                       "--tensorboard-dir", str(tmp_path / "tb")], script=str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    loss = dict(scalars(tmp_path / "tb")["lm loss"])
    print(f"\n[video training] lm loss {[round(loss[i], 3) for i in sorted(loss)]}")
    assert loss[8] < 0.8 * loss[1], loss
    first, last = (read_dist_checkpoint(str(tmp_path / "ck" / f"iter_000000{i}")) for i in (4, 8))
    vision = [k for k in first if "vision_model." in k and not k.startswith("optimizer")]
    assert len(vision) > 10
    moved = [k for k in vision if not torch.equal(first[k], last[k])]
    assert len(moved) == len(vision), sorted(set(vision) - set(moved))
    assert "TFLOP" in proc.stdout or "tflop" in proc.stdout.lower()


def test_video_gradients_match_transformers(tiny_ckpt, inputs, mcore):
    """The gradient of one weighted sum of the packed row's logits wrt every parameter equals transformers'
    (documents on their own): the vision tower's (through the image and both videos) within relative L2 1e-4 (the
    bound of test_model_parity's image row), every other tensor within 1e-3 (the mHC ``scale`` gradients, three
    numbers each summed over every token with cancellation, reach 2.7e-4 on this row; the rest stay below 6e-5)."""
    from megatron_glm5.checkpoint.hf_keys import canonical_name, mcore_to_hf
    from megatron_glm5.models.builder import build_model_from_hf
    from megatron_glm5.models.packing import make_packed_seq_params
    from test_model_parity import hf_grads_by_checkpoint_name

    docs, row = inputs
    hf = hf_model(tiny_ckpt)
    ours = build_model_from_hf(tiny_ckpt, dtype=torch.float32, device="cpu").eval()
    w = torch.randn(row["input_ids"].shape[1], ours.config.vocab_size, generator=torch.Generator().manual_seed(3))
    (torch.cat([hf(**d).logits[0] for d in docs]) * w).sum().backward()
    ref = hf_grads_by_checkpoint_name(hf)
    (ours(row["input_ids"], packed_seq_params=make_packed_seq_params(row["cu_seqlens"]), **_mm(row))[0] * w
     ).sum().backward()
    worst, vision, errs = (0.0, ""), 0, {}
    for local, p in ours.named_parameters():
        refs = [ref.get(n) for n in mcore_to_hf(canonical_name(local, ours), ours.config.num_layers)]
        if all(r is None for r in refs):
            continue
        r = torch.cat(refs, 0) if len(refs) > 1 else refs[0]
        rel = ((p.grad - r).norm() / r.norm().clamp(min=1e-30)).item()
        errs[local] = rel
        worst = max(worst, (rel, local))
        vision += local.startswith("vision_model.") and r.norm() > 0
    print(f"\n[video parity] gradients: worst rel L2 {worst[0]:.2e} ({worst[1]}), {vision} vision tensors")
    worst_vision = max((v, k) for k, v in errs.items() if k.startswith("vision_model."))
    print(f"[video parity] vision tower gradients: worst rel L2 {worst_vision[0]:.2e} ({worst_vision[1]})")
    assert worst_vision[0] <= 1e-4, worst_vision
    assert worst[0] <= 1e-3, worst
    assert vision > 20 and len(errs) > 100
