"""Minimum cuts for the frontier walk: Dinic's maximum flow on a small residual network."""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger(__name__)


class _FlowNetwork:
    """Dinic's maximum flow on a small graph; edges ``2k`` and ``2k + 1`` are each other's
    reverse."""

    __slots__ = ("adj", "cap", "to")

    def __init__(self, num_nodes: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(num_nodes)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add_edge(self, u: int, v: int, capacity: float) -> int:
        edge = len(self.to)
        self.adj[u].append(edge)
        self.to.append(v)
        self.cap.append(capacity)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)
        return edge

    def max_flow(self, source: int, sink: int, tiny: float, limit: float) -> float:
        """Push flow until none is left (or ``limit`` is reached); residual capacities below
        ``tiny`` count as saturated."""
        adj, to, cap = self.adj, self.to, self.cap
        n = len(adj)
        flow = 0.0
        while flow < limit:
            level = [-1] * n
            level[source] = 0
            queue = deque([source])
            while queue:
                u = queue.popleft()
                for e in adj[u]:
                    v = to[e]
                    if level[v] < 0 and cap[e] > tiny:
                        level[v] = level[u] + 1
                        queue.append(v)
            if level[sink] < 0:
                break
            it = [0] * n
            while True:
                # One augmenting path along the level graph (iterative DFS).
                path: list[int] = []
                u = source
                while u != sink:
                    edges = adj[u]
                    i = it[u]
                    while i < len(edges):
                        e = edges[i]
                        v = to[e]
                        if cap[e] > tiny and level[v] == level[u] + 1:
                            break
                        i += 1
                    it[u] = i
                    if i == len(edges):
                        if not path:
                            break
                        level[u] = -1  # dead end
                        e = path.pop()
                        u = to[e ^ 1]
                        it[u] += 1
                        continue
                    path.append(edges[i])
                    u = to[edges[i]]
                if u != sink:
                    break
                push = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= push
                    cap[e ^ 1] += push
                flow += push
                if flow >= limit:
                    return flow
        return flow

    def reachable(self, source: int, tiny: float) -> list[bool]:
        seen = [False] * len(self.adj)
        seen[source] = True
        stack = [source]
        adj, to, cap = self.adj, self.to, self.cap
        while stack:
            u = stack.pop()
            for e in adj[u]:
                v = to[e]
                if not seen[v] and cap[e] > tiny:
                    seen[v] = True
                    stack.append(v)
        return seen
