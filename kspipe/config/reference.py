"""docs/configuration.md, written from the schemas: every key of kspipe's config with its
default and the comment beside it in its dataclass, group by group in the order of
``conf/config.yaml``'s defaults list, and the shipped experiments with their first comment.

    python -m kspipe.config.reference docs/configuration.md   # write the page
    python -m kspipe.config.reference                         # print it

tests/docs/test_configuration.py checks that the page is what this writes.  A key's comment
is the one on its line (with the lines of ``#`` indented under it that go on from it), or the
comment lines just above it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from pathlib import Path

from kspipe.config import schema

#: The schemas' own groups, stored by kspipe.config.schema itself (the rest are the plugins').
OWN_GROUPS = {
    "compile": schema.CompileConfig,
    "stages": schema.StagesConfig,
    "tracking": schema.TrackingConfig,
}

HEADER = """\
# Configuration

<!-- Written by `python -m kspipe.config.reference docs/configuration.md` from the
config's schemas; tests/docs/test_configuration.py checks it. Edit the dataclasses, not this. -->

Every key of kspipe's config, its default and what it means, as the dataclasses of its
schema declare them ([kspipe/config/schema.py](../kspipe/config/schema.py) and each
group's `config.py`). Set any of them on the command line
(`kspipe +experiment=omniglot_5way train.meta_iters=50`); an experiment sets a few at once.
`kspipe +experiment=omniglot_5way --cfg job` prints the whole config a command would run.
A misspelt key or a value of the wrong type is refused in one line before anything runs.
`${...}` is a value that follows another key (`${kspipe_min:a,b}`: the smaller of the two).
"""


def comments(module) -> tuple[dict[int, str], set[int]]:
    """``{line: text}`` of every comment in ``module``'s source, without its ``#`` (one that
    goes on from the line above, ``#`` then two spaces or more, starts with a space), and
    the lines that hold a comment alone."""
    found, alone = {}, set()
    source = inspect.getsource(module)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string[1:]
            if token.line.lstrip().startswith("#"):
                alone.add(token.start[0])
    return found, alone


def field_comments(cls) -> dict[str, str]:
    """``{field: comment}`` of a dataclass, read from its module's source."""
    module = sys.modules[cls.__module__]
    notes, alone = comments(module)
    tree = ast.parse(inspect.getsource(module))
    (body,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    found = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in alone and not notes[line].startswith("  "):
            above.insert(0, notes[line].strip())
            line -= 1
        beside, line = [], node.end_lineno
        if line in notes:
            beside.append(notes[line].strip())
            while line + 1 in alone and notes[line + 1].startswith("  "):
                line += 1
                beside.append(notes[line].strip())
        found[node.target.id] = " ".join(" ".join(above + beside).split())
    return found


def default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def shown(value) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value).replace('"', "")
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def rows(cls, prefix: str) -> list[str]:
    """The table rows of ``cls``'s keys under ``prefix``; a nested dataclass's keys follow
    with their own prefix."""
    notes = field_comments(cls)
    lines = []
    for field in dataclasses.fields(cls):
        value = default(field)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            lines.extend(rows(type(value), f"{key}."))
            continue
        lines.append(f"| `{key}` | `{cell(shown(value))}` | {cell(notes.get(field.name, ''))} |")
    return lines


def section(title: str, parts: list, prefix: str) -> str:
    where = ", ".join(
        f"[{p}](../{p})"
        for p in dict.fromkeys(
            str(Path(inspect.getsourcefile(part)).relative_to(ROOT)) for part in parts
        )
    )
    text = [f"## {title}", ""]
    text += [f"{inspect.getdoc(part)}" for part in parts] + ["", f"Declared in {where}.", ""]
    text += ["| key | default | meaning |", "| --- | --- | --- |"]
    for part in parts:
        text += rows(part, prefix)
    return "\n".join(text) + "\n"


ROOT = Path(__file__).resolve().parents[2]


def groups() -> list[tuple[str, list]]:
    """``[(group, [dataclass, ...])]`` in the order of conf/config.yaml's defaults list."""
    from omegaconf import OmegaConf

    plugins = schema.builtin_schemas()
    order = []
    for entry in OmegaConf.load(ROOT / "conf" / "config.yaml").defaults:
        if isinstance(entry, str) or entry is None:
            continue  # core, plugins, _self_: the top level, the installed plugins'
        for group in entry:
            if group.startswith("override "):
                continue  # Hydra's own groups (hydra/job_logging): not kspipe's config
            parts = plugins.get(group) or [OWN_GROUPS[group]]
            order.append((group, list(parts) if isinstance(parts, list) else [parts]))
    return order


def experiments() -> str:
    text = ["## Experiments (`+experiment=<name>`)", ""]
    text += ["| experiment | what it is |", "| --- | --- |"]
    for path in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        lines = path.read_text().splitlines()
        first = []
        for line in lines:
            if line.startswith("# @package") or not line.strip():
                continue
            if not line.startswith("#") or not line.strip("# ") or "kspipe " in line:
                break  # the first paragraph, before any example command
            first.append(line.lstrip("# ").strip())
        link = f"[{path.stem}](../conf/experiment/{path.name})"
        text.append(f"| {link} | {cell(' '.join(first))} |")
    return "\n".join(text) + "\n"


def render() -> str:
    parts = [HEADER, section("The top level", [schema.CoreConfig], "")]
    for group, classes in groups():
        parts.append(section(f"`{group}`", classes, f"{group}."))
    parts.append(experiments())
    return "\n".join(parts)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        Path(argv[0]).write_text(render())
    else:
        sys.stdout.write(render())


if __name__ == "__main__":
    main()
