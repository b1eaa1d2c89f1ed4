"""Fail when two or more of our modules import each other in a circle (scripts/check.sh runs it).

A circle is a strongly connected component of the file-level import graph (grimp, which
import-linter uses), counting imports under `if TYPE_CHECKING:` and imports inside functions:
either way, neither file can be read or tested without the other. Run from a tree laid out as
the installed package (scripts/package_tree.sh); prints each circle with one import chain that
closes it, and exits 1 if there is any.

Usage: python scripts/import_cycles.py [PACKAGE]   (default: swarmrl)
"""

from __future__ import annotations

import sys

import grimp


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph(package: str) -> tuple[set[str], dict[str, set[str]]]:
    """Our modules and, per module, the modules of ours it imports directly."""
    graph = grimp.build_graph(package, cache_dir=None)
    nodes = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    edges = {m: {t for t in graph.find_modules_directly_imported_by(m) if t in nodes} for m in nodes}
    return nodes, edges


def main(argv: list[str]) -> int:
    """Print every circle and return 1 if there is any, else 0."""
    package = argv[1] if len(argv) > 1 else "swarmrl"
    nodes, edges = import_graph(package)
    circles = strongly_connected(nodes, edges)
    for members in circles:
        inside = set(members)
        print(f"import circle of {len(members)} modules:")
        for m in members:
            targets = sorted(edges[m] & inside)
            print(f"  {m} -> {', '.join(targets)}")
    if circles:
        print(f"{len(circles)} import circle(s); break each by moving the shared piece down or passing it in")
        return 1
    print(f"no import circles among {len(nodes)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
