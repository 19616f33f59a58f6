"""The run's JSON-lines records (steps, events, faults), read whole or as they grow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return JsonlTail(path).read(to_end=True)


class JsonlTail:
    """A JSON-lines file read as it grows: each `read()` parses only what was appended
    since the last one (a line not yet ended waits for its newline, unless `to_end`). Lines
    sort by wall time; unstamped lines keep their order."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.lines: list[dict[str, Any]] = []

    def read(self, to_end: bool = False) -> list[dict[str, Any]]:
        if not self.path.exists():
            return self.lines
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        ended = len(chunk) if to_end else chunk.rfind(b"\n") + 1
        if ended:
            self.offset += ended
            self.lines.extend(_parse(chunk[:ended].decode(errors="replace")))
            self.lines.sort(key=lambda line: line.get("wall", 0.0))
        return self.lines


def _parse(text: str) -> list[dict[str, Any]]:
    lines = []
    for row in filter(str.strip, text.splitlines()):
        try:
            lines.append(json.loads(row))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return lines
