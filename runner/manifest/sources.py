"""A manifest and its `defaults:` fragments read as text, before Hydra: every key's `file:line:col`.

Hydra composes the files but forgets where each value came from, and reads fragments with no limits.
So every file it will read is read here first, with the same checks as the manifest (runner.manifest.yamlsafe:
plain tags, no duplicate or non-text keys, no alias bombs, located syntax errors), and each key path of
the composed manifest is mapped to the file, line and column that set it (the manifest's own keys win,
as Hydra's `_self_` does by default). Refused here, each at its line:
  - a `hydra:` block (runner sets Hydra's options itself; they would be dropped without a word);
  - `${oc.env:...}`: a manifest says everything that decides its results (see docs/troubleshooting.md);
  - a fragment named with `..` or an absolute path: fragments live in the manifest's folder, so the
    folder is the whole experiment (copy it and it runs the same);
  - a fragment that does not exist (with the closest name in its folder).
No hydra import.
"""

from __future__ import annotations

import difflib
import errno
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from runner.errors import ManifestError, Problem, format_loc
from runner.manifest.yamlsafe import MERGE, load_checked, location

MAX_FILE_BYTES = 4 * 2**20  # a manifest or a fragment: a few KiB in practice
MAX_DEPTH = 8  # fragments that name fragments
BOOL_TAG = "tag:yaml.org,2002:bool"
ENV_RESOLVER = re.compile(r"\$\{\s*oc\.env\s*:")
Loc = tuple


@dataclass
class Sources:
    file: str  # the manifest, as named
    folder: Path  # its folder: Hydra's config dir, and the base of relative input files
    data: dict  # the manifest's own plain data
    locations: dict[Loc, str] = field(default_factory=dict)  # key path → "file:line:col"
    booleans: dict[Loc, str] = field(default_factory=dict)  # key path → the text YAML 1.1 read as a boolean ("no")

    def at(self, loc: Loc) -> str:
        """`file:line:col` of the key path, or of the closest enclosing key that is in a file."""
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.locations:
                return self.locations[loc[:end]]
        return self.file


def read_sources(path: Path) -> Sources:
    file = str(path)
    if path.suffix != ".yaml":
        raise ManifestError([Problem("", "a manifest is a .yaml file (Hydra composes only .yaml)", file)], file)
    text = read_file(path, file)
    data = load_checked(text, file)
    if data is None:
        raise ManifestError([Problem("", "the file is empty; a manifest needs at least 'targets'", file)], file)
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(root, yaml.MappingNode):
        raise ManifestError([Problem("", "a manifest is a mapping of keys (version, name, targets, ...)",
                                     location(file, root.start_mark))], file)
    sources = Sources(file, path.parent, data)
    problems: list[Problem] = []
    own = _locate(root, (), file, sources.booleans)
    if "hydra" in data:
        problems.append(Problem("hydra", "a manifest has no hydra: block (runner sets Hydra's options; choose a "
                                "launcher on the command line: -m hydra/launcher=joblib)", own[("hydra",)]))
    problems += _env_problems(root, file)
    defaults = _node(root, "defaults")
    if isinstance(defaults, yaml.SequenceNode):
        _fragments(defaults, ("defaults",), file, "", path.parent, sources, problems, 0)
    sources.locations.update(own)  # the manifest's own keys win
    if problems:
        raise ManifestError(problems, file)
    return sources


def read_file(path: Path, shown: str, where: str = "") -> str:
    """The text of a manifest or fragment; every way a read can fail is a ManifestError at `where` (or the file)."""
    where = where or shown
    what = "file" if where == shown else f"fragment {shown}"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ManifestError([Problem("", f"{what}: not a regular file", where)], shown)
        if info.st_size > MAX_FILE_BYTES:
            raise ManifestError([Problem("", f"{what}: {info.st_size:,} bytes; a manifest or fragment is at most "
                                         f"{MAX_FILE_BYTES:,}", where)], shown)
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        reasons: dict[int | None, str] = {errno.ENOENT: "not found", errno.ELOOP: "a symlink loop"}
        reason = reasons.get(exc.errno, exc.strerror or str(exc))
        raise ManifestError([Problem("", f"{what}: {reason}" if what != "file" else
                                     ("file not found" if exc.errno == errno.ENOENT else f"cannot read: {reason}"),
                                     where)], shown) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[:exc.start]
        line, column = before.count(b"\n") + 1, exc.start - before.rfind(b"\n")
        raise ManifestError([Problem("", f"not UTF-8 text (byte 0x{data[exc.start]:02x})",
                                     f"{shown}:{line}:{column}")], shown) from None


def _fragments(defaults: yaml.SequenceNode, loc: Loc, file: str, group: str, folder: Path, sources: Sources,
               problems: list, depth: int) -> None:
    """Read every fragment a defaults list names (depth first, as Hydra does), locating their keys."""
    for i, entry in enumerate(defaults.value):
        where = location(file, entry.start_mark)
        named = _entry(entry, group)
        if named is None:
            continue
        config, pkg, optional, explicit = named
        if pkg and depth == 0:
            sources.locations.setdefault(pkg, where)  # keys the fragment brings, at least at their entry
        if any(part in ("..", "") for part in config.split("/")) or config.startswith("/") or "\\" in config:
            problems.append(Problem(format_loc(loc + (i,)), f"fragment {config!r} is outside the manifest's folder: "
                                    "fragments live in the manifest's folder or below it (no '..', no absolute "
                                    "paths), so that the folder holds the whole experiment", where))
            continue
        path = folder / f"{config}.yaml"
        shown = str(Path(sources.file).parent / f"{config}.yaml")
        missing = not path.exists() and not path.is_symlink()  # a loop or a folder: read_file says which
        if missing and optional:
            continue  # Hydra skips an optional fragment that is not there
        if missing:
            problems.append(Problem(format_loc(loc + (i,)), f"no fragment {config!r} (looked for {shown})"
                                    + _closest(path), where))
            continue
        if depth >= MAX_DEPTH:
            problems.append(Problem(format_loc(loc + (i,)), f"fragments nest more than {MAX_DEPTH} deep "
                                    "(a fragment that includes itself?)", where))
            continue
        try:
            text = read_file(path, shown, where)
        except ManifestError as exc:  # reported at the entry that names the fragment
            problems += [Problem(format_loc(loc + (i,)) if p.source == where else p.path, p.message, p.source)
                         for p in exc.problems]
            continue
        try:
            load_checked(text, shown)
        except ManifestError as exc:
            problems += exc.problems
            continue
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            continue
        if not isinstance(root, yaml.MappingNode):
            problems.append(Problem("", "a fragment is a mapping of keys", location(shown, root.start_mark)))
            continue
        pkg = pkg if explicit else _package_header(text, pkg)  # `group@pkg:` wins over `# @package`
        inner = _locate(root, pkg, shown, sources.booleans)
        if pkg + ("hydra",) == ("hydra",) and ("hydra",) in inner:
            problems.append(Problem("hydra", "a fragment has no hydra: block (runner sets Hydra's options; choose a "
                                    "launcher on the command line: -m hydra/launcher=joblib)", inner[("hydra",)]))
        problems += _env_problems(root, shown)
        nested = _node(root, "defaults")
        if isinstance(nested, yaml.SequenceNode):
            _fragments(nested, pkg + ("defaults",), shown, config.rpartition("/")[0], folder, sources, problems,
                       depth + 1)
        sources.locations.update(inner)


def _entry(entry: yaml.Node, group: str) -> tuple[str, Loc, bool, bool] | None:
    """A defaults entry → (config path without .yaml, package as a key path, optional, package given); None for
    _self_, Hydra's own entries and anything Hydra will judge itself."""
    if isinstance(entry, yaml.ScalarNode) and isinstance(entry.value, str):
        name = entry.value.strip()
        if name in ("_self_", "") or name.startswith("hydra/"):
            return None
        config = f"{group}/{name}" if group and not name.startswith("/") else name.lstrip("/") if group else name
        return config, _package(config.rpartition("/")[0]), False, False
    if isinstance(entry, yaml.MappingNode) and len(entry.value) == 1:
        key, value = entry.value[0]
        if not isinstance(key, yaml.ScalarNode) or not isinstance(value, yaml.ScalarNode) or value.tag.endswith("null"):
            return None
        words = str(key.value).split()
        optional = bool(words) and words[0] == "optional"
        if words and words[0] in ("optional", "override"):
            words = words[1:]
        if len(words) != 1 or words[0].startswith("hydra") or value.value == "???":
            return None
        grp, _, pkg = words[0].partition("@")
        grp = f"{group}/{grp}" if group and not grp.startswith("/") else grp.lstrip("/") if group else grp
        return f"{grp}/{value.value}", _package(pkg or grp), optional, bool(pkg)
    return None


def _package(name: str) -> Loc:
    name = name.replace("/", ".")
    if name.startswith("_global_"):
        name = name.removeprefix("_global_").lstrip(".")
    return tuple(p for p in name.split(".") if p)


def _package_header(text: str, default: Loc) -> Loc:
    for line in text.splitlines()[:5]:
        if line.startswith("# @package "):
            return _package(line.removeprefix("# @package ").strip())
    return default


def _closest(path: Path) -> str:
    if not path.parent.is_dir():  # the group's folder itself is misspelt
        up = path.parent.parent
        folders = sorted(p.name for p in up.iterdir() if p.is_dir()) if up.is_dir() else []
        close = difflib.get_close_matches(path.parent.name, folders, n=1)
        return f" (no folder {path.parent.name!r}; did you mean '{close[0]}'?)" if close else ""
    siblings = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.stem, siblings, n=1)
    if close:
        return f" (did you mean '{close[0]}'?)"
    shown = ", ".join(siblings[:8]) + (f", ... ({len(siblings)} in all)" if len(siblings) > 8 else "")
    return f"; there are: {shown}" if siblings else ""


def _locate(root: yaml.Node, prefix: Loc, file: str, booleans: dict[Loc, str]) -> dict[Loc, str]:
    """Key path → `file:line:col` of its key. A key a merge key (`<<: *anchor`) brings in is located at itself,
    inside the anchored mapping, under the path it is merged into (a key written beside `<<:` wins, as in YAML).
    Values YAML 1.1 read as booleans go to `booleans` as written (`no`), for the errors about them.
    Bounded: yamlsafe has already refused anything that expands past MAX_VALUES."""
    out: dict[Loc, str] = {}
    stack = [(root, prefix)]
    seen: set[tuple[int, Loc]] = set()
    while stack:
        node, loc = stack.pop()
        if (id(node), loc) in seen:
            continue
        seen.add((id(node), loc))
        if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG:
            booleans.setdefault(loc, node.value)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == MERGE:
                    merged = value.value if isinstance(value, yaml.SequenceNode) else [value]
                    for mapping in merged:
                        if isinstance(mapping, yaml.MappingNode):
                            for k, v in mapping.value:
                                if isinstance(k, yaml.ScalarNode) and k.tag != MERGE:
                                    out.setdefault(loc + (k.value,), location(file, k.start_mark))
                                    stack.append((v, loc + (k.value,)))
                elif isinstance(key, yaml.ScalarNode):
                    out[loc + (key.value,)] = location(file, key.start_mark)
                    stack.append((value, loc + (key.value,)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out[loc + (i,)] = location(file, item.start_mark)
                stack.append((item, loc + (i,)))
    return out


def _env_problems(root: yaml.Node, file: str) -> list[Problem]:
    """`${oc.env:...}` anywhere in a file: refused at its line (the variable's value is never shown)."""
    problems: list[tuple[int, int, Problem]] = []
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode) and isinstance(node.value, str) and ENV_RESOLVER.search(node.value):
            problems.append((node.start_mark.line, node.start_mark.column,
                             Problem(format_loc(loc), ENV_MESSAGE, location(file, node.start_mark))))
        elif isinstance(node, yaml.MappingNode):
            stack += [(v, loc + (k.value,)) for k, v in node.value if isinstance(k, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(v, loc + (i,)) for i, v in enumerate(node.value)]
    return [p for *_, p in sorted(problems, key=lambda t: t[:2])]


ENV_MESSAGE = ("${oc.env:...} is not allowed: a manifest says everything that decides its results; write the value "
               "(or pass it from your shell as an override, e.g. seed=$SEED)")


def _node(root: yaml.MappingNode, name: str) -> yaml.Node | None:
    return next((v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == name), None)

