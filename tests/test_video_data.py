"""Video data (``--dataset-type chat``): mp4 / webm read with PyAV (WebM headers carry no frame count), and bad
videos: missing, corrupt, zero frames, decompression-bomb sizes, paths leaving the data directory (refused in one
line before training), too long for ``--seq-length`` (skipped and counted), damaged when the row is read (the
document becomes padding, counted)."""

import hashlib
import json

import numpy as np
import pytest

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.data import DataError
from megatron_glm5.data import video_io
from megatron_glm5.data.chat_template import build_processor, build_video_processor, load_chat_template
from megatron_glm5.data.conversations import ChatDocuments, PackedChatDataset, read_conversations
from megatron_glm5.data.tiny_data import video_samples, write_tiny_hf_assets, write_video
from megatron_glm5.data.video_io import VideoRef
from megatron_glm5.data.vqa import build_image_processor
from training_harness import TINY, error_lines, run


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    hf = tiny_hf_config()
    write_tiny_hf_assets(str(root / "hf"), hf)
    cfg = Glm5Config.from_hf(hf)
    proc = build_processor(str(root / "hf"), load_chat_template(str(root / "hf")),
                           build_image_processor(cfg.vision), build_video_processor(cfg.vision))
    data = root / "data"
    data.mkdir()
    video, q, a = video_samples(1)[0]
    write_video(str(data / "ok.mp4"), video)
    write_video(str(data / "ok.webm"), video)
    return root, cfg, proc, data, video


def _conv(data, rel, name="c.jsonl"):
    p = data / name
    p.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "video", "video": rel}, {"type": "text", "text": "what colour?"}]},
        {"role": "assistant", "content": "red."}]}) + "\n")
    return str(p)


def test_mp4_and_webm_probe_and_decode(env):
    root, cfg, proc, data, video = env
    for name in ("ok.mp4", "ok.webm"):
        ref = VideoRef(str(data / name), name)
        meta = ref.probe()
        assert (meta.total_num_frames, meta.fps, meta.width, meta.height) == (8, 4.0, 64, 48)
        frames = ref.decode([0, 2, 2, 7], 64, 48)
        assert frames.shape == (4, 48, 64, 3) and frames.dtype == np.uint8
        assert np.array_equal(frames[1], frames[2])
        assert np.abs(frames[0].astype(int) - video[0]).mean() < 8  # lossy codecs, close to the source


def _zero_frame_video(path):
    import av

    with av.open(path, mode="w") as c:  # a container whose header names a video stream and no frame follows
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        c.start_encoding()


@pytest.mark.parametrize("case, phrase", [
    ("missing", "nope.mp4 not found"),
    ("corrupt", "bad.mp4: unreadable video"),
    ("empty", "bad.mp4: unreadable video (an empty file)"),
    ("zero", "zero.mp4"),
    ("outside", "lies outside"),
    ("bomb", "more than 1000 (a decompression bomb"),
])
def test_bad_videos_are_one_line(env, tmp_path, monkeypatch, case, phrase):
    root, cfg, proc, data, video = env
    d = tmp_path / "d"
    d.mkdir()
    rel = {"missing": "nope.mp4", "corrupt": "bad.mp4", "empty": "bad.mp4", "zero": "zero.mp4",
           "outside": "../x.mp4", "bomb": "ok.mp4"}[case]
    if case == "corrupt":  # bytes no demuxer takes
        (d / "bad.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    elif case == "empty":
        (d / "bad.mp4").write_bytes(b"")
    elif case == "zero":
        _zero_frame_video(str(d / "zero.mp4"))
    elif case == "outside":
        (tmp_path / "x.mp4").write_bytes((data / "ok.mp4").read_bytes())
    elif case == "bomb":
        (d / "ok.mp4").write_bytes((data / "ok.mp4").read_bytes())
        monkeypatch.setattr(video_io, "MAX_FRAME_PIXELS", 1000)
    with pytest.raises(DataError) as e:
        ChatDocuments(read_conversations([_conv(d, rel)]), proc, cfg, eod=0)
    msg = str(e.value)
    assert phrase in msg and "\n" not in msg, msg
    if case == "zero":
        assert "zero frames" in msg or "no video stream" in msg, msg


def test_too_long_skipped_and_damaged_mid_run_skipped(env, tmp_path, capsys):
    root, cfg, proc, data, video = env
    d = tmp_path / "d"
    d.mkdir()
    write_video(str(d / "v.webm"), video)
    p = d / "c.jsonl"
    lines = [{"messages": [{"role": "user", "content": [{"type": "video", "video": "v.webm"}]},
                           {"role": "assistant", "content": "red."}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok."}]}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    docs = ChatDocuments(read_conversations([str(p)]), proc, cfg, eod=0)
    short = int(docs.lengths[1])
    ds = PackedChatDataset(docs, np.arange(2), 1, short + 2, 1, 0)
    assert ds.num_skipped == 1 and "1 longer than seq_length skipped" in ds.summary()
    ds = PackedChatDataset(docs, np.arange(2), 1, int(docs.lengths.sum()), 1, 0)
    assert "pixel_values_videos" in ds[0]
    # damaged after the documents were built
    (d / "v.webm").write_bytes(b"\x1aE\xdf\xa3" + np.random.default_rng(1).bytes(2000))
    row = ds[0]
    assert "pixel_values_videos" not in row and int(row["skipped_documents"][0]) == 1
    assert int(row["loss_mask"].sum()) == int(docs.targets[1].sum())
    assert "v.webm: unreadable video" in capsys.readouterr().out


def test_pretrain_refuses_a_corrupt_video_in_one_line(env, tmp_path):
    root, cfg, proc, data, video = env
    d = tmp_path / "d"
    d.mkdir()
    (d / "bad.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    path = _conv(d, "bad.mp4")
    before = hashlib.sha256((d / "bad.mp4").read_bytes()).hexdigest()
    proc_ = run(TINY + ["--train-iters", "3", "--dataset-type", "chat", "--tokenizer-model", str(root / "hf"),
                        "--data-path", path, "--split", "1,0,0", "--seq-length", "256"], timeout=300)
    assert proc_.returncode == 1, proc_.stderr[-2000:]
    lines = error_lines(proc_)
    assert len(lines) == 1 and lines[0].startswith("pretrain_glm5_vlm.py: error: ") and "bad.mp4: unreadable video" \
        in lines[0], lines
    assert "Traceback" not in proc_.stderr
    assert hashlib.sha256((d / "bad.mp4").read_bytes()).hexdigest() == before


@pytest.mark.parametrize("case", ["short", "png"])
def test_video_too_short_or_a_png_is_one_line(env, tmp_path, case):
    """A 1-frame video (0.25 s, no frame at the processor's fps) and a PNG named as a video: one line naming it."""
    from PIL import Image

    root, cfg, proc, data, video = env
    d = tmp_path / "d"
    d.mkdir()
    if case == "short":
        rel = "short.mp4"
        write_video(str(d / rel), video[:1])
    else:
        rel = "still.png"
        Image.fromarray(video[0]).save(d / rel)
    with pytest.raises(DataError) as e:
        ChatDocuments(read_conversations([_conv(d, rel)]), proc, cfg, eod=0)
    msg = str(e.value)
    assert f"video {rel}" in msg and "\n" not in msg, msg
    assert "too short" in msg, msg


@pytest.mark.parametrize("content, key", [('{"fps": 0}', "fps"), ('{"fps": "2"}', "fps"), ('{"fps": -1.5}', "fps"),
                                          ('{"max_frames": -3}', "max_frames"), ('{"max_frames": 2.5}', "max_frames"),
                                          ('{"max_duration": "x"}', "max_duration"),
                                          ('{"patch_expand_factor": 0}', "patch_expand_factor")])
def test_bad_video_preprocessor_config_is_one_line(env, tmp_path, content, key):
    root, cfg, proc, data, video = env
    path = tmp_path / "video_preprocessor_config.json"
    path.write_text(content)
    with pytest.raises(DataError) as e:
        build_video_processor(cfg.vision, str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: {key} must be") and "\n" not in msg, msg
    path.write_text('{"fps": 2, "max_frames": 8}')
    vp = build_video_processor(cfg.vision, str(path))
    assert (vp.fps, vp.max_frames) == (2, 8)
