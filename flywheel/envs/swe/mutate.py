"""Seeded single-point bug injection at the syntax-tree level (libcst), in non-test code only.

A *site* is one place where one small, plausible mistake can be made:

    comparison  <  <->  <=,  >  <->  >=,  ==  <->  !=,  in  <->  not in,  is  <->  is not
    arithmetic  +  <->  -  (not on string literals),  *  ->  //,  //  ->  *,  +=  <->  -=
    integer     n  ->  n - 1,  0  ->  1  (decimal literals)
    boolean     and  <->  or,  `not x`  ->  `x`
    return      return True  <->  return False,  return a, b  ->  return b, a

`find_sites` lists every site of a repository's mutable files in a fixed order (file path, then
position in the file); `mutate` rewrites exactly one of them and leaves every other byte of the
file as it was. `sample_sites` orders the sites by a seeded shuffle (sampling without
replacement), so the same seed gives the same sites and, because rewriting is deterministic,
the same patches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from flywheel.envs.swe.testpaths import is_test_path

_SWAP_CMP = {cst.LessThan: cst.LessThanEqual, cst.LessThanEqual: cst.LessThan,
             cst.GreaterThan: cst.GreaterThanEqual, cst.GreaterThanEqual: cst.GreaterThan,
             cst.Equal: cst.NotEqual, cst.NotEqual: cst.Equal,
             cst.In: cst.NotIn, cst.NotIn: cst.In, cst.Is: cst.IsNot, cst.IsNot: cst.Is}
_SWAP_BIN = {cst.Add: cst.Subtract, cst.Subtract: cst.Add, cst.Multiply: cst.FloorDivide,
             cst.FloorDivide: cst.Multiply}
_SWAP_AUG = {cst.AddAssign: cst.SubtractAssign, cst.SubtractAssign: cst.AddAssign}
_SWAP_BOOL = {cst.And: cst.Or, cst.Or: cst.And}
_STRINGS = (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)


@dataclass(frozen=True)
class Site:
    file: str
    """Path relative to the repository root."""
    index: int
    """The site's position among its file's sites."""
    line: int
    kind: str
    """What the mutation does, e.g. `comparison LessThan -> LessThanEqual`."""


def _swapped(op: cst.CSTNode, swaps: dict[type, type]) -> cst.CSTNode:
    """The operator `swaps` maps `op`'s type to, with `op`'s spacing."""
    return swaps[type(op)](whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after)


def _names(old: cst.CSTNode, new: cst.CSTNode) -> str:
    return f"{type(old).__name__} -> {type(new).__name__}"


def _mutation(node: cst.CSTNode) -> tuple[cst.CSTNode, str] | None:
    """The one mutation of `node` if it is a site (with what it does), else None."""
    if isinstance(node, cst.ComparisonTarget) and type(node.operator) in _SWAP_CMP:
        new = _swapped(node.operator, _SWAP_CMP)
        return node.with_changes(operator=new), f"comparison {_names(node.operator, new)}"
    if isinstance(node, cst.BinaryOperation) and type(node.operator) in _SWAP_BIN:
        if isinstance(node.left, _STRINGS) or isinstance(node.right, _STRINGS):
            return None
        new = _swapped(node.operator, _SWAP_BIN)
        return node.with_changes(operator=new), f"arithmetic {_names(node.operator, new)}"
    if isinstance(node, cst.AugAssign) and type(node.operator) in _SWAP_AUG:
        new = _swapped(node.operator, _SWAP_AUG)
        return node.with_changes(operator=new), f"augmented {_names(node.operator, new)}"
    if isinstance(node, cst.Integer) and node.value.isdigit():
        n = int(node.value)
        m = 1 if n == 0 else n - 1
        return node.with_changes(value=str(m)), f"integer {n} -> {m}"
    if isinstance(node, cst.BooleanOperation):
        new = _swapped(node.operator, _SWAP_BOOL)
        return node.with_changes(operator=new), f"boolean {_names(node.operator, new)}"
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        return node.expression.with_changes(lpar=(*node.lpar, *node.expression.lpar),
                                            rpar=(*node.expression.rpar, *node.rpar)), "boolean drop not"
    if isinstance(node, cst.Return) and isinstance(node.value, cst.Name) and node.value.value in ("True", "False"):
        new = "False" if node.value.value == "True" else "True"
        return node.with_changes(value=node.value.with_changes(value=new)), f"return {node.value.value} -> {new}"
    if isinstance(node, cst.Return) and isinstance(node.value, cst.Tuple) and len(node.value.elements) == 2:
        a, b = node.value.elements
        swapped = (b.with_changes(comma=a.comma), a.with_changes(comma=b.comma))
        return node.with_changes(value=node.value.with_changes(elements=swapped)), "return swap 2 items"
    return None


class _Rewriter(cst.CSTTransformer):
    """Counts sites in traversal order; rewrites the one numbered `target` (-1: none)."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target
        self.found: list[tuple[int, str]] = []

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
        mutation = _mutation(original)
        if mutation is None:
            return updated
        if len(self.found) == self.target:
            updated = mutation[0]  # no site inside it was rewritten: there is only one target
        self.found.append((self.get_metadata(PositionProvider, original).start.line, mutation[1]))
        return updated


def _rewrite(source: str, target: int) -> tuple[str, list[tuple[int, str]]]:
    rewriter = _Rewriter(target)
    module = MetadataWrapper(cst.parse_module(source)).visit(rewriter)
    return module.code, rewriter.found


def mutable_files(root: Path, sources: tuple[str, ...]) -> list[str]:
    """The non-test Python files under `sources` (files or folders), sorted, relative to `root`."""
    files: set[str] = set()
    for source in sources:
        path = root / source
        candidates = [path] if path.is_file() else sorted(path.rglob("*.py"))
        for file in candidates:
            rel = file.relative_to(root).as_posix()
            if file.suffix == ".py" and not is_test_path(rel):
                files.add(rel)
    return sorted(files)


def find_sites(root: Path, sources: tuple[str, ...]) -> list[Site]:
    sites = []
    for rel in mutable_files(root, sources):
        _, found = _rewrite((root / rel).read_bytes().decode("utf-8"), -1)
        sites += [Site(rel, i, line, kind) for i, (line, kind) in enumerate(found)]
    return sites


def sample_sites(sites: list[Site], seed: int | str) -> list[Site]:
    """All of `sites`, in an order fixed by `seed` (draw them front to back: no repeats)."""
    order = list(sites)
    random.Random(f"swe-sites:{seed}").shuffle(order)
    return order


def mutate(source: str, site: Site) -> str:
    """`source` (the text of `site.file`) with `site` rewritten."""
    code, found = _rewrite(source, site.index)
    if len(found) <= site.index or found[site.index] != (site.line, site.kind):
        raise ValueError(f"{site} is not a site of this source")
    return code
