"""YAML as draftsmith reads it: safe tags only, a duplicate key is an error naming both lines, and a
document whose aliases expand past a bound is refused before anything walks it.

PyYAML's safe loader shares the object an alias names, so a small file can describe a structure of
billions of nodes ("billion laughs"); anything that walks or prints it then runs for hours.  The bound
here counts the nodes the document expands to, with each alias counted at its full size, and is
checked on the composed node graph, before a Python object exists.
"""
from __future__ import annotations

import yaml

MAX_NODES = 100_000
"""The most nodes a recipe (or an override's value) may expand to; the largest shipped recipe has ~200."""


class StrictYAMLError(ValueError):
    """YAML that draftsmith refuses: a duplicate key, or aliases that expand past MAX_NODES."""


class _Loader(yaml.SafeLoader):
    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            size = _expanded_size(node, {})
            if size > MAX_NODES:
                raise StrictYAMLError(f"it expands to more than {MAX_NODES:,} values through its aliases (&/*), "
                                      "which no recipe needs; write the values out, without nested aliases")
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                if key in seen:
                    raise StrictYAMLError(f"key '{key}' is given twice, at line {seen[key] + 1} and line "
                                          f"{key_node.start_mark.line + 1}; keep one of them")
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, memo: dict, limit: int = MAX_NODES) -> int:
    """Nodes `node` stands for once every alias is written out (stops counting past `limit`)."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = limit + 1                 # a node that contains itself expands without end
    size = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = ()
    for child in children:
        size += _expanded_size(child, memo, limit)
        if size > limit:
            break
    memo[key] = size
    return size


def load(text: str):
    """The one YAML document in `text`, through the strict safe loader (raises yaml.YAMLError or
    StrictYAMLError)."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def one_line(err: Exception) -> str:
    """A YAML error as one line: the problem and where it is."""
    if isinstance(err, StrictYAMLError):
        return str(err)
    where = getattr(err, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem}{at}"
