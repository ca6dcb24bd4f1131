"""Tokenizer, tools/preprocess_data.py, and the text datasets (indexed GPTDataset, blends, mock) on CPU."""

import json
import os
import sys
import types

import numpy as np
import pytest

from megatron_glm5.config import tiny_config
from megatron_glm5.data import DataError
from megatron_glm5.data.builder import build_train_valid_test_datasets, train_valid_test_num_samples
from megatron_glm5.data.tiny_data import make_text_jsonl, make_tiny_tokenizer, tiny_texts
from megatron_glm5.data.tokenizer import build_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import make_tiny_data  # noqa: E402
import preprocess_data  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    tok_path = make_tiny_tokenizer(str(d), vocab_size=200)
    jsonl = make_text_jsonl(str(d / "corpus.jsonl"), 60, seed=1)
    assert preprocess_data.main(["--input", jsonl, "--tokenizer-model", tok_path, "--output-prefix",
                                 str(d / "corpus"), "--append-eod", "--log-interval", "0"]) == 0
    jsonl2 = make_text_jsonl(str(d / "other.jsonl"), 30, seed=2)
    assert preprocess_data.main(["--input", jsonl2, "--tokenizer-model", tok_path, "--output-prefix",
                                 str(d / "other"), "--append-eod", "--log-interval", "0"]) == 0
    return types.SimpleNamespace(dir=d, tok=build_tokenizer(tok_path), tok_path=tok_path, jsonl=jsonl,
                                 prefix=str(d / "corpus_text_document"), prefix2=str(d / "other_text_document"))


def _args(**kw):
    a = dict(mock_data=False, data_path=None, split="90,10,0", seq_length=16, seed=1234, train_iters=10,
             global_batch_size=4, eval_iters=2, eval_interval=5, dataset_type="gpt")
    a.update(kw)
    return types.SimpleNamespace(**a)


def _docs(tok, jsonl):
    with open(jsonl) as f:
        return [tok.tokenize(json.loads(line)["text"]) + [tok.eod] for line in f]


# ------------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_round_trip(tmp_path):
    texts = tiny_texts(40, seed=3)
    path = make_tiny_tokenizer(str(tmp_path), vocab_size=180)
    tok = build_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert tok.path == path and tok.vocab_size <= 180
    assert tok.eod == tok.token_to_id("<|endoftext|>") == 0 and tok.pad == tok.eod  # no <|pad|>: pad = eod
    for t in texts + ["Hello, World!\n  x=1"]:
        ids = tok.tokenize(t)
        assert all(0 <= i < tok.vocab_size for i in ids) and tok.detokenize(ids) == t
    assert len(tok.tokenize(texts[0])) < len(texts[0])  # BPE merges were learnt
    ids = tok.tokenize("<|user|>\nthe scan<|assistant|>\n")
    assert ids[0] == tok.token_to_id("<|user|>") == 1 and tok.token_to_id("<|assistant|>") in ids
    with pytest.raises(DataError, match="not found"):
        build_tokenizer(str(tmp_path / "missing"))


# ------------------------------------------------------------------------------------------------ preprocess
@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_exact_documents(corpus, tmp_path, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = str(tmp_path / "w")
    assert preprocess_data.main(["--input", corpus.jsonl, "--tokenizer-model", corpus.tok_path, "--output-prefix",
                                 out, "--append-eod", "--workers", str(workers), "--log-interval", "0"]) == 0
    ds = IndexedDataset(out + "_text_document")
    want = _docs(corpus.tok, corpus.jsonl)
    assert len(ds) == len(want) == 60
    assert ds.index.dtype == np.uint16  # vocab < 65500
    for i, w in enumerate(want):
        assert ds[i].tolist() == w
    assert sorted(os.listdir(tmp_path)) == ["w_text_document.bin", "w_text_document.idx"]


def _bad_jsonl(path, lines):
    path.write_text("".join(lines))
    return str(path)


@pytest.mark.parametrize("case, make, expect", [
    ("missing input", lambda d: str(d / "nope.jsonl"), "--input: .*nope.jsonl not found"),
    ("bad json", lambda d: _bad_jsonl(d / "in.jsonl", ['{"text": "the scan"}\n', '{"text": oops}\n']),
     r"in.jsonl:2: bad JSON"),
    ("missing key", lambda d: _bad_jsonl(d / "in.jsonl", ['{"text": "a"}\n', '{"txt": "b"}\n']),
     r"in.jsonl:2: missing key 'text'"),
    ("not a string", lambda d: _bad_jsonl(d / "in.jsonl", ['{"text": 3}\n']), r"in.jsonl:1: 'text' must be a string"),
    ("not an object", lambda d: _bad_jsonl(d / "in.jsonl", ['["text"]\n']), r"in.jsonl:1: expected a JSON object"),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_bad_input_one_line_exit_2(corpus, tmp_path, capsys, case, make, expect, workers):
    import re

    src = tmp_path / "src"
    src.mkdir()
    inp = make(src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc = preprocess_data.main(["--input", inp, "--tokenizer-model", corpus.tok_path, "--output-prefix",
                               str(out_dir / "x"), "--append-eod", "--workers", str(workers)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, case
    assert len(err.splitlines()) == 1 and err.startswith("preprocess_data: error: ") and re.search(expect, err), err
    assert os.listdir(out_dir) == []  # nothing half-written


def test_preprocess_bad_tokenizer_and_output_dir(corpus, tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    assert preprocess_data.main(["--input", corpus.jsonl, "--tokenizer-model", str(bad), "--output-prefix",
                                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a valid tokenizer.json" in err
    assert preprocess_data.main(["--input", corpus.jsonl, "--tokenizer-model", corpus.tok_path, "--output-prefix",
                                 str(tmp_path / "no" / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json"]
    with pytest.raises(SystemExit) as e:  # argparse errors are one line too
        preprocess_data.main(["--input", corpus.jsonl])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "required" in err


# ------------------------------------------------------------------------------------------------ GPTDataset
def test_gpt_rows_are_the_shuffled_document_stream(corpus, tmp_path):
    args = _args(data_path=[corpus.prefix], data_cache_path=str(tmp_path / "cache"))
    cfg = tiny_config()
    train, valid, test = build_train_valid_test_datasets(args, cfg, corpus.tok)
    assert test is None  # split weight 0
    n_train, n_valid, _ = train_valid_test_num_samples(args)
    assert (n_train, n_valid) == (40, 24) and len(train) >= 40 and len(valid) >= 24
    docs = _docs(corpus.tok, corpus.jsonl)
    # documents 0..53 are train (round(0.9 * 60)), 54..59 valid; the stream is docs in document_index order
    assert sorted(set(train.document_index.tolist())) == list(range(54))
    assert sorted(set(valid.document_index.tolist())) == list(range(54, 60))
    stream = np.concatenate([docs[d] for d in train.document_index])
    starts = np.concatenate([[0], np.cumsum([len(docs[d]) for d in train.document_index])])
    s = args.seq_length
    for i in range(len(train)):
        row = train[i]
        assert row["tokens"].shape == (s,) and row["labels"].shape == (s,) and row["loss_mask"].dtype.is_floating_point
        doc_pos, off = train.sample_index[train.shuffle_index[i]]
        a = starts[doc_pos] + off
        assert row["tokens"].tolist() == stream[a:a + s].tolist()
        assert row["labels"].tolist() == stream[a + 1:a + s + 1].tolist()  # next token
        assert row["loss_mask"].tolist() == [1.0] * s
    # deterministic: rebuilt (cache hit) and rebuilt without cache give the same rows; another seed does not
    again, _, _ = build_train_valid_test_datasets(_args(data_path=[corpus.prefix]), cfg, corpus.tok)
    assert all(again[i]["tokens"].equal(train[i]["tokens"]) for i in range(len(train)))
    other, _, _ = build_train_valid_test_datasets(_args(data_path=[corpus.prefix], seed=7), cfg, corpus.tok)
    assert not all(other[i]["tokens"].equal(train[i]["tokens"]) for i in range(len(train)))


def test_gpt_blend_and_empty_split(corpus, capsys):
    # no data_cache_path: megatron's BlendedDataset asks torch.distributed for the rank only when it caches
    args = _args(data_path=["0.25", corpus.prefix, "0.75", corpus.prefix2], split="949,50,1")
    train, valid, test = build_train_valid_test_datasets(args, tiny_config(), corpus.tok)
    assert test is None and "test split of" in capsys.readouterr().out  # round(0.999 * 30) == 30: no test docs
    assert len(train) >= 40
    ids = np.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    frac = float((ids == 1).mean())
    assert abs(frac - 0.75) < 0.05, frac
    for i in range(4):
        sub = train.datasets[ids[i]][int(train.dataset_sample_index[i])]
        assert train[i]["tokens"].equal(sub["tokens"])


def test_mock_data_is_sized_and_deterministic():
    args = _args(mock_data=True, eval_iters=0, seq_length=24)
    cfg = tiny_config()
    train, valid, test = build_train_valid_test_datasets(args, cfg, None)
    assert valid is None and test is None and len(train) >= 40
    for i in range(8):
        t = train[i]["tokens"].numpy()
        lab = train[i]["labels"].numpy()
        # MockGPTDataset documents are 1, 2, ..., n-1, <eod=0> (mod vocab): next = current + 1 except after EOD
        nxt = (t + 1) % cfg.vocab_size
        ok = (lab == nxt) | (lab == 0) | (t == 0)
        assert ok.all() and (lab == nxt).mean() > 0.8
    again, _, _ = build_train_valid_test_datasets(args, cfg, None)
    assert all(again[i]["tokens"].equal(train[i]["tokens"]) for i in range(16))


@pytest.mark.parametrize("kw, msg", [
    (dict(data_path=None), "--data-path is required"),
    (dict(data_path=["/nonexistent/prefix"]), r"--data-path: /nonexistent/prefix.bin not found"),
    (dict(split="a,b"), "--split"),
    (dict(dataset_type="images"), "--dataset-type"),
    (dict(mock_data=True, dataset_type="vqa"), "--mock-data makes text rows only"),
])
def test_builder_errors(corpus, kw, msg):
    kw.setdefault("data_path", [corpus.prefix])
    with pytest.raises(DataError, match=msg):
        build_train_valid_test_datasets(_args(**kw), tiny_config(), corpus.tok)
    with pytest.raises(DataError, match="more than the model's vocab_size"):
        build_train_valid_test_datasets(_args(data_path=[corpus.prefix]), tiny_config(vocab_size=64), corpus.tok)


def test_make_tiny_data(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert make_tiny_data.main(["--out", str(tmp_path), "--text-docs", "7", "--vqa-docs", "3"]) == 0
    assert len(IndexedDataset(str(tmp_path / "text_text_document"))) == 7
    assert len((tmp_path / "vqa" / "vqa.jsonl").read_text().splitlines()) == 3
    assert len(os.listdir(tmp_path / "vqa" / "images")) == 3 and (tmp_path / "vqa.tar").is_file()
    assert build_tokenizer(str(tmp_path)).vocab_size <= 200
