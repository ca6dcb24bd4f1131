"""Where an image's or a video's encoded bytes live (:class:`MediaRef`): the part shared by
:class:`~megatron_glm5.data.vqa.ImageRef` and :class:`~megatron_glm5.data.video_io.VideoRef`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_glm5.data import DataError


@dataclass(frozen=True)
class MediaRef:
    """A whole file (``path``), ``size`` bytes at ``offset`` inside a tar (``path`` the tar), or ``data`` already in
    memory (a sample streamed by Megatron-Energon); ``name`` is how messages name it."""

    path: str
    name: str
    offset: int = 0
    size: int = -1
    data: Optional[bytes] = None

    def read(self) -> bytes:
        """The encoded bytes."""
        if self.data is not None:
            return self.data
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)

    def checked_size(self, limit: int, kind: str) -> int:
        """The encoded size in bytes; :class:`DataError` naming ``kind`` ('image', 'video') when it is 0 or more
        than ``limit``."""
        size = len(self.data) if self.data is not None else self.size if self.size >= 0 else os.path.getsize(
            self.path)
        if size > limit:
            raise DataError(f"{self.name}: {kind} file of {size} bytes, more than {limit}")
        if size == 0:
            raise DataError(f"{self.name}: unreadable {kind} (an empty file)")
        return size
