"""Verification of drafted tokens against the target: pure functions of tensors and an explicit generator.

Design decisions:
- Every verifier takes the target's distributions at the verified positions (logits for greedy, warped
  probabilities for sampling), the draft (a chain of tokens or a :class:`~serving.tree.DraftTree`), the draft
  probabilities when the drafter has them, and a ``torch.Generator``; it returns a :class:`VerifyResult`. No
  global RNG, no module state, no model calls: the loop around them only moves data.
- Greedy: accept the longest draft prefix equal to the target's argmax, then the argmax after it (the bonus).
  In a tree, node ``v`` is *correct* when its token is the argmax at its parent; the accepted path is the deepest
  node whose ancestors are all correct, found with one masked reduction over the ancestor mask (no Python walk).
- Sampling, chain: the standard speculative rejection rule (Leviathan et al. 2023, Chen et al. 2023). Draft
  token ``x`` drawn from ``q`` is accepted with probability ``min(1, p(x)/q(x))`` (tested as ``u*q(x) < p(x)``);
  at the first rejection the replacement is drawn from ``norm(max(0, p - q))``; after full acceptance the bonus
  is drawn from the next ``p``. The output distribution is exactly ``p``. All uniforms are drawn in one call
  and the accepted length is a cumulative product, so there is no per-candidate host synchronisation.
- A drafter that gives only tokens (prompt lookup, EAGLE-2's deterministic top-k tree) is a point-mass proposal:
  ``q = one_hot(x)``, so ``x`` is accepted with probability ``p(x)`` and the residual is ``p`` with ``x`` removed.
- Sampling, tree: recursive rejection over siblings (SpecInfer / EAGLE): at the current node the children are
  tried in order; each rejected child's proposal mass is removed from the residual
  (``p <- norm(max(0, p - q_child))``) before the next child is tried; an accepted child becomes the current
  node with a fresh ``p``; when no child is accepted (or at a leaf) the last token is drawn from the residual.
  Each child's ``q`` must be the distribution it was actually drawn from given its earlier siblings (for
  deterministic candidates: a point mass), which is what makes the walk lossless. Uniforms are indexed by node
  (``u[v - 1]``), so a chain-shaped tree consumes the generator exactly like chain verification and gives the
  same tokens. Host synchronisation happens once per depth (to learn which child was taken), never per sibling.
- Temperature and top-p are applied by :func:`warp_probs` to target and draft logits alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.serving.tree import DraftTree


@dataclass
class SamplingConfig:
    """How tokens are chosen from the target's distribution."""

    temperature: float = 0.0
    """0 = greedy (argmax; speculative output equals the target's greedy output token for token)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; applied to target and draft distributions alike."""
    seed: int = 0
    """Seed of the generator every random number of a generation comes from."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class VerifyResult:
    """What one verification step decided."""

    tokens: torch.Tensor  # [a + 1] the accepted draft tokens, then the bonus token drawn from the target
    path: (
        torch.Tensor
    )  # [a + 1] indices (into the verified input) of the committed tokens: root, accepted nodes
    num_accepted: int  # a = accepted draft tokens (the bonus token is not counted)


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) truncation; logits [..., V] -> probs [..., V] fp32."""
    if temperature <= 0:
        raise ValueError("warp_probs needs temperature > 0; greedy decoding uses the argmax")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (a token is kept if the mass before it is < top_p)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from ``probs`` [V] (a [1] int64 tensor)."""
    return torch.multinomial(probs, 1, generator=generator)


def residual(p: torch.Tensor, token: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """``norm(max(0, p - q))`` after rejecting ``token``; ``q = None`` is the point mass on ``token``.

    If nothing is left (p == q up to rounding, so a rejection had probability ~0) the residual falls back to ``p``.
    """
    left = p.scatter(-1, token.reshape(1), 0.0) if q is None else (p - q).clamp(min=0)
    mass = left.sum()
    return torch.where(mass > 0, left / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


# -- chains ------------------------------------------------------------------------------------------------------
def verify_chain_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """target_logits: [K+1, V] at the pending token and each draft; draft_tokens: [K]."""
    best = target_logits.argmax(-1)  # [K+1]
    k = draft_tokens.numel()
    a = int((draft_tokens == best[:k]).long().cumprod(0).sum()) if k else 0
    return VerifyResult(tokens=best[: a + 1], path=torch.arange(a + 1, device=best.device), num_accepted=a)


def verify_chain_sampling(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> VerifyResult:
    """target_probs: [K+1, V] (warped); draft_tokens: [K]; draft_probs: [K, V] each draft's proposal
    distribution (None: point masses)."""
    k = draft_tokens.numel()
    dev = target_probs.device
    u = torch.rand(k, generator=generator, device=dev)
    p_x = target_probs[:k].gather(1, draft_tokens[:, None]).squeeze(1)  # [K]
    q_x = (
        torch.ones_like(p_x)
        if draft_probs is None
        else draft_probs.gather(1, draft_tokens[:, None]).squeeze(1)
    )
    a = (u * q_x < p_x).long().cumprod(0).sum()  # accepted prefix length, still on device
    at = a.clamp(max=max(k - 1, 0))
    if k:
        fix = residual(target_probs[a], draft_tokens[at], None if draft_probs is None else draft_probs[at])
        last = torch.where(a < k, fix, target_probs[a])
    else:
        last = target_probs[0]
    n = int(a)
    tokens = torch.cat([draft_tokens[:n], sample(last, generator)])
    return VerifyResult(tokens=tokens, path=torch.arange(n + 1, device=dev), num_accepted=n)


# -- trees -------------------------------------------------------------------------------------------------------
def verify_tree_greedy(target_logits: torch.Tensor, tree: DraftTree) -> VerifyResult:
    """target_logits: [n, V] at every tree node (node 0 = root)."""
    best = target_logits.argmax(-1)  # [n]
    correct = tree.tokens == best[tree.parents.clamp(min=0)]
    correct[0] = True  # the root is already chosen
    on_path = ~(tree.mask & ~correct[None, :]).any(-1)  # every ancestor-or-self is correct
    end = torch.where(on_path, tree.depths, -1).argmax()  # deepest such node (first one on ties)
    path = tree.mask[end].nonzero().flatten()  # root ... end, in depth order
    tokens = torch.cat([tree.tokens[path[1:]], best[end].reshape(1)])
    return VerifyResult(tokens=tokens, path=path, num_accepted=path.numel() - 1)


def verify_tree_sampling(
    target_probs: torch.Tensor,
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> VerifyResult:
    """target_probs: [n, V] (warped) at every node; draft_probs: [n, V] row v = the distribution node v was
    drawn from given its earlier siblings (row 0 unused), or None: every node is a point-mass proposal."""
    u = torch.rand(tree.num_draft, generator=generator, device=target_probs.device)
    node, path, left = 0, [0], target_probs[0]
    while kids := tree.children[node]:
        accepted = []
        for child in kids:  # residual chain over siblings, all on device
            x = tree.tokens[child]
            q = None if draft_probs is None else draft_probs[child]
            q_x = 1.0 if q is None else q[x]
            accepted.append(u[child - 1] * q_x < left[x])
            left = torch.where(accepted[-1], left, residual(left, x, q))
        hit = torch.stack(accepted)
        first = int(hit.long().argmax())  # one host sync per depth
        if not bool(hit[first]):
            break  # all children rejected: `left` is the residual after all of them
        node = kids[first]
        path.append(node)
        left = target_probs[node]
    path_t = torch.tensor(path, device=target_probs.device)
    tokens = torch.cat([tree.tokens[path_t[1:]], sample(left, generator)])
    return VerifyResult(tokens=tokens, path=path_t, num_accepted=len(path) - 1)


def verify(
    target_logits: torch.Tensor,
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
    chain: bool,
) -> VerifyResult:
    """Dispatch: greedy or sampling, chain or tree. target_logits: [n, V] at the tree's nodes."""
    if chain and not tree.is_chain:
        raise ValueError("chain verification got a branching tree; use mode='tree'")
    if sampling.greedy:
        return (
            verify_chain_greedy(target_logits, tree.tokens[1:])
            if chain
            else verify_tree_greedy(target_logits, tree)
        )
    p = warp_probs(target_logits, sampling.temperature, sampling.top_p)
    if chain:
        q = None if draft_probs is None else draft_probs[1:]
        return verify_chain_sampling(p, tree.tokens[1:], q, generator)
    return verify_tree_sampling(p, tree, draft_probs, generator)
