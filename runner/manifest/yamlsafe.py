"""Read a manifest's YAML as plain data only, before anything constructs it.

PyYAML's safe composer gives the node tree with line numbers; on it we refuse, each with the line:
  - tags that would construct objects (`!!python/object/apply:os.system`) or anything not plain data;
  - duplicate keys in a mapping (YAML loaders silently keep the last one);
  - keys that are not text (a list, a mapping, null, a number or a boolean as a key);
  - alias bombs ("billion laughs") and recursive aliases: the tree is sized with aliases expanded,
    in time linear in the file, and refused past MAX_VALUES.
Hydra reads the file again afterwards; by then it is known to be small, plain and unambiguous.
"""

from __future__ import annotations

import yaml

from runner.errors import ManifestError, Problem, format_loc

STR, MERGE = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"
MAX_VALUES = 100_000  # a manifest expanded: scalars, lists and mappings counted
MAX_DEPTH = 64  # lists and mappings inside each other; a manifest needs under ten
MAX_DIGITS = 100  # Python refuses to read integers past 4,300 digits; no setting needs more than 20
PLAIN_TAGS = {f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "map",
                                                         "seq", "merge", "timestamp")}


def compose_checked(text: str, file: str) -> yaml.Node | None:
    """The root node of `text` (None when empty), or a ManifestError naming the file, line and column."""
    try:
        _check_depth(text, file)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.reader.ReaderError as exc:  # a character YAML refuses (NUL, other controls): it has no mark
        before = text[:exc.position]
        where = f"{file}:{before.count(chr(10)) + 1}:{exc.position - before.rfind(chr(10))}"
        problem = Problem("", f"YAML syntax error: the character U+{exc.character:04X} is not "
                          "allowed in YAML (a NUL or other control character): remove it", where)
        raise ManifestError([problem], file) from None
    except yaml.YAMLError as exc:
        problem = Problem("", f"YAML syntax error: {_reason(exc)}", location(file, _mark(exc)))
        raise ManifestError([problem], file) from None
    if root is not None:
        _check_size(root, file)
        _check_nodes(root, file)
    return root


def _check_depth(text: str, file: str) -> None:
    """Refuse deep nesting from the event stream, which PyYAML parses iteratively: its composer recurses, and
    where its recursion would end depends on the stack and on the recursion limit other libraries set."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ManifestError([Problem("", f"the YAML nests more than {MAX_DEPTH} levels of lists or mappings "
                                             "deep: a manifest is shallow", location(file, event.start_mark))], file)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def load_checked(text: str, file: str):
    """The plain data of `text` after compose_checked's checks; merge-key (`<<:`) errors located too."""
    if compose_checked(text, file) is None:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:  # a constructor error: the mapping that holds `<<:` is the place to look
        mark, found = getattr(exc, "context_mark", None), getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        if mark is not None and found is not None and found.line != mark.line:
            reason += f" (at line {found.line + 1})"
        raise ManifestError([Problem("", f"YAML error: {reason}", location(file, mark or found))], file) from None


def _reason(exc: yaml.YAMLError) -> str:
    """PyYAML's problem, with its context ("while parsing a block mapping", and where that started)."""
    reason = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    if "'\\t'" in reason:
        reason += " (YAML indents with spaces, never tabs)"
    context, mark, at = getattr(exc, "context", None), getattr(exc, "context_mark", None), _mark(exc)
    if context and mark is not None and at is not None and mark.line != at.line:
        reason += f" ({context} at line {mark.line + 1})"
    return reason


def _mark(exc: yaml.YAMLError):
    return getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)


def _check_size(root: yaml.Node, file: str) -> None:
    """Values with aliases expanded, each shared node sized once (memo): linear time however deep the bomb."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ManifestError([Problem("", "recursive YAML alias: a value contains itself",
                                         location(file, node.start_mark))], file)
        open_nodes.add(id(node))
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_VALUES:
                raise ManifestError([Problem("", f"the YAML expands to more than {MAX_VALUES:,} values (through "
                                             "aliases?): a manifest is small", location(file, node.start_mark))], file)
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root)


def _check_nodes(root: yaml.Node, file: str) -> None:
    """Tags and duplicate keys, each node visited once (aliases point at nodes already seen)."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.tag.endswith(":int") and len(node.value) > MAX_DIGITS:
            raise ManifestError([Problem(format_loc(loc), f"a number with {len(node.value):,} digits: no setting takes "
                                         "a number that large", location(file, node.start_mark))], file)
        if node.tag not in PLAIN_TAGS:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ManifestError([Problem(format_loc(loc), f"YAML tag {tag!r} is not allowed: a manifest holds "
                                         "plain data (strings, numbers, booleans, lists, mappings)",
                                         location(file, node.start_mark))], file)
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key, value in node.value:
                if key.tag not in (STR, MERGE):
                    raise ManifestError([Problem(format_loc(loc), f"a key must be a name (text), not {_kind(key)}",
                                                 location(file, key.start_mark))], file)
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and name in first:
                    first_line = first[name].start_mark.line + 1
                    raise ManifestError([Problem(
                        format_loc(loc + (name,)), f"duplicate key (first at line {first_line}); YAML would silently "
                        "keep only the last one", location(file, key.start_mark))], file)
                if name is not None:
                    first[name] = key
                stack += [(key, loc), (value, loc + (name,))]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, loc + (i,)) for i, item in enumerate(node.value)]


def _kind(key: yaml.Node) -> str:
    if isinstance(key, yaml.SequenceNode):
        return "a list"
    if isinstance(key, yaml.MappingNode):
        return "a mapping"
    if key.tag.endswith(":null"):
        return "null (an empty key, '~' or 'null')"
    return f"the {key.tag.rsplit(':', 1)[-1]} {key.value} (quote it to use it as a name: '{key.value}':)"


def location(file: str, mark) -> str:
    """`file:line:col` of a YAML mark (1-based), or the file alone when there is no mark."""
    return f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
