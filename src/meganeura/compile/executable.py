"""What compilation hands to the runtime: plain data, no GPU objects and no graph.

The runtime builds buffers, pipelines and bind groups from an ``Executable`` and encodes its
streams; nothing in here needs the compiler again, so an Executable can be serialised and
run elsewhere (export)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A tensor's home: pool ("temp" arena, "group" parameter group, or
    "param"/"state"/"input"/"const"/"out" by name) plus a byte range."""

    pool: str
    name: str  # buffer name (pinned) or "" for the arena
    offset: int  # bytes
    nbytes: int
