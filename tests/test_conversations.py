"""Conversations rendered by the checkpoint's chat template (``--dataset-type chat``): our token ids, labels mask and
pixel tensors equal what transformers' Glm5NextProcessor gives with the same template (a GLM-style template the tiny
assets carry), for multi-turn conversations with images, videos and system prompts; the loss switches; bad input."""

import json
import os

import numpy as np
import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.data import DataError
from megatron_glm5.data.chat_template import build_processor, build_video_processor, load_chat_template
from megatron_glm5.data.conversations import ChatDocuments, PackedChatDataset, read_conversations
from megatron_glm5.data.tiny_data import GLM_CHAT_TEMPLATE, make_chat_jsonl, write_tiny_hf_assets
from megatron_glm5.data.vqa import build_image_processor

TAGGED = GLM_CHAT_TEMPLATE.replace("<|assistant|>\n{{ visible_text(m.content) }}",
                                   "<|assistant|>\n{% generation %}{{ visible_text(m.content) }}{% endgeneration %}")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    hf = tiny_hf_config()
    write_tiny_hf_assets(str(root / "hf"), hf)
    path = make_chat_jsonl(str(root / "chat"), 8)
    cfg = Glm5Config.from_hf(hf)

    def processor(template=None):
        return build_processor(str(root / "hf"), template or load_chat_template(str(root / "hf")),
                               build_image_processor(cfg.vision), build_video_processor(cfg.vision))

    return root, path, cfg, processor


def _decode_all(path):
    """Every frame of a video and its metadata, decoded independently of the project's reader."""
    import av
    from transformers.video_utils import VideoMetadata

    with av.open(path) as c:
        s = c.streams.video[0]
        fps = float(s.average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    return frames, VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2], height=frames.shape[1],
                                 duration=len(frames) / fps, video_backend="pyav")


def _raw(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_ids_masks_and_pixels_equal_the_processor(chat):
    from PIL import Image

    root, path, cfg, processor = chat
    proc = processor()
    docs = ChatDocuments(read_conversations([path]), proc, cfg, eod=0)
    base = os.path.dirname(path)
    kinds = set()
    for d, raw in enumerate(_raw(path)):
        msgs = raw["messages"]
        images, videos, metas = [], [], []
        for m in msgs:
            for it in (m["content"] if isinstance(m["content"], list) else []):
                if it["type"] == "image":
                    images.append(Image.open(os.path.join(base, it["image"])))
                elif it["type"] == "video":
                    v, meta = _decode_all(os.path.join(base, it["video"]))
                    videos.append(v)
                    metas.append(meta)
        text = proc.apply_chat_template(msgs, tokenize=False)
        ref = proc(text=text, images=images or None, videos=videos or None, video_metadata=metas or None,
                   do_sample_frames=True, return_tensors="pt")
        ids = ref["input_ids"][0]
        ours = torch.from_numpy(docs.tokens[d])
        assert int(ours[-1]) == 0 and torch.equal(ours[:-1], ids), d  # + the appended end-of-document token
        row = PackedChatDataset(docs, np.array([d]), 1, len(ours), 1, 0)[0]
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            assert (key in row) == (key in ref), key
            if key in ref:
                assert torch.equal(row[key], ref[key].to(row[key].dtype)), (d, key)
                kinds.add(key)
        assert torch.equal(row["tokens"], ours)
        # the mask: transformers' assistant_masks of the {% generation %}-tagged template (media decoded as above)
        hf = proc.apply_chat_template(_with_media(msgs, base), chat_template=TAGGED, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt",
                                      processor_kwargs=dict(video_metadata=metas or None, do_sample_frames=True))
        assert torch.equal(hf["input_ids"][0], ids)
        for key in ("pixel_values_videos", "video_grid_thw"):
            assert (key in hf) == bool(videos) and (not videos or torch.equal(hf[key], ref[key])), key
        mask = hf["assistant_masks"][0].bool().numpy()
        closing = np.zeros_like(mask)
        closing[1:] = mask[:-1] & ~mask[1:]
        want = np.append(mask | closing, mask[-1])  # the last turn closes on the appended end-of-document
        assert np.array_equal(np.append(False, docs.targets[d][:-1]), want), d
    assert kinds == {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
    tagged = ChatDocuments(read_conversations([path]), processor(TAGGED), cfg, eod=0)
    assert all(np.array_equal(a, b) for a, b in zip(tagged.targets, docs.targets))
    assert all(np.array_equal(a, b) for a, b in zip(tagged.tokens, docs.tokens))


def _with_media(msgs, base):
    """``msgs`` with each image item holding the PIL image and each video item all its decoded frames."""
    from PIL import Image

    out = []
    for m in msgs:
        c = m["content"]
        if isinstance(c, list):
            c = [dict(it, image=Image.open(os.path.join(base, it["image"]))) if it["type"] == "image" else
                 dict(it, video=_decode_all(os.path.join(base, it["video"]))[0]) if it["type"] == "video" else it
                 for it in c]
        out.append({"role": m["role"], "content": c})
    return out


def _targets_text(docs, d, tok):
    ids = docs.tokens[d]
    return tok.decode(ids[1:][docs.targets[d][:-1]])


def test_loss_switches_and_system_prompt(chat):
    root, path, cfg, processor = chat
    proc = processor()
    tok = proc.tokenizer
    convs = read_conversations([path])
    default = ChatDocuments(convs, proc, cfg, eod=0)
    last = ChatDocuments(convs, proc, cfg, eod=0, loss="last")
    every = ChatDocuments(convs, proc, cfg, eod=0, loss="all")
    # conversation 0: image question + follow-up; 2: system prompt
    assert _targets_text(default, 0, tok) == "the square is " + _raw(path)[0]["messages"][1]["content"][0][
        "text"][len("the square is "):] + "<|user|>no, the image is small.<|endoftext|>"
    assert _targets_text(last, 0, tok) == "no, the image is small.<|endoftext|>"
    assert "answer with one short sentence." not in _targets_text(default, 2, tok)
    assert "answer with one short sentence." in _targets_text(every, 2, tok)
    assert "<|image|>" not in _targets_text(every, 0, tok)  # never a media token
    assert "seconds" not in _targets_text(every, 1, tok)


def _write(tmp_path, obj):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(obj) + "\n")
    return str(p)


@pytest.mark.parametrize("obj, phrase", [
    ({"messages": [{"role": "user", "content": "hi <|image|>"}, {"role": "assistant", "content": "x"}]},
     "c.jsonl:1: message text holds the special token '<|image|>'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "../x.png"}]},
                   {"role": "assistant", "content": "x"}]}, "lies outside"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "nope.mp4"}]},
                   {"role": "assistant", "content": "x"}]}, "nope.mp4 not found"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                   {"role": "assistant", "content": "x"}]}, "content item type 'audio'"),
])
def test_bad_conversations_are_one_line(chat, tmp_path, obj, phrase):
    root, path, cfg, processor = chat
    with pytest.raises(DataError) as e:
        ChatDocuments(read_conversations([_write(tmp_path, obj)]), processor(), cfg, eod=0)
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_template_lookup_and_refusals(chat, tmp_path):
    root, path, cfg, processor = chat
    assert load_chat_template(str(root / "hf")) == GLM_CHAT_TEMPLATE
    assert load_chat_template(str(root / "hf" / "tokenizer.json")) == GLM_CHAT_TEMPLATE
    own = tmp_path / "t.jinja"
    own.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(root / "hf"), str(own)).startswith("{% for m")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((root / "hf" / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match="no chat template .* give --chat-template FILE"):
        load_chat_template(str(bare))
    (bare / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default",
                                                                               "template": "{{ 1 }}"}]}))
    assert load_chat_template(str(bare)) == "{{ 1 }}"
    # a template that renders the last turn differently: the assistant turns cannot be found
    odd = ("{% for m in messages %}{% if loop.last %}<|user|>{{ m.content }}{% else %}<|assistant|>{{ m.content }}"
           "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    p = _write(tmp_path, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                       {"role": "user", "content": "c"}]})
    with pytest.raises(DataError, match="prefix-consistently .* generation"):
        ChatDocuments(read_conversations([p]), processor(odd), cfg, eod=0)


def test_vqa_sources_map_to_messages(chat, tiny_data):
    root, path, cfg, processor = chat
    proc = processor()
    jl = read_conversations([str(tiny_data / "vqa" / "vqa.jsonl")])
    tar = read_conversations([str(tiny_data / "vqa.tar")])
    assert len(jl) == len(tar) == 12
    assert jl[0].messages[0]["content"][0] == {"type": "image"} and jl[0].messages[1]["role"] == "assistant"
    a, b = ChatDocuments(jl, proc, cfg, eod=0), ChatDocuments(tar, proc, cfg, eod=0)
    assert all(np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert proc.tokenizer.decode(a.tokens[0][:3]) == "[gMASK]<sop><|user|>"


def test_tagged_template_is_tagged():
    assert TAGGED != GLM_CHAT_TEMPLATE and "{% generation %}" in TAGGED


@pytest.mark.parametrize("with_videos", [False, True])
def test_memorise_conversations_through_pretrain(chat, tmp_path, with_videos):
    """A tiny model memorises a small conversation set (images; images and videos) through
    pretrain_glm5_vlm.py --dataset-type chat: lm loss halves within 30 steps; the rows' text / image / video token
    counts reach TensorBoard."""
    from training_harness import TINY, run, scalars

    root, path, cfg, processor = chat
    lines = [ln for ln in open(path).read().splitlines() if with_videos or '"video"' not in ln]
    data = os.path.join(os.path.dirname(path), f"memorise_{int(with_videos)}.jsonl")  # beside the media it names
    with open(data, "w") as f:
        f.write("\n".join(lines) + "\n")
    args = list(TINY)
    args[args.index("--seq-length") + 1] = "128"
    args[args.index("--micro-batch-size") + 1] = "1"
    args[args.index("--global-batch-size") + 1] = "2"
    tb = tmp_path / "tb"
    proc = run(args + ["--dataset-type", "chat", "--data-path", str(data), "--tokenizer-model", str(root / "hf"),
                       "--split", "1,0,0", "--train-iters", "30", "--tensorboard-dir", str(tb)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = [v for _, v in sorted(scalars(tb)["lm loss"])]
    assert len(values) == 30 and min(values[-3:]) <= values[0] / 2, values
    s = scalars(tb)
    assert s["data/image-tokens"][-1][1] > 0 and (s["data/video-tokens"][-1][1] > 0) == with_videos
    assert "packed chat train:" in proc.stdout and "tokens text" in proc.stdout


def test_data_counters_are_training_totals_one_point_per_iteration(chat, tmp_path):
    """TensorBoard data/* tags: one point per iteration (step = iteration) and the running totals of the training
    micro batches only: a run that validates (--eval-interval 1) writes the same series as one that does not."""
    from training_harness import TINY, run, scalars

    root, path, cfg, processor = chat
    args = list(TINY)
    args[args.index("--seq-length") + 1] = "128"
    args[args.index("--micro-batch-size") + 1] = "1"
    args[args.index("--global-batch-size") + 1] = "2"  # two micro batches per iteration
    base = args + ["--dataset-type", "chat", "--data-path", str(path), "--tokenizer-model", str(root / "hf"),
                   "--split", "2,1,0", "--train-iters", "3"]
    series = {}
    for name, extra in (("plain", []), ("validated", ["--eval-iters", "2", "--eval-interval", "1"])):
        tb = tmp_path / name
        proc = run(base + extra + ["--tensorboard-dir", str(tb)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        s = scalars(tb)
        series[name] = {tag: s[tag] for tag in ("data/text-tokens", "data/image-tokens", "data/video-tokens")}
        if extra:
            assert "lm loss validation" in s
    for tag, points in series["plain"].items():
        assert [step for step, _ in points] == [1, 2, 3], (tag, points)
        assert all(b >= a for (_, a), (_, b) in zip(points, points[1:])), (tag, points)
    assert series["plain"]["data/text-tokens"][0][1] > 0
    assert series["validated"] == series["plain"]


@pytest.mark.parametrize("extra, phrase", [
    (["--dataset-type", "vqa", "--loss-on-all-turns"], "--loss-on-all-turns: only --dataset-type chat reads it"),
    (["--dataset-type", "chat", "--loss-on-all-turns", "--loss-on-last-turn-only"], "not allowed with argument"),
    (["--dataset-type", "chat", "--chat-template", "/nonexistent/t.jinja"],
     "--chat-template: /nonexistent/t.jinja is neither a file nor a Jinja template"),
    (["--dataset-type", "chat", "--energon-packing-buffer", "0"], "--energon-packing-buffer"),
    (["--dataset-type", "chat", "--mock-data"], "leave out --dataset-type chat"),
])
def test_chat_flags_refused_in_one_line(chat, capsys, extra, phrase):
    from megatron_glm5.training.arguments import parse_args

    root, path, cfg, processor = chat
    data = [] if "--mock-data" in extra else ["--data-path", path]
    argv = ["--model-preset", "glm5-tiny", "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "2",
            "--lr", "1e-3", "--eval-iters", "0", "--tokenizer-model", str(root / "hf")] + data + extra
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1, prog="pretrain_glm5_vlm.py")
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("pretrain_glm5_vlm.py: error: "), err
    assert phrase in err[0], err[0]


def _write_lines(tmp_path, objs, name="c.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(p)


def test_empty_answers_train_their_closing_token(chat, tmp_path):
    """docs/data.md: a turn's closing token is trained; an empty (or all-whitespace) answer trains it alone."""
    root, path, cfg, processor = chat
    proc = processor()
    tok = proc.tokenizer
    p = _write_lines(tmp_path, [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "},
                      {"role": "user", "content": "b"}, {"role": "assistant", "content": "ok."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "a"}]},
                      {"role": "assistant", "content": ""}, {"role": "user", "content": "b"},
                      {"role": "assistant", "content": ""}]}])
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "x.png")
    for loss, want in (("assistant", ["<|endoftext|>", "<|user|>ok.<|endoftext|>", "<|user|><|endoftext|>"]),
                       ("last", ["<|endoftext|>", "ok.<|endoftext|>", "<|endoftext|>"])):
        docs = ChatDocuments(read_conversations([p]), proc, cfg, eod=0, loss=loss)
        assert [_targets_text(docs, d, tok) for d in range(3)] == want, loss
        # the first target is predicted right after an empty turn's "<|assistant|>\n" header (and its whitespace)
        for d in (0, 2):
            j = np.flatnonzero(docs.targets[d])[0]
            assert tok.decode(docs.tokens[d][:j + 1]).rstrip().endswith("<|assistant|>"), (loss, d)
        if loss == "assistant":
            j = np.flatnonzero(docs.targets[1])[0]
            assert tok.decode(docs.tokens[1][:j + 1]).endswith("<|assistant|>\n  "), loss


def test_a_set_with_no_token_to_train_on_is_one_line(chat, tmp_path):
    """Every assistant turn only an image (media tokens are never targets): refused, not trained at grad norm 0."""
    from PIL import Image

    root, path, cfg, processor = chat
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "x.png")
    p = _write_lines(tmp_path, [{"messages": [{"role": "user", "content": "draw"},
                                              {"role": "assistant", "content": [{"type": "image", "image": "x.png"}]}]}])
    with pytest.raises(DataError) as e:
        ChatDocuments(read_conversations([p]), processor(), cfg, eod=0, loss="last")
    assert str(e.value) == ("--data-path: none of the 1 conversations has a token to train on (loss mode 'last'): "
                            "check the assistant turns and the chat template")
    assert ChatDocuments(read_conversations([p]), processor(), cfg, eod=0, loss="all").targets[0].sum() > 0


def test_template_rendering_nothing_is_one_line(chat, tmp_path):
    root, path, cfg, processor = chat
    p = _write_lines(tmp_path, [{"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}])
    with pytest.raises(DataError) as e:
        ChatDocuments(read_conversations([p]), processor("{{ '' }}"), cfg, eod=0)
    assert str(e.value) == f"{p}:1: the chat template renders this conversation as no tokens"


def test_template_loops_and_output_are_bounded(chat, tmp_path, monkeypatch):
    """Nested range(100000) loops (10^10 steps) stop at the time bound; a huge rendering at the size bound; both one
    line naming the conversation, and the next rendering runs normally."""
    import time

    from megatron_glm5.data import chat_template

    root, path, cfg, processor = chat
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.5)
    p = _write_lines(tmp_path, [{"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}])
    convs = read_conversations([p])
    hang = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
            + GLM_CHAT_TEMPLATE)
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        ChatDocuments(convs, processor(hang), cfg, eod=0)
    assert time.monotonic() - t0 < 30
    assert str(e.value) == (f"{p}:1: the chat template ran longer than 0.5 s on this conversation "
                            f"(a template loop too long)")
    tagged = TAGGED.replace("[gMASK]", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                       "{% endfor %}[gMASK]")
    with pytest.raises(DataError, match="ran longer than 0.5 s"):
        ChatDocuments(convs, processor(tagged), cfg, eod=0)
    monkeypatch.setattr(chat_template, "MAX_RENDER_CHARS", 10000)
    with pytest.raises(DataError) as e:
        ChatDocuments(convs, processor("{% for i in range(2000) %}xxxxxxxxxx{% endfor %}" + GLM_CHAT_TEMPLATE), cfg,
                      eod=0)
    assert str(e.value) == (f"{p}:1: the chat template renders this conversation as {20000 + 37} characters, more "
                            f"than 10000")  # 37: the rendering of the conversation itself
    docs = ChatDocuments(convs, processor(), cfg, eod=0)  # the watchdog left nothing pending
    assert _targets_text(docs, 0, processor().tokenizer) == "b<|endoftext|>"
    time.sleep(1.0)  # past any deadline of the stopped renderings: no late exception lands here


def test_json_integer_over_the_digit_limit_is_one_line(chat, tmp_path):
    """A JSON integer of 5,000 digits (over Python's int conversion limit) in a messages JSONL and in
    video_preprocessor_config.json: one line naming the file."""
    root, path, cfg, processor = chat
    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "n": '
                  + b"7" * 5000 + b"}\n")
    with pytest.raises(DataError) as e:
        read_conversations([str(p)])
    assert str(e.value).startswith(f"{p}:1: bad JSON (") and "\n" not in str(e.value), str(e.value)
    v = tmp_path / "video_preprocessor_config.json"
    v.write_bytes(b'{"fps": ' + b"7" * 5000 + b"}")
    with pytest.raises(DataError) as e:
        build_video_processor(cfg.vision, str(v))
    assert str(e.value).startswith(f"{v}: bad JSON (") and "\n" not in str(e.value), str(e.value)
