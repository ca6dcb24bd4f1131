"""The torch.save record writer of the converter (checkpoint/torch_record.py): the same bytes as torch.save, read back
by torch.load, zipfile (CRCs checked) and torch DCP's FileSystemReader; what it cannot write is left to torch.save."""

import hashlib
import io
import zipfile

import pytest
import torch

from megatron_glm5.checkpoint import torch_record
from megatron_glm5.checkpoint.checksums import HashingFile
from megatron_glm5.checkpoint.torch_record import TorchRecordWriter

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
SHAPES = [(), (1,), (7,), (3, 5), (130, 257), (2, 1, 3), (64, 128)]


def _tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def _saved(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_bytes_as_torch_save(dtype):
    w = TorchRecordWriter()
    for i, shape in enumerate(SHAPES):
        t = _tensor(shape, dtype, i)
        assert w.supports(t), (dtype, shape)
        buf = io.BytesIO()
        n = w.write(buf, t)
        got = buf.getvalue()
        assert n == len(got)
        assert got == _saved(t), (dtype, shape)
        back = torch.load(io.BytesIO(got), weights_only=True)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        with zipfile.ZipFile(io.BytesIO(got)) as z:
            assert z.testzip() is None  # every entry's CRC-32 is right


def test_prefix_cached_and_records_appended_to_a_hashed_file(tmp_path):
    """Several records in one file (as in a .distcp): each slice is a torch.save archive; the file hash is right."""
    w = TorchRecordWriter()
    ts = [_tensor((64, 128), torch.bfloat16, s) for s in range(3)] + [_tensor((5,), torch.float32, 9)]
    path = tmp_path / "f.bin"
    spans = []
    with open(path, "wb") as raw:
        stream = HashingFile(raw)
        for t in ts:
            assert w.supports(t)
            off = stream.tell()
            spans.append((off, w.write(stream, t)))
        digest = stream.hexdigest()
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest
    for t, (off, n) in zip(ts, spans):
        assert data[off:off + n] == _saved(t)
    assert [k for k in w._prefixes if k[1] == (64, 128)] == [(torch.bfloat16, (64, 128))]  # one per (dtype, shape)


def test_left_to_torch_save():
    """Tensors whose torch.save archive the writer does not reproduce are refused (the caller uses torch.save)."""
    w = TorchRecordWriter()
    base = _tensor((8, 6), torch.float32)
    assert w.supports(base)
    assert not w.supports(torch.empty(0))  # torch.save writes no data record for it
    assert not w.supports(torch.empty(2, 0, 3))
    assert not w.supports(base[2:])  # storage larger than the tensor
    assert not w.supports(base.t())  # not contiguous
    assert not w.supports(base.to(torch.float8_e4m3fn))  # torch pickles float8 storages otherwise
    assert not w.supports(base.clone().requires_grad_())
    assert not w.supports(torch.nn.Parameter(base.clone(), requires_grad=False))


def test_unknown_layout_leaves_everything_to_torch_save(monkeypatch):
    def broken(self):
        raise ValueError("unexpected torch.save layout")

    monkeypatch.setattr(torch_record._Layout, "__init__", broken)
    assert not TorchRecordWriter().supports(_tensor((3, 5), torch.bfloat16))


def test_mismatching_probe_leaves_the_dtype_to_torch_save(monkeypatch):
    monkeypatch.setattr(torch_record, "_FLAGS", 0x0008)  # as if torch's zip flags had changed
    assert not TorchRecordWriter().supports(_tensor((3, 5), torch.bfloat16))


def test_large_records_left_to_torch_save(monkeypatch):
    monkeypatch.setattr(torch_record, "_MAX_DATA", 1000)  # (stands for 4 GiB: zip64 entries)
    w = TorchRecordWriter()
    assert w.supports(_tensor((250,), torch.float32))
    assert not w.supports(_tensor((251,), torch.float32))


def test_dcp_reader_loads_records(tmp_path):
    """torch DCP's FileSystemReader loads a checkpoint whose records (tensors and objects) the converter's writer
    wrote, equal to the checkpoint torch's own FileSystemWriter writes, byte for byte."""
    import torch.distributed.checkpoint as dcp

    from megatron_glm5.checkpoint import dcp_save

    sd = {"a": _tensor((64, 33), torch.bfloat16, 1), "b": _tensor((7,), torch.float32, 2),
          "c": _tensor((3, 4, 5), torch.int64, 3), "d": _tensor((2, 2), torch.float8_e4m3fn, 4),
          "e": "an object", "f": {"step": 3}}

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    writer = dcp_save._writer_cls()(str(ours), thread_count=2)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(theirs), thread_count=2), no_dist=True)
    for name in ("__0_0.distcp", "__0_1.distcp"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        assert hashlib.sha256((ours / name).read_bytes()).hexdigest() == writer.digests[name]
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in sd.items()}
    got["f"] = {"step": None}
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(ours)), no_dist=True)
    assert all(torch.equal(got[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in "abcd")
    assert got["e"] == "an object" and got["f"] == {"step": 3}
