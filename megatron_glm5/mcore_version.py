"""The installed megatron-core release and the version guard of every change this project makes to it."""

from __future__ import annotations

from typing import Tuple

from megatron.core.package_info import __version__ as MCORE_VERSION

__all__ = ["MCORE_VERSION", "version_in"]


def version_in(versions: Tuple[str, str], version: str = MCORE_VERSION) -> bool:
    """Whether megatron-core ``version`` (its release part: ``0.19.2rc1`` counts as 0.19.2) lies in the inclusive
    range ``versions`` (first, last)."""
    from packaging.version import Version

    release = Version(Version(version).base_version).release
    first, last = (Version(v).release for v in versions)
    return first <= release <= last
