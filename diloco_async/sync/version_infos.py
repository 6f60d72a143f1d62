"""The current version of every fragment as the learners are told it (join and heartbeat replies)."""

from __future__ import annotations

from collections.abc import Sequence

from diloco_async.messages import VersionInfo
from diloco_async.sync.state import FragmentState

__all__ = ["VersionInfos"]


class VersionInfos:
    """Every fragment's current :class:`~diloco_async.messages.VersionInfo`, built again only after
    a fragment's version (or its object) changed: a heartbeat reply costs no model construction."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._infos: list[VersionInfo] = []

    def __call__(self, fragments: Sequence[FragmentState]) -> list[VersionInfo]:
        """A new list (the caller may keep it) of the fragments' current versions, by fragment."""
        key = tuple((f.version, f.refs[f.version].key, f.refs[f.version].sha256, f.compact) for f in fragments)
        if key != self._key or not self._infos:
            self._infos = [VersionInfo(fragment=f.p, version=f.version, key=f.refs[f.version].key,
                                       nbytes=f.refs[f.version].nbytes, sha256=f.refs[f.version].sha256,
                                       compact=f.compact)
                           for f in fragments]
            self._key = key
        return list(self._infos)
