"""Draft trees: the structure one verify forward checks, and EAGLE-2's dynamic tree construction.

Design decisions:
- A tree is a set of nodes in topological order: node 0 is the *root* (the pending token, already chosen by the
  target but not yet in its KV cache) and every later node is a draft token whose parent has a smaller index.
  A chain of K drafts is simply the tree with ``parents = [-1, 0, 1, ..., K-1]``; verification, masks and cache
  bookkeeping never special-case it.
- Everything the loop needs is derived once from ``(tokens, parents)``: ``depths`` (rope position of node i is
  ``context_len + depths[i]``), the ancestor-or-self ``mask`` [n, n] that becomes the tree part of the verify
  forward's 4-D attention mask, the ``children`` lists the sampling walk follows, and the retrieval ``paths``
  (one row per leaf, root first) that describe every candidate continuation.
- EAGLE-2 dynamic tree (Li et al. 2024): expand the top-k children of each frontier node, keep the ``topk``
  candidates of the next depth with the highest cumulative draft log-probability as the new frontier, repeat to
  ``depth``; then rerank *all* candidates by cumulative log-probability and keep ``total_tokens`` of them.
  Cumulative log-probabilities never increase along a path, and ties are broken towards shallower (earlier)
  candidates, so the kept set always contains every kept node's ancestors: the result is a valid tree.
- The builder is drafter-agnostic: it calls ``expand(tokens, parent_slots, depth)`` to obtain the children's
  log-probabilities of a frontier, and knows nothing of caches or masks of the drafter.
- Candidate tokens are chosen deterministically (top-k), never sampled; sampling verification therefore treats
  each tree node as a point-mass proposal, which keeps tree sampling exactly lossless (see ``serving.verify``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TreeConfig:
    """Shape of an EAGLE-2 dynamic draft tree."""

    topk: int = 4
    """Children expanded per frontier node, and frontier nodes kept per depth."""
    depth: int = 5
    """Maximum draft depth (the longest candidate continuation, in tokens)."""
    total_tokens: int = 24
    """Draft tokens kept after the final rerank (the root, i.e. the pending token, is not counted)."""

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ValueError(f"tree topk must be >= 1, got {self.topk}")
        if self.depth < 1:
            raise ValueError(f"tree depth must be >= 1, got {self.depth}")
        if self.total_tokens < 1:
            raise ValueError(f"tree total_tokens must be >= 1, got {self.total_tokens}")

    @property
    def num_candidates(self) -> int:
        """Candidates the builder scores: ``topk`` at depth 1 and ``topk**2`` at every later depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk


@dataclass
class DraftTree:
    """A verified-in-one-forward set of candidate continuations; node 0 is the root (pending token)."""

    tokens: torch.Tensor  # [n] int64 target token ids
    parents: torch.Tensor  # [n] int64, parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # [n] int64, depths[0] = 0
    mask: torch.Tensor  # [n, n] bool, mask[i, j] = j is i or an ancestor of i
    children: list[list[int]]  # children[i]: node ids in sibling order (the order sampling tries them)

    @property
    def size(self) -> int:
        """Nodes including the root."""
        return int(self.tokens.numel())

    @property
    def num_draft(self) -> int:
        return self.size - 1

    @property
    def max_depth(self) -> int:
        return len(self.levels) - 1

    @property
    def levels(self) -> list[int]:
        """Node count per depth (index 0: the root)."""
        return torch.bincount(self.depths).tolist()

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    @property
    def paths(self) -> torch.Tensor:
        """Retrieval paths: [num_leaves, max_depth + 1] node ids from the root to each leaf, padded with -1."""
        leaves = [i for i, c in enumerate(self.children) if not c]
        out = torch.full((len(leaves), self.max_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            nodes = self.mask[leaf].nonzero().flatten()  # ancestors-or-self, in depth order (topological ids)
            out[row, : nodes.numel()] = nodes.cpu()
        return out

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
        """Derive depths, the ancestor mask and children from topologically ordered ``(tokens, parents)``."""
        tokens = tokens.reshape(-1).long()
        parents = parents.reshape(-1).long().to(tokens.device)
        n = tokens.numel()
        if n < 1 or parents.numel() != n:
            raise ValueError(
                f"a tree needs a root and one parent per node ({n} tokens, {parents.numel()} parents)"
            )
        idx = torch.arange(n, device=tokens.device)
        if int(parents[0]) != -1 or bool((parents[1:] < 0).any()) or bool((parents[1:] >= idx[1:]).any()):
            raise ValueError(
                "tree parents must be -1 for node 0 and point to an earlier node for every other node"
            )
        mask = torch.eye(n, dtype=torch.bool, device=tokens.device)
        depths = torch.zeros(n, dtype=torch.long, device=tokens.device)
        anc = parents.clone()
        # walk every node's ancestor chain one generation at a time (depth iterations, not n)
        while bool((anc >= 0).any()):
            live = anc >= 0
            mask[idx[live], anc[live]] = True
            depths += live.long()
            anc = torch.where(live, parents[anc.clamp(min=0)], anc)
        children: list[list[int]] = [[] for _ in range(n)]
        for child, parent in enumerate(parents.tolist()[1:], start=1):
            children[parent].append(child)
        return cls(tokens=tokens, parents=parents, depths=depths, mask=mask, children=children)


def chain_tree(root_token: torch.Tensor, draft_tokens: torch.Tensor) -> DraftTree:
    """The tree of width 1: root, then ``draft_tokens`` each the child of the previous one."""
    tokens = torch.cat([root_token.reshape(1).long(), draft_tokens.reshape(-1).long().to(root_token.device)])
    n = tokens.numel()
    parents = torch.arange(-1, n - 1, device=tokens.device)
    depths = torch.arange(n, device=tokens.device)
    mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    children = [[i + 1] for i in range(n - 1)] + [[]]
    return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=mask, children=children)


Expand = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``expand(tokens [k], parent_slots [k], depth) -> logprobs [k, draft_vocab]``: run the drafter on a frontier of
``k`` nodes at ``depth`` (1-based) whose parents are the previous frontier's entries ``parent_slots`` (all 0 at
depth 1, where the parent is the root), and return each node's children's log-probabilities."""


def build_dynamic_tree(
    root_token: torch.Tensor,
    root_logprobs: torch.Tensor,
    expand: Expand,
    cfg: TreeConfig,
    draft_to_target: torch.Tensor | None = None,
) -> DraftTree:
    """EAGLE-2 dynamic tree (see the module docstring).

    root_token: [] the pending token. root_logprobs: [draft_vocab] log-probabilities of the root's children.
    draft_to_target: [draft_vocab] target id of each draft id (None: identical vocabularies).
    """
    k = min(cfg.topk, root_logprobs.numel())
    to_target = (lambda d: d) if draft_to_target is None else (lambda d: draft_to_target[d])
    frontier_scores, frontier_ids = root_logprobs.float().topk(k)  # [k]
    cand_scores, cand_ids = [frontier_scores], [frontier_ids]
    cand_parent = [
        torch.full((k,), -1, dtype=torch.long, device=frontier_ids.device)
    ]  # candidate id; -1 = root
    frontier = torch.arange(k, device=frontier_ids.device)  # candidate ids of the current frontier
    parent_slot = torch.zeros(k, dtype=torch.long, device=frontier_ids.device)
    offset = k
    for depth in range(1, cfg.depth):
        logprobs = expand(to_target(frontier_ids), parent_slot, depth)  # [k, Vd]
        child_scores, child_ids = logprobs.float().topk(k, dim=-1)  # [k, k]
        total = (frontier_scores[:, None] + child_scores).flatten()  # [k * k] cumulative log-probs
        cand_scores.append(total)
        cand_ids.append(child_ids.flatten())
        cand_parent.append(frontier.repeat_interleave(k))
        best = total.topk(k).indices  # the next frontier, among this depth's k * k candidates
        frontier, frontier_scores, frontier_ids = offset + best, total[best], cand_ids[-1][best]
        parent_slot = best // k
        offset += k * k

    scores = torch.cat(cand_scores)
    order = torch.sort(scores, descending=True, stable=True).indices  # ties: earlier (shallower) first
    keep = order[: cfg.total_tokens].sort().values  # topological again: parents before children
    new_id = torch.full_like(scores, -1, dtype=torch.long)
    new_id[keep] = torch.arange(1, keep.numel() + 1, device=keep.device)
    parent_cand = torch.cat(cand_parent)[keep]
    parents = torch.where(parent_cand < 0, 0, new_id[parent_cand.clamp(min=0)])
    tokens = torch.cat([root_token.reshape(1).long(), to_target(torch.cat(cand_ids)[keep])])
    return DraftTree.from_parents(tokens, torch.cat([parents.new_tensor([-1]), parents]))
