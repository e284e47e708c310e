"""The exactness probe: do a target's multi-token verify forwards give the logits one-token decoding gives?

Design decisions:
- The probe drives the speculative loop's own ``prefill``/``tree_forward``/``commit``, so it lives beside the loop
  rather than in the model layer (:mod:`eyas.serving.models.exact_attention` only provides the attention mode).
- Bitwise equality, not a tolerance: a verify row that differs in its last bit can flip a greedy argmax.
"""

from __future__ import annotations

import torch

from eyas.serving.loop import commit, prefill, tree_forward
from eyas.serving.tree import chain_tree


@torch.inference_mode()
def probe(target, sizes=(2, 8), contexts=(37, 300), seed: int = 0) -> str | None:
    """None when ``target``'s verify forwards of each of ``sizes`` tokens give logits bitwise equal to one-token
    forwards at the same positions (after prompts of each length in ``contexts``); else what differed."""
    gen = torch.Generator().manual_seed(seed)
    dev, top = target.device, max(sizes)
    vocab = target.vocab_size
    for ctx in contexts:
        ids = torch.randint(0, vocab, (ctx + top,), generator=gen).to(dev)
        cache = target.new_cache(ctx + top + 1)
        prefill(target, cache, ids[:ctx])
        one = []
        for i in range(top):
            one.append(tree_forward(target, cache, chain_tree(ids[ctx + i], ids[:0])).logits[0, 0])
            commit(cache, torch.zeros(1, dtype=torch.long, device=dev))
        for n in sizes:
            cache = target.new_cache(ctx + top + 1)
            prefill(target, cache, ids[:ctx])
            rows = tree_forward(target, cache, chain_tree(ids[ctx], ids[ctx + 1 : ctx + n])).logits[0]
            for r in range(n):
                if not torch.equal(rows[r], one[r]):
                    diff = (rows[r].float() - one[r].float()).abs().max().item()
                    return (
                        f"a {n}-token verify forward after {ctx} tokens differs from one-token decoding at row {r} "
                        f"(max |logit difference| {diff:.3g})"
                    )
    return None
