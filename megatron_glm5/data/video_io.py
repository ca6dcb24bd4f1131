"""Video files (mp4, webm, ...) read with PyAV, as transformers' ``read_video_pyav`` reads them, with the checks an
untrusted file needs.

:class:`VideoRef` names where a video's encoded bytes live (a whole file, or a member inside a tar). ``probe()``
reads the container header and, when the header has no frame count (WebM), counts the frames by demuxing packets
(no decoding): it gives transformers' ``VideoMetadata`` (``total_num_frames``, ``fps`` = the stream's average rate,
``duration`` = frames / fps, ``width``, ``height``, ``video_backend="pyav"``). ``decode(indices)`` returns the RGB
frames at ``indices`` (uint8 ``[len(indices), H, W, 3]``; frame ``i`` is the ``i``-th decoded frame, an index given
twice gives the frame twice, as ``video[indices]`` does in transformers' video processor).

Refused in one line naming the video (:class:`~megatron_glm5.data.DataError`): a missing, empty or unreadable file,
no video stream, no frame rate, zero frames, frames larger than :data:`MAX_FRAME_PIXELS` (a decompression bomb), a
file larger than :data:`MAX_VIDEO_BYTES`, sampled frames holding more than :data:`MAX_DECODED_PIXELS` pixels in all,
and frames that the stream promises but does not deliver when decoded (a truncated or damaged file).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_glm5.errors import one_line
from megatron_glm5.data import DataError
from megatron_glm5.data.media import MediaRef

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi")
MAX_VIDEO_BYTES = 2 * 1024 ** 3
"""Largest encoded video file read."""
MAX_FRAME_PIXELS = 64 * 1024 * 1024
"""Largest frame (width x height) read; the same limit as images."""
MAX_DECODED_PIXELS = 1024 ** 3
"""Most pixels (frames x width x height) of the sampled frames of one video held in memory (3 GiB as RGB)."""


@dataclass(frozen=True)
class VideoRef(MediaRef):
    """Where a video's encoded bytes live (:class:`~megatron_glm5.data.media.MediaRef`)."""

    def _open(self):
        import av

        self.checked_size(MAX_VIDEO_BYTES, "video")
        src = self.path if self.data is None and self.size < 0 else io.BytesIO(self.read())
        container = av.open(src, mode="r")
        if not container.streams.video:
            container.close()
            raise DataError(f"{self.name}: no video stream")
        return container

    def probe(self):
        """transformers' ``VideoMetadata`` of the video (no frame decoded); :class:`DataError` if unusable."""
        from transformers.video_utils import VideoMetadata

        try:
            with self._open() as container:
                stream = container.streams.video[0]
                w, h = int(stream.width or 0), int(stream.height or 0)
                if w * h > MAX_FRAME_PIXELS:
                    raise DataError(f"{self.name}: video frames of {w} x {h} pixels, more than {MAX_FRAME_PIXELS} "
                                    f"(a decompression bomb or a video far larger than the model's budget)")
                if w <= 0 or h <= 0:
                    raise DataError(f"{self.name}: unreadable video (no frame size in the header)")
                rate = stream.average_rate
                if not rate or float(rate) <= 0:
                    raise DataError(f"{self.name}: unreadable video (no frame rate in the header)")
                frames = int(stream.frames or 0)
                if frames <= 0:  # WebM / Matroska headers carry no frame count: count the packets
                    frames = sum(1 for p in container.demux(stream) if p.size)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - PyAV raises many types (FFmpegError, ValueError ...)
            raise DataError(f"{self.name}: unreadable video ({one_line(e)})") from None
        if frames <= 0:
            raise DataError(f"{self.name}: video with zero frames")
        fps = float(rate)
        return VideoMetadata(total_num_frames=frames, fps=fps, width=w, height=h, duration=frames / fps,
                             video_backend="pyav")

    def decode(self, indices: Sequence[int], width: int, height: int) -> np.ndarray:
        """The RGB frames at ``indices`` (ascending), uint8 [len(indices), height, width, 3]."""
        indices = [int(i) for i in indices]
        if len(indices) * width * height > MAX_DECODED_PIXELS:
            raise DataError(f"{self.name}: {len(indices)} sampled frames of {width} x {height} pixels, more than "
                            f"{MAX_DECODED_PIXELS} pixels in all")
        wanted = set(indices)
        last = max(indices)
        got = {}
        try:
            with self._open() as container:
                for i, frame in enumerate(container.decode(video=0)):
                    if i > last:
                        break
                    if i in wanted:
                        if (frame.width, frame.height) != (width, height):
                            raise DataError(f"{self.name}: frame {i} is {frame.width} x {frame.height}, the header "
                                            f"says {width} x {height}")
                        got[i] = frame.to_ndarray(format="rgb24")
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - PyAV raises many types
            raise DataError(f"{self.name}: unreadable video ({one_line(e)})") from None
        missing = wanted - set(got)
        if missing:
            raise DataError(f"{self.name}: frame {min(missing)} could not be decoded (the file is truncated or "
                            f"damaged)")
        return np.stack([got[i] for i in indices])
