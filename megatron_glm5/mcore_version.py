"""The installed megatron-core release and the version guard of every change this project makes to it.

Every change is a record of :mod:`megatron_glm5.extensions`, installed through its ``apply`` by an entry point
(the training entry, the tools,
``tests/conftest.py``) and only for the releases it is written for: :func:`version_in` decides, and
:func:`require_version` refuses an other release with one line (:class:`UnsupportedMegatronCore`, naming the
installed and the supported releases) where the change cannot be left out; :func:`skip_notice` says in one line on
stderr that a change which can be left out (megatron-core's own code then runs) was not installed.

* :data:`TRAINER_VERSIONS`: the hooks into ``megatron.training`` (``training/megatron_hooks.py``,
  ``training/save_guard.py``, ``training/flops.py``, ``training/checkpoint_checks.py``,
  ``training/indexer_stages.py``, ``training/data_loaders.py``), the checkpoint read guards' megatron-core part and
  the CPU redirects (``cpu_compat.py``): refused outside it.
* ``mcore_fixes.AFFECTED_VERSIONS``, ``models.token_permutation.SUPPORTED_VERSIONS``: skipped outside them.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

from megatron.core.package_info import __version__ as MCORE_VERSION

__all__ = ["MCORE_VERSION", "TRAINER_VERSIONS", "UnsupportedMegatronCore", "require_version", "skip_notice",
           "version_in"]

from megatron_glm5.supported_versions import TRAINER_VERSIONS  # noqa: E402 - the trainer hooks' releases, one home


class UnsupportedMegatronCore(RuntimeError):
    """The installed megatron-core lies outside the releases a change of this project is written for."""


def version_in(versions: Tuple[str, str], version: str = MCORE_VERSION) -> bool:
    """Whether megatron-core ``version`` (its release part: ``0.19.2rc1`` counts as 0.19.2) lies in the inclusive
    range ``versions`` (first, last)."""
    from packaging.version import Version

    release = Version(Version(version).base_version).release
    first, last = (Version(v).release for v in versions)
    return first <= release <= last


def _releases(versions: Tuple[str, str]) -> str:
    return versions[0] if versions[0] == versions[1] else f"{versions[0]} to {versions[1]}"


def require_version(versions: Tuple[str, str], what: str, version: Optional[str] = None) -> None:
    """Raise :class:`UnsupportedMegatronCore` (one line) unless megatron-core ``version`` (default: the installed
    one) lies in ``versions``; ``what`` names the change (e.g. "the trainer hooks (training/megatron_hooks.py)")."""
    version = version or MCORE_VERSION
    if not version_in(versions, version):
        raise UnsupportedMegatronCore(
            f"megatron-core {version} is installed; {what} is written for megatron-core {_releases(versions)}: "
            f"install megatron-core=={versions[1]}")


_NOTICES: set = set()


def skip_notice(versions: Tuple[str, str], what: str, version: Optional[str] = None) -> bool:
    """Whether megatron-core ``version`` (default: the installed one) lies in ``versions``; if not, one line on
    stderr (once per process and ``what``) saying that ``what`` is not installed."""
    version = version or MCORE_VERSION
    if version_in(versions, version):
        return True
    if what not in _NOTICES:
        _NOTICES.add(what)
        print(f"megatron_glm5: megatron-core {version} is installed; {what} is written for megatron-core "
              f"{_releases(versions)} and is not installed (megatron-core's own code runs)", file=sys.stderr,
              flush=True)
    return False
