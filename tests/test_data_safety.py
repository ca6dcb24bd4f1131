"""Bad, careless or hostile data inputs to pretrain_glm5_vlm.py, tools/preprocess_data.py and tools/make_tiny_data.py:
each is one line naming the file (or a skipped and counted sample), never a traceback, never attacker code, and no
input file changes.

In-process where the code path is the library's (the dataset builder, the readers, the tools' ``main``); a few
``pretrain_glm5_vlm.py`` runs show the end-to-end exit status and line.
"""

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import types

import numpy as np
import pytest
import torch

from megatron_glm5.cli import make_tiny_data, preprocess_data
from megatron_glm5.config import tiny_config
from megatron_glm5.data import DataError
from megatron_glm5.data.builder import build_train_valid_test_datasets
from megatron_glm5.data.indexed import check_indexed_dataset
from megatron_glm5.data.tiny_data import make_text_jsonl, make_tiny_tokenizer, make_vqa_jsonl, make_vqa_webdataset
from megatron_glm5.data.tokenizer import build_tokenizer
from tests.training_harness import TINY, error_lines, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hashes(*paths) -> dict:
    """sha256 of every file at or under ``paths`` (cache folders left out: they are megatron's, not inputs)."""
    out = {}
    for p in map(str, paths):
        files = [p] if os.path.isfile(p) else [os.path.join(d, f) for d, dirs, fs in os.walk(p)
                                               for f in fs if "cache" not in d]
        for f in files:
            with open(f, "rb") as fh:
                out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _one_line(err: str, *phrases) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for ph in phrases:
        assert ph in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data_safety")
    tok = make_tiny_tokenizer(str(d), vocab_size=200)
    jsonl = make_text_jsonl(str(d / "corpus.jsonl"), 40, seed=1)
    assert preprocess_data.main(["--input", jsonl, "--tokenizer-model", tok, "--output-prefix", str(d / "corpus"),
                                 "--append-eod", "--log-interval", "0"]) == 0
    make_vqa_jsonl(str(d / "vqa"), 6)
    make_vqa_webdataset(str(d / "vqa.tar"), 4)
    return types.SimpleNamespace(dir=d, tok_path=tok, tok=build_tokenizer(tok), jsonl=jsonl,
                                 prefix=str(d / "corpus_text_document"))


def _args(**kw):
    a = dict(mock_data=False, data_path=None, split="90,10,0", seq_length=16, seed=1234, train_iters=10,
             global_batch_size=4, eval_iters=0, eval_interval=5, dataset_type="gpt", data_cache_path=None)
    a.update(kw)
    return types.SimpleNamespace(**a)


def _copy_corpus(data, dst, name="c"):
    for ext in (".bin", ".idx"):
        with open(data.prefix + ext, "rb") as f, open(dst / (name + ext), "wb") as g:
            g.write(f.read())
    return str(dst / name)


def _samples(ds):
    return [ds[i]["tokens"].tolist() for i in range(len(ds))]


# ------------------------------------------------------------------------------------------- .bin / .idx
def _mutate(prefix, how):
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    raw = bytearray(open(idx, "rb").read())
    n_seq = int.from_bytes(raw[18:26], "little")
    if how == "idx_cut":
        raw = raw[:-5]
    elif how == "idx_magic":
        raw[0] ^= 0xFF
    elif how == "idx_dtype":
        raw[17] = 4  # int32 instead of the uint16 the .bin holds
    elif how == "idx_float_dtype":
        raw[17] = 7
    elif how == "idx_count_overflow":
        raw[18:26] = (2 ** 63 + 5).to_bytes(8, "little")
    elif how == "pointer_past_end":
        raw[34 + 4 * n_seq + 8 * (n_seq - 1):34 + 4 * n_seq + 8 * n_seq] = (2 ** 62).to_bytes(8, "little")
    elif how == "length_flip":
        raw[34] ^= 0x40
    elif how == "empty":
        raw = raw[:18] + bytes(8) + (1).to_bytes(8, "little") + bytes(8)
        open(bin_, "wb").close()
    elif how in ("bin_cut", "bin_extra"):
        b = open(bin_, "rb").read()
        open(bin_, "wb").write(b[:-3] if how == "bin_cut" else b + b"\0\0")
    open(idx, "wb").write(bytes(raw))


@pytest.mark.parametrize("how, phrase", [
    ("idx_cut", "truncated or corrupt"), ("idx_magic", "bad magic"), ("idx_dtype", "another dtype"),
    ("idx_float_dtype", "not an integer token type"), ("idx_count_overflow", "truncated or corrupt"),
    ("pointer_past_end", "outside"), ("length_flip", "another dtype or a corrupt index"),
    ("bin_cut", "truncated or mismatched"), ("bin_extra", "truncated or mismatched"), ("empty", "holds no tokens")])
def test_corrupt_bin_idx_is_one_line_naming_the_file(data, tmp_path, how, phrase):
    prefix = _copy_corpus(data, tmp_path)
    _mutate(prefix, how)
    before = _hashes(tmp_path)
    with pytest.raises(DataError) as e:
        build_train_valid_test_datasets(_args(data_path=[prefix]), tiny_config(), data.tok)
    msg = str(e.value)
    assert "\n" not in msg and phrase in msg and (prefix + ".idx") in msg, msg
    assert _hashes(tmp_path) == before


def test_idx_header_fuzz_never_escapes(data, tmp_path):
    """Random byte flips and cuts of a valid .idx: the check refuses with DataError or passes, and what it passes
    megatron reads without error (every sequence inside the .bin)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    good = open(data.prefix + ".idx", "rb").read()
    prefix = _copy_corpus(data, tmp_path)
    rng = np.random.default_rng(0)
    refused = 0
    for trial in range(300):
        raw = bytearray(good)
        if trial % 4 == 0:
            raw = raw[:int(rng.integers(0, len(raw)))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                pos = int(rng.integers(0, 34)) if trial % 2 else int(rng.integers(0, len(raw)))
                raw[pos] = int(rng.integers(0, 256))
        open(prefix + ".idx", "wb").write(bytes(raw))
        try:
            n = check_indexed_dataset(prefix)
        except DataError as e:
            assert "\n" not in str(e) and prefix in str(e)
            refused += 1
            continue
        ds = IndexedDataset(prefix, mmap=True)
        assert len(ds) == n and sum(len(ds[i]) for i in range(n)) * ds.index.dtype_size == os.path.getsize(
            prefix + ".bin")
    assert refused > 200


# ------------------------------------------------------------------------------------------- index caches
def _pickle_npy(path, marker):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    np.save(path, np.array([Evil()], dtype=object), allow_pickle=True)


def test_pickled_index_cache_is_refused_and_never_unpickled(data, tmp_path):
    prefix = _copy_corpus(data, tmp_path)
    cache = tmp_path / "cache"
    args = _args(data_path=[prefix], data_cache_path=str(cache))
    clean = _samples(build_train_valid_test_datasets(args, tiny_config(), data.tok)[0])
    target = next(p for p in cache.iterdir() if p.name.endswith("train-shuffle_index.npy"))
    marker = tmp_path / "PWNED"
    _pickle_npy(target, marker)
    before = _hashes(target, prefix + ".bin", prefix + ".idx")
    with pytest.raises(DataError, match="holds pickled Python objects") as e:
        build_train_valid_test_datasets(args, tiny_config(), data.tok)
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists() and _hashes(target, prefix + ".bin", prefix + ".idx") == before
    os.remove(target)  # as the line says: deleting it has it rebuilt
    assert _samples(build_train_valid_test_datasets(args, tiny_config(), data.tok)[0]) == clean


def test_truncated_and_stale_index_caches_are_rebuilt(data, tmp_path, capsys):
    prefix = _copy_corpus(data, tmp_path)
    cache = tmp_path / "cache"
    args = _args(data_path=[prefix], data_cache_path=str(cache))
    clean = _samples(build_train_valid_test_datasets(args, tiny_config(), data.tok)[0])
    target = next(p for p in cache.iterdir() if p.name.endswith("train-sample_index.npy"))
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) - 8)
    capsys.readouterr()
    assert _samples(build_train_valid_test_datasets(args, tiny_config(), data.tok)[0]) == clean
    out = capsys.readouterr().out
    assert "notice:" in out and "unreadable" in out and "rebuilding it" in out
    # the same prefix re-written with other documents: the cache of the old data is not used for the new
    other = make_text_jsonl(str(tmp_path / "other.jsonl"), 25, seed=9)
    assert preprocess_data.main(["--input", other, "--tokenizer-model", data.tok_path, "--output-prefix",
                                 str(tmp_path / "o"), "--append-eod", "--log-interval", "0"]) == 0
    for ext in (".bin", ".idx"):
        os.replace(str(tmp_path / "o_text_document") + ext, prefix + ext)
    fresh = _samples(build_train_valid_test_datasets(_args(data_path=[prefix], data_cache_path=str(tmp_path / "c2")),
                                                     tiny_config(), data.tok)[0])
    capsys.readouterr()
    assert _samples(build_train_valid_test_datasets(args, tiny_config(), data.tok)[0]) == fresh != clean
    assert "built from other data" in capsys.readouterr().out


_KILL_BUILD = r"""
import os, signal, sys, types
import numpy as np
from megatron_glm5.initialize import install_patches
install_patches()
from megatron_glm5.config import tiny_config
from megatron_glm5.data.builder import build_train_valid_test_datasets
from megatron_glm5.data.tokenizer import build_tokenizer
prefix, cache, tok, where, k = sys.argv[1:6]
k = int(k)
calls = [0]
def killer(fn):
    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == k:
            if where == "save":  # half of the file written, then killed
                fn(*a, **kw)
                with open(a[0] if str(a[0]).endswith(".npy") else str(a[0]) + ".npy", "r+b") as f:
                    f.truncate(os.path.getsize(f.name) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **kw)
    return wrapped
if where == "save":
    np.save = killer(np.save)
else:
    os.replace = killer(os.replace)
args = types.SimpleNamespace(mock_data=False, data_path=[prefix], split="90,10,0", seq_length=16, seed=1234,
                             train_iters=10, global_batch_size=4, eval_iters=0, eval_interval=5, dataset_type="gpt",
                             data_cache_path=cache)
build_train_valid_test_datasets(args, tiny_config(), build_tokenizer(tok))
print("NOT KILLED")
"""


@pytest.mark.parametrize("where, k", [("save", 2), ("replace", 1), ("replace", 4)])
def test_kill_during_index_building_then_the_next_run_builds_correctly(data, tmp_path, where, k):
    """SIGKILL in the middle of megatron writing an index .npy, after the first array was published, and after
    everything but the description: the next build gives the samples of an uninterrupted one."""
    prefix = _copy_corpus(data, tmp_path)
    clean = _samples(build_train_valid_test_datasets(_args(data_path=[prefix], data_cache_path=str(tmp_path / "ref")),
                                                     tiny_config(), data.tok)[0])
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _KILL_BUILD, prefix, str(cache), data.tok_path, where, str(k)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == -signal.SIGKILL and "NOT KILLED" not in proc.stdout, proc.stderr
    assert _samples(build_train_valid_test_datasets(_args(data_path=[prefix], data_cache_path=str(cache)),
                                                    tiny_config(), data.tok)[0]) == clean
    assert not [p for p in os.listdir(cache) if ".tmp-" in p]  # the killed build's temporaries are gone


# ------------------------------------------------------------------------------------------- JSONL records
BAD_RECORDS = [
    (b'{"question": "q", "answer": "a"\n', "bad JSON"),
    (b'\xff\xfe{"question": "q"}\n', "not UTF-8"),
    (b'{"question": "\\ud800", "answer": "a"}\n', "lone surrogate"),
    (b"[" * 100000 + b"]" * 100000 + b"\n", "nested too deeply"),
    (b'{"question": "q", "answer": "a", "n": ' + b"7" * 5000 + b'}\n', "bad JSON"),  # over int's 4,300 digits
    (b'["question", "answer"]\n', "expected a JSON object"),
    (b'{"question": "q"}\n', "missing key 'answer'"),
    (b'{"question": 3, "answer": "a"}\n', "must be a string"),
    (b'{"question": "q", "answer": "a", "image": "../outside.png"}\n', "lies outside"),
    (b'{"question": "q", "answer": "a", "image": "/etc/hostname"}\n', "lies outside"),
    (b'{"question": "q", "answer": "a", "image": "missing.png"}\n', "not found"),
    (b'{"question": "q", "answer": "a", "image": "a\\u0000.png"}\n', "NUL character"),
]


@pytest.mark.parametrize("line, phrase", BAD_RECORDS)
def test_bad_vqa_jsonl_is_one_line_naming_the_file(data, tmp_path, line, phrase):
    from megatron_glm5.data.vqa import read_vqa_records

    path = tmp_path / "bad.jsonl"
    path.write_bytes(line)
    with pytest.raises(DataError, match=phrase) as e:
        read_vqa_records([str(path)])
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_bad_preprocess_jsonl_is_one_line_and_writes_nothing(data, tmp_path, capsys):
    lines = [line.replace(b'"question"', b'"text"') for line, _ in BAD_RECORDS[:5]]
    lines += [b'{"other": "q"}\n', b'{"text": 3}\n', b'{"text": "fine"}\n\n']
    for i, line in enumerate(lines):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_bytes(line)
        before = _hashes(path)
        for workers in ("1", "2"):
            rc = preprocess_data.main(["--input", str(path), "--tokenizer-model", data.tok_path, "--output-prefix",
                                       str(tmp_path / f"out{i}"), "--workers", workers, "--log-interval", "0"])
            err = capsys.readouterr().err
            assert rc == 2, err
            _one_line(err, "preprocess_data: error: ", str(path))
        assert _hashes(path) == before and not [p for p in os.listdir(tmp_path) if p.startswith(f"out{i}")]


def test_preprocess_stores_ids_above_the_entry_count_without_wrapping(tmp_path, capsys):
    """A tokenizer of 3 entries whose end-of-document id is 65543: the file is int32 and holds 65543, not 7."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 65543}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "a b b"}) + "\n")
    assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-model",
                                 str(tmp_path / "tokenizer.json"), "--output-prefix", str(tmp_path / "out"),
                                 "--append-eod", "--log-interval", "0"]) == 0
    assert "int32" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds[0].tolist() == [0, 1, 1, 65543]


def test_jsonl_fuzz_never_escapes(data, tmp_path):
    """Random bytes and random JSON structures through both JSONL readers: a record or one DataError line."""
    from megatron_glm5.cli.preprocess_data import _Encoder
    from megatron_glm5.data.vqa import read_jsonl

    rng = np.random.default_rng(1)
    enc = _Encoder(types.SimpleNamespace(input="fuzz.jsonl", json_keys=["text"], append_eod=True,
                                         tokenizer_model=data.tok_path))
    enc.initializer()

    def value(depth=0):
        kind = int(rng.integers(0, 8 if depth < 4 else 5))
        if kind == 0:
            return None
        if kind == 1:
            return float(rng.standard_normal())
        if kind == 2:
            return int(rng.integers(-10 ** 6, 10 ** 6))
        if kind in (3, 4):
            return "".join(chr(int(c)) for c in rng.integers(0, 0xE000, size=int(rng.integers(0, 12))))
        if kind == 5:
            return [value(depth + 1) for _ in range(int(rng.integers(0, 3)))]
        keys = ["text", "question", "answer", "image", "x"]
        return {keys[int(rng.integers(0, 5))]: value(depth + 1) for _ in range(int(rng.integers(0, 4)))}

    path = tmp_path / "fuzz.jsonl"
    for trial in range(400):
        if trial % 3 == 0:
            line = rng.integers(0, 256, size=int(rng.integers(1, 40)), dtype=np.uint8).tobytes()
        else:
            line = json.dumps(value(), ensure_ascii=bool(trial % 2)).encode("utf-8", "surrogatepass")
        line = line.replace(b"\n", b" ") + b"\n"
        path.write_bytes(line)
        try:
            read_jsonl(str(path))
        except DataError as e:
            assert "\n" not in str(e)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the preprocess reader fails on the file, as the bad-record test shows
        _, docs, err, _ = enc.encode((1, text))
        assert (docs is None) != (err is None) and (err is None or "\n" not in err)


# ------------------------------------------------------------------------------------------- images
def _png_bytes(arr, mode=None):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def _vqa_dir(tmp_path, images: dict, extra=()):
    d = tmp_path / "vqa"
    d.mkdir()
    lines = []
    for name, blob in images.items():
        (d / name).write_bytes(blob)
        lines.append(json.dumps({"image": name, "question": "what colour?", "answer": "red."}))
    (d / "v.jsonl").write_text("\n".join(lines + list(extra)) + "\n")
    return d


def test_sixteen_bit_png_is_scaled_not_white(tmp_path):
    from megatron_glm5.data.vqa import ImageRef

    grey = np.full((16, 16), 30000, dtype=np.uint16)  # 46% grey
    path = tmp_path / "g16.png"
    path.write_bytes(_png_bytes(grey))
    img = ImageRef(str(path), str(path)).load()
    rgb = np.asarray(img.convert("RGB"))
    assert img.mode == "L" and rgb.max() == rgb.min() == round(30000 * 255 / 65535)


def test_image_bombs_corrupt_and_symlinked_images_are_one_line(data, tmp_path):
    from megatron_glm5.data.vqa import VQADocuments, build_image_processor, read_vqa_records

    cfg = tiny_config()
    proc = build_image_processor(cfg.vision)
    png = _png_bytes(np.zeros((8, 8, 3), np.uint8))
    # a PNG header announcing 20000 x 20000 pixels (the pixels are never decoded)
    import struct
    import zlib
    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    bomb = png[:8] + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + png[33:]
    outside = tmp_path / "secret.png"
    outside.write_bytes(png)
    d = _vqa_dir(tmp_path, {"bomb.png": bomb, "junk.png": b"\x89PNG\r\n\x1a\nnot really"})
    os.symlink(outside, d / "link.png")
    before = _hashes(tmp_path)
    for name, phrase in (("bomb.png", "decompression bomb"), ("junk.png", "unreadable image"),
                         ("link.png", "lies outside")):
        (d / "one.jsonl").write_text(json.dumps({"image": name, "question": "q", "answer": "a"}) + "\n")
        with pytest.raises(DataError, match=phrase) as e:
            VQADocuments(read_vqa_records([str(d / "one.jsonl")]), data.tok, cfg, proc)
        assert "\n" not in str(e.value) and name in str(e.value)
    after = _hashes(tmp_path)
    after.pop(str(d / "one.jsonl"))
    assert after == before


@pytest.mark.parametrize("content, phrase", [
    ("[1]", "expected a JSON object"), ("[" * 100000, "nested too deeply"), ('{"image_std": [0, 0, 0]}', "non-finite"),
    ('{"image_mean": "abc"}', "unusable"), ('{"patch_size": 3}', "disagrees with the vision config"),
    ('{"image_std": ' + "7" * 5000 + "}", "bad JSON")])
def test_bad_preprocessor_config_is_one_line(tmp_path, content, phrase):
    from megatron_glm5.data.vqa import build_image_processor

    path = tmp_path / "preprocessor_config.json"
    path.write_text(content)
    with pytest.raises(DataError, match=phrase) as e:
        build_image_processor(tiny_config().vision, str(path))
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def _tar(path, members):
    with tarfile.open(path, "w") as tf:
        for name, blob, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
            else:
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = blob
                tf.addfile(info)


def test_tar_members_links_truncation_and_multi_dot_names(data, tmp_path):
    from megatron_glm5.data.vqa import read_webdataset

    png = _png_bytes(np.zeros((8, 8, 3), np.uint8))
    qa = json.dumps({"question": "q", "answer": "a"}).encode()
    good = tmp_path / "good.tar"
    _tar(good, [("s0.image.png", png, "file"), ("s0.json", qa, "file")])
    rec, = read_webdataset(str(good))
    assert rec.image is not None and rec.image.read() == png  # KEY.image.png is the image, not a text-only sample
    cases = {
        "symlink.tar": ([("s0.png", "/etc/passwd", "symlink"), ("s0.json", qa, "file")], "not a regular file"),
        "hardlink.tar": ([("a.json", qa, "file"), ("s0.png", "a.json", "hardlink"), ("s0.json", qa, "file")],
                         "not a regular file"),
        "two.tar": ([("s0.png", png, "file"), ("s0.jpg", png, "file"), ("s0.json", qa, "file")],
                    "more than one image"),
    }
    for name, (members, phrase) in cases.items():
        _tar(tmp_path / name, members)
        with pytest.raises(DataError, match=phrase) as e:
            read_webdataset(str(tmp_path / name))
        assert str(e.value).startswith(str(tmp_path / name)) and "\n" not in str(e.value)
    blob = open(data.dir / "vqa.tar", "rb").read()
    for cut in (100, 600, len(blob) // 2, len(blob) - 1500):
        (tmp_path / "cut.tar").write_bytes(blob[:cut])
        try:
            read_webdataset(str(tmp_path / "cut.tar"))
        except DataError as e:
            assert str(e).startswith(str(tmp_path / "cut.tar")) and "\n" not in str(e)
        else:  # a cut exactly between members reads the complete ones
            assert cut == len(blob) - 1500


def test_corrupt_image_mid_run_skips_and_counts_the_document(data, tmp_path):
    """An image whose header reads but whose pixels are cut: found when its row is read, the document becomes
    padding (loss 0) and is counted; the row keeps its length and the other documents."""
    from megatron_glm5.data.vqa import PackedVQADataset, VQADocuments, build_image_processor, read_vqa_records

    cfg = tiny_config()
    png = _png_bytes(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    d = _vqa_dir(tmp_path, {"ok.png": png, "cut.png": png[:len(png) // 2]})
    docs = VQADocuments(read_vqa_records([str(d / "v.jsonl")]), data.tok, cfg, build_image_processor(cfg.vision))
    ds = PackedVQADataset(docs, np.arange(2), 1, 512, 0, data.tok.pad)
    row = ds[0]
    assert int(row["skipped_documents"]) == 1 and int(row["image_grid_thw"].shape[0]) == 1
    cut = [d for d in ds.rows[0] if docs.images[d].name.endswith("cut.png")][0]
    assert row["loss_mask"].sum() == docs.targets[1 - cut].sum() and row["tokens"].shape[0] == 512


# ------------------------------------------------------------------------------------------- the tools
def test_preprocess_refuses_existing_outputs_and_a_killed_run_leaves_nothing_accepted(data, tmp_path, capsys):
    out = str(tmp_path / "p")
    big = make_text_jsonl(str(tmp_path / "big.jsonl"), 30000, seed=3)
    before = _hashes(data.prefix + ".bin", data.prefix + ".idx", big)
    rc = preprocess_data.main(["--input", big, "--tokenizer-model", data.tok_path, "--output-prefix",
                               data.prefix[:-len("_text_document")], "--log-interval", "0"])
    _one_line(capsys.readouterr().err, "already exists", data.prefix + ".bin")
    assert rc == 2 and _hashes(data.prefix + ".bin", data.prefix + ".idx", big) == before
    # kill -9 while the .bin is being written
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", big,
                             "--tokenizer-model", data.tok_path, "--output-prefix", out, "--log-interval", "0"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    left = os.listdir(tmp_path)
    assert [p for p in left if ".tmp-" in p] and not [p for p in left if p.startswith("p_text_document")]
    with pytest.raises(DataError, match="not found"):
        check_indexed_dataset(out + "_text_document")
    # the next run removes the temporaries (one notice) and writes the same files as a clean run
    assert preprocess_data.main(["--input", big, "--tokenizer-model", data.tok_path, "--output-prefix", out,
                                 "--log-interval", "0"]) == 0
    assert "removed" in capsys.readouterr().err
    assert preprocess_data.main(["--input", big, "--tokenizer-model", data.tok_path, "--output-prefix",
                                 str(tmp_path / "clean"), "--log-interval", "0"]) == 0
    for ext in (".bin", ".idx"):
        assert open(out + "_text_document" + ext, "rb").read() == open(
            str(tmp_path / "clean_text_document") + ext, "rb").read()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or p.endswith(".lock")]


def test_make_tiny_data_never_overwrites(tmp_path, capsys):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    assert make_tiny_data.main(["--out", str(out), "--text-docs", "2", "--vqa-docs", "1"]) == 2
    _one_line(capsys.readouterr().err, "make_tiny_data: error: ", str(out), "already exists")
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "precious"
    assert [p for p in os.listdir(tmp_path) if p != "tiny"] == []


def test_make_tiny_data_killed_leaves_no_output_and_the_next_run_completes(tmp_path):
    out = tmp_path / "tiny"
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, os.path.join(REPO, "tools", "make_tiny_data.py"), "--out", str(out), "--text-docs", "3000",
           "--vqa-docs", "2"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.startswith(".tiny.tmp-") and os.listdir(tmp_path / p)
                                             for p in os.listdir(tmp_path)):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    done = subprocess.run(cmd[:-4] + ["--text-docs", "3", "--vqa-docs", "2"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "removed 1 temporary folder" in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["tiny"] and check_indexed_dataset(str(out / "text_text_document")) == 3


# ------------------------------------------------------------------------------------------- pretrain runs
def _pretrain(args, data_args):
    return run(TINY + ["--train-iters", "3", "--num-workers", "0"] + data_args + args)


def test_pretrain_corrupt_idx_and_pickled_cache_are_one_line(data, tmp_path):
    prefix = _copy_corpus(data, tmp_path)
    _mutate(prefix, "idx_dtype")
    before = _hashes(tmp_path)
    proc = _pretrain([], ["--data-path", prefix, "--tokenizer-model", str(data.dir), "--split", "1,0,0"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _one_line("\n".join(error_lines(proc)), "pretrain_glm5_vlm.py: error: ", prefix + ".idx", "another dtype")
    assert line and _hashes(tmp_path) == before

    # a cache folder holding a crafted pickle where megatron looks for the shuffle index
    good = _copy_corpus(data, tmp_path, "g")
    cache = tmp_path / "cache"
    args = _args(data_path=[good], data_cache_path=str(cache), split="1,0,0", seq_length=32, train_iters=3)
    build_train_valid_test_datasets(args, tiny_config(), data.tok)
    target = next(p for p in cache.iterdir() if p.name.endswith("train-shuffle_index.npy"))
    marker = tmp_path / "PWNED"
    _pickle_npy(target, marker)
    before = _hashes(tmp_path, target)
    proc = _pretrain([], ["--data-path", good, "--tokenizer-model", str(data.dir), "--split", "1,0,0",
                          "--data-cache-path", str(cache)])
    assert proc.returncode == 1, proc.stderr[-3000:]
    _one_line("\n".join(error_lines(proc)), "pretrain_glm5_vlm.py: error: ", str(target), "pickled")
    assert not marker.exists() and _hashes(tmp_path, target) == before


def test_pretrain_text_with_placeholder_ids_keeps_them_out_of_the_loss(data, tmp_path):
    """Text documents holding the tiny model's image / video ids (250..255): trained with those positions masked,
    the count printed; exit 0."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "ph")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(40):
        doc = rng.integers(3, 200, size=20)
        if i % 4 == 0:
            doc[5] = 250
        b.add_document(torch.tensor(np.append(doc, 0)), [21])
    b.finalize(prefix + ".idx")
    before = _hashes(prefix + ".bin", prefix + ".idx")
    proc = _pretrain([], ["--data-path", prefix, "--tokenizer-model", str(data.dir), "--split", "1,0,0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "image/video placeholder ids kept out of the loss" in proc.stdout
    assert _hashes(prefix + ".bin", prefix + ".idx") == before


def test_pretrain_vqa_with_an_image_cut_mid_file_trains_and_counts(data, tmp_path):
    png = _png_bytes(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    d = _vqa_dir(tmp_path, {f"{i}.png": png if i else png[:len(png) // 2] for i in range(4)})
    before = _hashes(d)
    proc = _pretrain(["--seq-length", "64"], ["--dataset-type", "vqa", "--data-path", str(d / "v.jsonl"),
                                              "--tokenizer-model", str(data.dir), "--split", "1,0,0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert "0.png: unreadable image" in proc.stdout and "document(s) with an unreadable image or video skipped" in proc.stdout
    assert "data: up to iteration 1 on this rank: 1 document(s)" in proc.stdout
    assert _hashes(d) == before


def test_blended_index_cache_truncated_is_rebuilt(data, tmp_path, capsys):
    a, b = _copy_corpus(data, tmp_path, "a"), _copy_corpus(data, tmp_path, "b")
    cache = tmp_path / "cache"
    args = _args(data_path=["0.3", a, "0.7", b], data_cache_path=str(cache), split="1,0,0")
    train = build_train_valid_test_datasets(args, tiny_config(), data.tok)[0]
    clean = _samples(train)
    assert type(train).__name__ == "BlendedDataset"
    target = next(p for p in cache.iterdir() if p.name.endswith("-dataset_index.npy"))
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) - 2)
    capsys.readouterr()
    assert _samples(build_train_valid_test_datasets(args, tiny_config(), data.tok)[0]) == clean
    assert "BlendedDataset-train-description.txt: dataset index cache unreadable" in capsys.readouterr().out


def test_unwritable_index_cache_folder_is_one_line(data, tmp_path, monkeypatch):
    """A cache that must be (re)built in a folder that cannot be written (a read-only or full disk)."""
    import errno

    from megatron_glm5.data import index_cache

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "cache"))

    monkeypatch.setattr(index_cache.tempfile, "mkdtemp", read_only)
    prefix = _copy_corpus(data, tmp_path)
    with pytest.raises(DataError, match="cannot write the dataset index cache .Read-only file system.; give a "
                                        "writable --data-cache-path") as e:
        build_train_valid_test_datasets(_args(data_path=[prefix], data_cache_path=str(tmp_path / "cache")),
                                        tiny_config(), data.tok)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dataset_type, split", [("gpt", "100,0,0"), ("gpt", "999,1,0"), ("vqa", "1,0,0")])
def test_validation_asked_for_and_no_validation_split_is_one_line(data, tmp_path, dataset_type, split):
    """--eval-iters > 0 with a --split that leaves the validation split empty (a 0 weight, or too few documents for
    its share): refused before training, naming both flags (Megatron-LM would start validation on no loader and
    fail with a TypeError at the first --eval-interval)."""
    path = _copy_corpus(data, tmp_path) if dataset_type == "gpt" else str(data.dir / "vqa" / "vqa.jsonl")
    args = _args(data_path=[path], split=split, eval_iters=2, dataset_type=dataset_type, seq_length=64,
                 data_cache_path=str(tmp_path / "cache"))
    before = _hashes(path)
    with pytest.raises(DataError) as info:
        build_train_valid_test_datasets(args, tiny_config(), data.tok)
    assert str(info.value).startswith(f"--eval-iters 2: --split {split} leaves no validation data"), info.value
    assert _hashes(path) == before
    # the same data with a validation share that holds documents builds one
    args.split = "1,1,0"
    assert build_train_valid_test_datasets(args, tiny_config(), data.tok)[1] is not None


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_make_tiny_data_bad_seed_names_seed_and_writes_nothing(tmp_path, capsys, seed):
    """A seed numpy's generator refuses: one line naming --seed (it was reported as a --vocab-size error)."""
    out = tmp_path / "tiny"
    with pytest.raises(SystemExit) as exc:
        make_tiny_data.main(["--out", str(out), "--text-docs", "2", "--vqa-docs", "1", "--seed", seed])
    assert exc.value.code == 2
    _one_line(capsys.readouterr().err, "make_tiny_data: error: --seed must lie in [0, 2**63)", seed)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("ext, fmt", [("bmp", "BMP"), ("gif", "GIF"), ("tif", "TIFF"), ("image.bmp", "BMP")])
def test_tar_image_of_another_format_is_one_line_not_a_text_only_sample(tmp_path, ext, fmt):
    """A tar sample whose image is a BMP / GIF / TIFF (formats the reader does not take) was read as a text-only
    sample and trained without its image, exit 0; now one line naming the member. Other extensions (.txt, .cls)
    stay ignored fields."""
    from PIL import Image

    from megatron_glm5.data.vqa import read_webdataset

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 255, 0)).save(buf, format=fmt)
    qa = json.dumps({"question": "q", "answer": "a"}).encode()
    bad = tmp_path / "bad.tar"
    _tar(bad, [("s0.json", qa, "file"), (f"s0.{ext}", buf.getvalue(), "file")])
    before = _hashes(bad)
    with pytest.raises(DataError) as info:
        read_webdataset(str(bad))
    assert str(info.value) == (f"{bad}: member s0.{ext} is an image of a format this reader does not take "
                               f"(jpg, jpeg, png, webp); convert it, or the sample has no image"), info.value
    assert _hashes(bad) == before
    ok = tmp_path / "ok.tar"
    _tar(ok, [("s0.json", qa, "file"), ("s0.txt", b"caption", "file"), ("s0.cls", b"3", "file")])
    rec, = read_webdataset(str(ok))
    assert rec.image is None and (rec.question, rec.answer) == ("q", "a")


@pytest.mark.parametrize("blob, phrase", [(b"", "unreadable image (an empty file)"),
                                          (b"plain text, no image", "unreadable image (not an image file PIL recognises)")])
def test_empty_or_non_image_file_is_one_line_naming_it_without_an_object_address(data, tmp_path, blob, phrase):
    from megatron_glm5.data.vqa import VQADocuments, build_image_processor, read_vqa_records

    cfg = tiny_config()
    d = _vqa_dir(tmp_path, {"x.png": blob})
    (d / "one.jsonl").write_text(json.dumps({"image": "x.png", "question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError) as e:
        VQADocuments(read_vqa_records([str(d / "one.jsonl")]), data.tok, cfg, build_image_processor(cfg.vision))
    assert str(e.value) == f"{d / 'x.png'}: {phrase}", e.value
    assert (d / "x.png").read_bytes() == blob


def test_preprocess_output_prefix_naming_a_folder_is_one_line(data, tmp_path, capsys):
    """--output-prefix DIR/ wrote DIR/_text_document.bin/.idx (hidden-looking names, exit 0); now one line with the
    prefix to give, nothing written."""
    out = tmp_path / "out"
    out.mkdir()
    rc = preprocess_data.main(["--input", data.jsonl, "--tokenizer-model", data.tok_path, "--output-prefix",
                               str(out) + os.sep, "--log-interval", "0"])
    _one_line(capsys.readouterr().err, f"preprocess_data: error: --output-prefix: {out}{os.sep} names a folder",
              str(out / "corpus"))
    assert rc == 2 and os.listdir(out) == []


_INTERRUPT_IMPORT = r"""
import sys

class CtrlC:  # the user's Ctrl-C arrives while megatron_glm5.config (torch) is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "megatron_glm5.config":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
from megatron_glm5.cli import make_tiny_data
sys.exit(make_tiny_data.main(["--out", sys.argv[1]]))
"""


def test_make_tiny_data_ctrl_c_while_torch_loads_is_one_line(tmp_path):
    """Ctrl-C in the first seconds of make_tiny_data (run_cli imported torch outside its handler): one line, exit
    130, nothing written."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_IMPORT, str(tmp_path / "tiny")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and proc.stderr.splitlines() == ["make_tiny_data: error: interrupted"], proc.stderr
    assert os.listdir(tmp_path) == []
