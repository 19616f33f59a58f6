"""The config keys as `monarch-sky train --help` lists them: each key, its default and the
comment beside its field in `monarch_sky/config.py` (the one place they are written)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize

from omegaconf import OmegaConf

from monarch_sky import config
from monarch_sky.recipes import RECIPES


def key_table(recipe: str | None = None) -> list[tuple[str, str, str]]:
    """(key, default, what it is) for every key of the job config, nested keys dotted; the
    defaults are those of `recipe` (the default recipe if None)."""
    comments = _field_comments()
    rows: list[tuple[str, str, str]] = []
    recipe = recipe or config.JobConfig.recipe
    defaults = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(config.JobConfig), RECIPES[recipe].job_defaults))

    def walk(cls, values: dict, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            value = values[f.name]
            if isinstance(value, dict):  # a section: its dataclass is the field's default
                walk(type(f.default_factory()), value, f"{prefix}{f.name}.")
            else:
                rows.append((prefix + f.name, _show(value), comments.get((cls.__name__, f.name), "")))

    walk(config.JobConfig, defaults, "")
    return rows


def keys_help() -> str:
    rows = key_table()
    width = max(len(k) + len(d) for k, d, _ in rows) + 3
    lines = [f"  {k}={d}".ljust(width + 3) + (f"  {c}" if c else "") for k, d, c in rows]
    head = (f"config keys, KEY=DEFAULT for recipe={config.JobConfig.recipe} (another recipe changes some; "
            "`monarch-sky config recipe=NAME` prints its own):")
    return head + "\n" + "\n".join(lines)


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, str) and str(config.ASSETS) in value:
        return "(shipped)"
    return str(value)


def _field_comments() -> dict[tuple[str, str], str]:
    """The comment on a field's line, or on the lines just above it, per (class, field)."""
    source = inspect.getsource(config)
    notes: dict[int, str] = {}  # line -> a comment at its end
    alone: dict[int, str] = {}  # line -> a comment that is the whole line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("# ").strip()
            (alone if tok.line.strip().startswith("#") else notes)[tok.start[0]] = text
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                line = item.lineno
                text = notes.get(line)
                if text is None:
                    above = []
                    while line - 1 in alone:
                        line -= 1
                        above.insert(0, alone[line])
                    text = " ".join(above)
                found[(node.name, item.target.id)] = text
    return found
