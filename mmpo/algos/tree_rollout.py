"""The frontier loop shared by tree rollouts: TreePO's segment trees (:mod:`mmpo.algos.treepo`) and DIALTREE-RPO's
dialogue trees (:mod:`mmpo.algos.dialtree`).

A node is any object with a ``done`` attribute (a leaf). At each depth every group's active nodes get a number of
children (``fork``: TreePO's width budget, DIALTREE's fixed branching), all children of the step are grown in one
batch (``expand``: a segment of tokens, or a model turn and the target's answer), and ``prune`` may drop or stop
children (DIALTREE's quality-aware pruning and width cap). The loop ends when no node is active or at ``max_depth``;
it returns every node left: the leaves, and the active nodes of the last depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar


class TreeNode(Protocol):
    done: bool


NodeT = TypeVar("NodeT", bound=Any)


def grow_frontier(
    roots: Sequence[NodeT],
    *,
    group_of: Callable[[NodeT], int],
    fork: Callable[[list[NodeT], int, int], list[int]],
    expand: Callable[[list[tuple[NodeT, int]]], list[NodeT]],
    max_depth: int,
    prune: Callable[[list[NodeT]], list[NodeT]] | None = None,
) -> list[NodeT]:
    """Grow trees from ``roots`` (depth 1) to at most ``max_depth``.

    Args:
        group_of: the tree (prompt / goal) a node belongs to.
        fork: ``(active nodes of a group, its finished nodes, those finished at the last depth) -> children per
            active node``.
        expand: ``[(parent, child index)] -> children`` (one per pair, in order).
        prune: ``children of this depth -> the ones kept`` (None: all).
    """
    nodes = list(roots)
    finished_now: dict[int, int] = {}
    for node in nodes:
        finished_now[group_of(node)] = finished_now.get(group_of(node), 0) + int(node.done)
    for _depth in range(1, max_depth):
        parents: list[tuple[NodeT, int]] = []
        for group in sorted({group_of(n) for n in nodes}):
            members = [n for n in nodes if group_of(n) == group]
            active = [n for n in members if not n.done]
            if not active:
                continue
            finished = sum(n.done for n in members)
            for node, count in zip(active, fork(active, finished, finished_now.get(group, 0))):
                parents += [(node, child) for child in range(count)]
        if not parents:
            break
        grown = expand(parents)
        if prune is not None:
            grown = prune(grown)
        finished_now = {}
        for node in grown:
            finished_now[group_of(node)] = finished_now.get(group_of(node), 0) + int(node.done)
        nodes = [n for n in nodes if n.done] + grown
    return nodes


__all__ = ["TreeNode", "grow_frontier"]
