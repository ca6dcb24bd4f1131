"""The checkpoint's own chat template and transformers' ``Glm5NextProcessor`` built around it.

Template (:func:`load_chat_template`): ``--chat-template`` (Megatron-LM's flag) if given: a Jinja FILE, or the
template text itself (a value holding ``{``); else, in the folder of
``--tokenizer-model``, ``chat_template.jinja``, then the ``chat_template`` of ``chat_template.json`` (what
``ProcessorMixin.save_pretrained`` writes), then the ``chat_template`` of ``tokenizer_config.json`` (a string, or a
list of ``{"name", "template"}`` from which ``default`` is taken). None at all is one line. transformers renders
templates in its sandboxed Jinja environment, so a template cannot reach Python objects.

Processor (:func:`build_processor`): the tokenizer (transformers' ``PreTrainedTokenizerFast`` over the same
``tokenizer.json``, with ``tokenizer_config.json`` / ``special_tokens_map.json`` beside it when present),
``Glm5NextImageProcessorPil`` (:func:`megatron_glm5.data.vqa.build_image_processor`) and ``Glm5NextVideoProcessor``
(:func:`build_video_processor`), each set up from the model's vision config and the ``*preprocessor_config.json``
files next to ``--hf-config``.

Rendering (:func:`render_bounded`): each rendering of a conversation is bounded in time (:data:`MAX_RENDER_SECONDS`)
and output size (:data:`MAX_RENDER_CHARS`); a template past either is one line naming the conversation.
"""

from __future__ import annotations

import math
import os
from typing import Optional

from megatron_glm5.errors import one_line
from megatron_glm5.data import DataError
from megatron_glm5.data.jsonl import parse_json

_VIDEO_KEYS = ("do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
               "do_convert_rgb", "min_image_tokens", "max_image_tokens", "patch_expand_factor", "fps", "max_frames",
               "max_duration", "do_sample_frames")
_VIDEO_NUMBERS = {"fps": ((int, float), 0), "max_frames": (int, 1), "max_duration": ((int, float), None),
                  "patch_expand_factor": (int, 1)}
"""The video processor's sampling settings: (type, lowest value) each must have."""
MAX_TEMPLATE_BYTES = 4 * 1024 * 1024


MAX_RENDER_SECONDS = 10.0
"""Longest one rendering of a conversation by the chat template may run (a template's loops are bounded only by
jinja's sandbox, 100,000 per ``range``, so nested loops can run for hours)."""
MAX_RENDER_CHARS = 64 * 1024 * 1024
"""Longest text one rendering may give."""


class _RenderDeadline(BaseException):
    """Raised inside a thread whose rendering ran past its deadline (by :class:`_Watchdog`)."""


class _Watchdog:
    """One daemon thread per process that raises :class:`_RenderDeadline` in a thread still inside a guarded call
    at its deadline (``PyThreadState_SetAsyncExc``: the rendering is Python bytecode, jinja's compiled template, so
    the exception lands at its next loop iteration or call)."""

    _instance = None

    def __init__(self):
        import threading

        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.jobs = {}  # thread id -> (deadline, token)
        self.fired = set()
        self.counter = 0
        threading.Thread(target=self._run, name="glm5-render-watchdog", daemon=True).start()

    @classmethod
    def get(cls) -> "_Watchdog":
        if cls._instance is None or cls._instance.pid != os.getpid():  # a forked worker has no watchdog thread
            cls._instance = cls()
        return cls._instance

    def _run(self):
        import ctypes
        import time

        with self.cond:
            while True:
                now = time.monotonic()
                due = [(tid, tok) for tid, (deadline, tok) in self.jobs.items() if deadline <= now]
                for tid, tok in due:
                    del self.jobs[tid]
                    self.fired.add(tok)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_RenderDeadline))
                waits = [deadline - now for deadline, _ in self.jobs.values()]
                self.cond.wait(min(waits) if waits else None)

    def call(self, fn, seconds: float):
        """``fn()``; True as the second value when it was stopped at ``seconds``."""
        import ctypes
        import threading
        import time

        tid = threading.get_ident()
        with self.cond:
            self.counter += 1
            token = self.counter
            self.jobs[tid] = (time.monotonic() + seconds, token)
            self.cond.notify()
        out = None
        try:
            try:
                out = fn()
            finally:
                with self.cond:
                    self.jobs.pop(tid, None)
                    stopped = token in self.fired
                    self.fired.discard(token)
                if stopped:  # the exception may still be pending: drop it
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
        except _RenderDeadline:
            stopped = True
        return out, stopped


def render_bounded(render, where: str, **kwargs):
    """transformers' ``render_jinja_template(**kwargs)`` (its sandboxed Jinja environment), stopped with a one-line
    :class:`DataError` naming ``where`` when it runs longer than :data:`MAX_RENDER_SECONDS` or gives more than
    :data:`MAX_RENDER_CHARS` characters; returns what ``render`` returns."""
    try:
        out, stopped = _Watchdog.get().call(lambda: render(**kwargs), MAX_RENDER_SECONDS)
    except Exception as e:  # noqa: BLE001 - jinja raises many types (TemplateError, TypeError ...)
        raise DataError(f"{where}: the chat template fails on this conversation ({one_line(e)})") from None
    if stopped:
        raise DataError(f"{where}: the chat template ran longer than {MAX_RENDER_SECONDS:g} s on this conversation "
                        f"(a template loop too long)")
    size = sum(len(t) for t in out[0])
    if size > MAX_RENDER_CHARS:
        raise DataError(f"{where}: the chat template renders this conversation as {size} characters, more than "
                        f"{MAX_RENDER_CHARS}")
    return out


def _folder(tokenizer_model: str) -> str:
    return tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(os.path.abspath(tokenizer_model))


def _read_text(path: str, what: str) -> str:
    try:
        size = os.path.getsize(path)
        if size > MAX_TEMPLATE_BYTES:
            raise DataError(f"{what} {path}: {size} bytes, more than {MAX_TEMPLATE_BYTES} for a chat template")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except OSError as e:
        raise DataError(f"{what} {path}: unreadable ({one_line(e)})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json_object(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            obj = parse_json(f.read(), path)
    except OSError as e:
        raise DataError(f"{path}: unreadable ({one_line(e)})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _template_of(obj: dict, path: str) -> Optional[str]:
    t = obj.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise DataError(f"{path}: chat_template is neither a string nor a list holding a 'default' template")


def load_chat_template(tokenizer_model: str, chat_template: Optional[str] = None) -> str:
    """The Jinja chat template of the run (see the module docstring for where it is looked for)."""
    if chat_template:
        if "{" in chat_template and not os.path.isfile(chat_template):  # Megatron-LM's form: the template text
            return chat_template
        text = _read_text(chat_template, "--chat-template")
        if not text.strip():
            raise DataError(f"--chat-template {chat_template}: the file is empty")
        return text
    folder = _folder(tokenizer_model)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        return _read_text(jinja, "--tokenizer-model")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            t = _template_of(_json_object(path), path)
            if t:
                return t
    raise DataError(f"--tokenizer-model {tokenizer_model}: no chat template (looked for chat_template.jinja, "
                    f"chat_template.json and tokenizer_config.json's chat_template in {folder}); give "
                    f"--chat-template FILE")


def build_hf_tokenizer(tokenizer_model: str):
    """transformers' fast tokenizer over ``tokenizer.json`` (plus its ``tokenizer_config.json`` special tokens)."""
    from transformers import PreTrainedTokenizerFast

    folder = _folder(tokenizer_model)
    path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
    kw = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            obj = _json_object(p)
            for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
                v = obj.get(k)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    kw.setdefault(k, v)
    try:
        return PreTrainedTokenizerFast(tokenizer_file=path, **kw)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
        raise DataError(f"--tokenizer-model: {path} is not a usable tokenizer ({one_line(e)})") from None


def build_video_processor(vision_config, video_preprocessor_config: Optional[str] = None,
                          min_image_tokens: Optional[int] = None, max_image_tokens: Optional[int] = None):
    """transformers' ``Glm5NextVideoProcessor`` for ``vision_config``; the optional ``video_preprocessor_config.json``
    (or ``preprocessor_config.json``) gives the rest and must agree on patch, temporal patch and merge sizes; ``fps``
    must be a finite number > 0, ``max_frames`` and ``patch_expand_factor`` integers >= 1, ``max_duration`` finite."""
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    sizes = {"patch_size": vision_config.patch_size, "temporal_patch_size": vision_config.temporal_patch_size,
             "merge_size": vision_config.spatial_merge_size}
    kw = {}
    if video_preprocessor_config is not None:
        pre = _json_object(video_preprocessor_config)
        for k, v in sizes.items():
            if k in pre and pre[k] != v:
                raise DataError(f"{video_preprocessor_config}: {k}={pre[k]} disagrees with the vision config ({v})")
        kw = {k: pre[k] for k in _VIDEO_KEYS if k in pre}
        for k, (kind, low) in _VIDEO_NUMBERS.items():
            v = kw.get(k)
            if v is None:
                continue
            ok = (isinstance(v, kind) and not isinstance(v, bool) and math.isfinite(v)
                  and (low is None or v >= low) and (k != "fps" or v > 0))
            if not ok:
                want = {"fps": "a finite number > 0", "max_duration": "a finite number (<= 0: no cap)"}.get(
                    k, f"an integer >= {low}")
                raise DataError(f"{video_preprocessor_config}: {k} must be {want}, got {v!r}")
    if min_image_tokens is not None:
        kw["min_image_tokens"] = int(min_image_tokens)
    if max_image_tokens is not None:
        kw["max_image_tokens"] = int(max_image_tokens)
    try:
        processor = Glm5NextVideoProcessor(**sizes, **kw)
        processor.get_num_of_video_patches(4, 32, 32)  # a setting of the wrong type or range fails here
    except Exception as e:  # noqa: BLE001 - transformers raises many types for bad settings
        where = video_preprocessor_config or "--min-image-tokens / --max-image-tokens"
        raise DataError(f"{where}: the video processor settings {kw} are unusable ({one_line(e)})") from None
    return processor


def build_processor(tokenizer_model: str, chat_template: str, image_processor, video_processor):
    """transformers' ``Glm5NextProcessor`` with the run's tokenizer, processors and chat template."""
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

    tokenizer = build_hf_tokenizer(tokenizer_model)
    missing = [t for t in ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                           "<|end_of_video|>") if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise DataError(f"--tokenizer-model {tokenizer_model}: the tokenizer has no {', '.join(missing)} token(s): "
                        f"conversations need GLM's multimodal tokens (use the checkpoint's tokenizer)")
    try:
        return Glm5NextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, chat_template=chat_template)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"--tokenizer-model {tokenizer_model}: cannot build the processor ({one_line(e)})") from None
