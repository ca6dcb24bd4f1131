"""Packed image+text SFT rows (JSONL and WebDataset) against transformers' Glm5Next image processor, on CPU."""

import json
import os
import shutil
import types

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

from megatron_glm5.config import tiny_config
from megatron_glm5.data import DataError
from megatron_glm5.data.builder import build_train_valid_test_datasets
from megatron_glm5.data.pack import first_fit
from megatron_glm5.data.tiny_data import make_tiny_tokenizer, make_vqa_jsonl, make_vqa_webdataset
from megatron_glm5.data.tokenizer import build_tokenizer

N_DOCS = 10


@pytest.fixture(scope="module")
def vqa(tmp_path_factory):
    d = tmp_path_factory.mktemp("vqa")
    tok = build_tokenizer(make_tiny_tokenizer(str(d), vocab_size=200))
    jsonl = make_vqa_jsonl(str(d / "jsonl"), N_DOCS, seed=5)
    tar = make_vqa_webdataset(str(d / "shard-000.tar"), N_DOCS, seed=5)
    with open(jsonl) as f:
        records = [json.loads(line) for line in f]
    images = [Image.open(os.path.join(d / "jsonl", r["image"])) for r in records]
    return types.SimpleNamespace(dir=d, tok=tok, jsonl=jsonl, tar=tar, records=records, images=images)


def _args(data_path, **kw):
    a = dict(mock_data=False, data_path=data_path, split="100,0,0", seq_length=96, seed=3, train_iters=10,
             global_batch_size=2, eval_iters=0, eval_interval=5, dataset_type="vqa")
    a.update(kw)
    return types.SimpleNamespace(**a)


def _hf_processor(cfg):
    v = cfg.vision
    return Glm5NextImageProcessorPil(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                     merge_size=v.spatial_merge_size)


def _expected_doc(vqa, cfg, k, n_img):
    """(tokens, answer-target positions) of record k written out by hand from the documented chat format."""
    tok, r = vqa.tok, vqa.records[k]
    prompt = (tok.tokenize("<|user|>\n") + [cfg.image_start_token_id] + [cfg.image_token_id] * n_img
              + [cfg.image_end_token_id] + tok.tokenize(r["question"]) + tok.tokenize("<|assistant|>\n"))
    answer = tok.tokenize(r["answer"]) + [tok.eod]
    return prompt + answer, len(prompt), len(answer)


def test_packed_rows_match_hf_processor_and_chat_format(vqa):
    cfg = tiny_config()
    args = _args([vqa.jsonl])
    train, valid, test = build_train_valid_test_datasets(args, cfg, vqa.tok)
    assert valid is None and test is None and len(train) >= 20  # 10 iters x 2
    proc = _hf_processor(cfg)
    merge2 = cfg.vision.spatial_merge_size ** 2
    hf_all = [proc(images=[im], return_tensors="pt") for im in vqa.images]
    n_img = [int(h["image_grid_thw"].prod()) // merge2 for h in hf_all]
    expected = [_expected_doc(vqa, cfg, k, n_img[k]) for k in range(N_DOCS)]
    s = args.seq_length
    assert all(len(e[0]) <= s for e in expected)
    for i in range(len(train)):
        row, docs = train[i], train.rows[i]
        toks, labels, lm, cu = row["tokens"], row["labels"], row["loss_mask"], row["cu_seqlens"]
        assert toks.shape == labels.shape == lm.shape == (s,) and toks.dtype == labels.dtype == torch.int64
        assert lm.dtype == torch.float32 and cu.dtype == torch.int32
        want_toks, want_mask, bounds = [], [], [0]
        for d in docs:
            t, p, a = expected[d]
            want_toks += t
            want_mask += [0.0] * (p - 1) + [1.0] * a + [0.0]  # position j trains iff tokens[j+1] is answer/eod
            bounds.append(bounds[-1] + len(t))
        used = bounds[-1]
        if used < s:
            bounds.append(s)  # the padding tail is one document
        assert toks[:used].tolist() == want_toks and (toks[used:] == vqa.tok.pad).all()
        assert lm.tolist() == want_mask + [0.0] * (s - used)
        assert cu.tolist() == bounds  # expanded image-token space
        assert labels[:-1].equal(toks[1:])
        assert all(lm[int(b) - 1] == 0 for b in cu[1:])  # no label crosses a document boundary
        # pixel values: exactly transformers' processor on this row's images, in placeholder order
        hf = proc(images=[vqa.images[d] for d in docs], return_tensors="pt")
        assert row["pixel_values"].dtype == torch.float32 and row["image_grid_thw"].dtype == torch.int64
        assert row["pixel_values"].equal(hf["pixel_values"]) and row["image_grid_thw"].equal(hf["image_grid_thw"])
        assert int((toks == cfg.image_token_id).sum()) == int(row["image_grid_thw"].prod(-1).sum()) // merge2
    # packing: every epoch holds each document once; efficiency = document tokens / row capacity
    flat = sorted(d for r in train.rows for d in r)
    assert flat == sorted(list(range(N_DOCS)) * train.num_epochs)
    eff = sum(len(expected[d][0]) for r in train.rows for d in r) / (len(train.rows) * s)
    assert train.packing_efficiency == pytest.approx(eff, abs=1e-12) and 0.5 < eff <= 1.0
    assert train.num_skipped == 0


def test_webdataset_equals_jsonl_and_determinism(vqa):
    cfg = tiny_config()
    a, _, _ = build_train_valid_test_datasets(_args([vqa.jsonl]), cfg, vqa.tok)
    b, _, _ = build_train_valid_test_datasets(_args([vqa.tar]), cfg, vqa.tok)
    c, _, _ = build_train_valid_test_datasets(_args([str(vqa.dir)]), cfg, vqa.tok)  # a directory of shards
    assert a.rows == b.rows == c.rows and a.packing_efficiency == b.packing_efficiency
    assert len(c.documents) == N_DOCS
    for i in (0, 3, len(a) - 1):
        ra, rb, ra2 = a[i], b[i], a[i]
        assert ra.keys() == rb.keys()
        assert all(ra[k].equal(rb[k]) and ra[k].equal(ra2[k]) for k in ra)
    other, _, _ = build_train_valid_test_datasets(_args([vqa.jsonl], seed=4), cfg, vqa.tok)
    assert other.rows != a.rows


def test_first_fit_matches_reference():
    def reference(lengths, cap):  # the textbook O(n * bins) first fit
        bins, free = [], []
        for i, n in enumerate(lengths):
            for b, f in enumerate(free):
                if f >= n:
                    bins[b].append(i)
                    free[b] -= n
                    break
            else:
                bins.append([i])
                free.append(cap - n)
        return bins

    rng = np.random.default_rng(0)
    for trial in range(20):
        cap = int(rng.integers(8, 200))
        lengths = rng.integers(1, cap + 1, size=int(rng.integers(1, 300))).tolist()
        assert first_fit(lengths, cap) == reference(lengths, cap)
    with pytest.raises(ValueError):
        first_fit([5, 11], 10)


def test_long_documents_are_skipped_and_text_only_records(vqa, tmp_path, capsys):
    cfg = tiny_config()
    path = tmp_path / "mixed.jsonl"
    shutil.copy(os.path.join(vqa.dir / "jsonl", vqa.records[0]["image"]), tmp_path / "img.png")
    rows = [{"image": "img.png", "question": "what colour is the square?", "answer": "red."},
            {"question": "is there a mass?", "answer": "no."},
            {"image": None, "question": "the chest?", "answer": "normal."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds, _, _ = build_train_valid_test_datasets(_args([str(path)], seq_length=24), cfg, vqa.tok)
    assert ds.num_skipped == 1 and "1 longer than seq_length skipped" in capsys.readouterr().out
    assert {d for r in ds.rows for d in r} == {1, 2}
    assert "pixel_values" not in ds[0] and int(ds[0]["cu_seqlens"][-1]) == 24
    with pytest.raises(DataError, match="all 3 train documents are longer"):
        build_train_valid_test_datasets(_args([str(path)], seq_length=8), cfg, vqa.tok)


def _write(path, text):
    path.write_text(text)
    return str(path)


def _tar(path, members):
    import io
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize("make, msg", [
    (lambda d: str(d / "missing.jsonl"), "--data-path: .*missing.jsonl not found"),
    (lambda d: _write(d / "a.jsonl", '{"image": "x.png", "question": "q", "answer": "a"}\n'),
     r"a.jsonl:1: image .*x.png not found"),
    (lambda d: _write(d / "a.jsonl", '{"question": "q"}\n'), r"a.jsonl:1: missing key 'answer'"),
    (lambda d: _write(d / "a.jsonl", '{"question": "q", "answer": "a"}\n{oops\n'), r"a.jsonl:2: bad JSON"),
    (lambda d: _write(d / "a.tar", "not a tar"), r"a.tar: not a readable tar file"),
    (lambda d: _tar(d / "b.tar", [("k1.png", b"x")]), r"b.tar:k1: sample has no .json"),
    (lambda d: _tar(d / "b.tar", [("k1.png", b"not a png"), ("k1.json", b'{"question": "q", "answer": "a"}')]),
     r"b.tar:k1.png: unreadable image"),
])
def test_vqa_bad_input(vqa, tmp_path, make, msg):
    with pytest.raises(DataError, match=msg) as e:
        build_train_valid_test_datasets(_args([make(tmp_path)]), tiny_config(), vqa.tok)
    assert "\n" not in str(e.value)


def test_tokenizer_that_does_not_fit_the_model(vqa):
    t = vqa.tok.tokenize("what colour")[0]  # a text id the model would read as an image placeholder
    with pytest.raises(DataError, match=f"tokenizes to id {t}, an image/video placeholder id"):
        build_train_valid_test_datasets(_args([vqa.jsonl]), tiny_config(image_token_id=t), vqa.tok)
    with pytest.raises(DataError, match="has no vision_config"):
        build_train_valid_test_datasets(_args([vqa.jsonl]), tiny_config(vision=None), vqa.tok)
