"""Drafters behind one interface: ``reset`` / ``propose`` / ``accept`` (cf. transformers' candidate generators).

Design decisions:
- The loop sees only :class:`Proposer`. :class:`Eagle3Proposer`, :class:`PromptLookupProposer` and
  :class:`NoProposer` (plain decoding) run on identical code paths, so eval compares drafters, not loops.
- Every proposal is a :class:`~serving.tree.DraftTree` whose root is the pending token (a chain is a tree of
  width 1), plus the draft distributions ``q`` when the drafter sampled from one (``None``: point masses).
- The EAGLE-3 proposer follows the row conventions of ``serving.drafter``: context row ``r`` = (``fc(aux_r)``,
  embedding of ``x_{r+1}``) at position ``r``. Its cache is static and position-indexed like the target's, and
  its committed length always equals the target's: after a verify step, :meth:`Eagle3Proposer.accept` writes
  the context rows of the newly committed tokens (their aux states come from the verify forward; the token of
  the last row is the new pending token) over whatever draft rows occupied those slots. The last row's output
  is the first draft distribution of the next step, so a step costs one context forward plus one drafter
  forward per further draft depth. Draft rows live at slots past the committed length and are never kept.
- A parallel-drafting drafter (P-EAGLE, ``DrafterConfig.parallel_drafting``) appends its K - 1 mask rows to the
  context forward of :meth:`Eagle3Proposer.accept` (written past the committed length, never kept, as vLLM does),
  so its K draft distributions come out of that one forward and :meth:`Eagle3Proposer.propose` runs no drafter
  at all. It drafts chains only (a tree needs each depth to condition on the draft before it).
- Chain drafts are sampled from ``q = warp(draft logits)`` when sampling (so the rejection rule is lossless with
  the real ``q``) and are the argmax when greedy. Trees are EAGLE-2 dynamic trees built from the draft
  log-probabilities (deterministic top-k, verified as point masses).
- Prompt lookup proposes the continuation of the most recent earlier occurrence of the context's last n-gram
  (longest n first), found with one vectorised comparison per n.
- A DFlash block drafter (:class:`DFlashProposer`, ``serving.models.dflash``) keeps each layer's context keys and
  values of the committed tokens in static position-indexed buffers (written in :meth:`DFlashProposer.accept`
  from the verify forward's aux states, the pending token excluded, as vLLM feeds it) and drafts a chain of K
  tokens with one forward of the block ``[pending, mask x K]``; the block is never cached, so nothing rolls back.
  It always runs K masks, as vLLM does, and truncates the chain where fewer drafts fit.
- A drafter built for another target is rejected in ``reset`` (before any model runs) with the mismatch named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from eyas.serving.models.dflash import DFlashDrafter
from eyas.serving.models.drafter import Eagle3Drafter
from eyas.serving.models.kv_cache import SlotCache
from eyas.serving.models.target import TargetInfo
from eyas.serving.tree import DraftTree, TreeConfig, build_dynamic_tree, chain_tree
from eyas.serving.verify import SamplingConfig, VerifyResult, sample, warp_probs

Mode = Literal["chain", "tree"]


@dataclass
class DraftContext:
    """What a proposer may read when drafting one step."""

    tokens: torch.Tensor  # [L + 1] prompt and generated tokens; tokens[L] is the pending token (root)
    length: int  # L = tokens committed in the target's KV cache (the pending token's position)
    sampling: SamplingConfig
    generator: torch.Generator
    mode: Mode
    max_depth: int  # no draft path may be longer (tokens still wanted, cache room)
    max_tokens: int  # no more draft tokens in total (cache room)


@dataclass
class DraftProposal:
    """One step's draft: a tree rooted at the pending token, and the draft distributions when sampled."""

    tree: DraftTree
    draft_probs: torch.Tensor | None = None  # [n, V] row v: distribution node v was drawn from (row 0 unused)


@dataclass
class AcceptedTokens:
    """Tokens the target just committed to its cache, with what the drafter needs to follow."""

    start: int  # position of tokens[0]
    tokens: torch.Tensor  # [m] committed tokens at positions start .. start + m - 1
    next_token: torch.Tensor  # [1] the new pending token (the bonus token, or the prompt's first output)
    aux: torch.Tensor  # [m, n_aux * H] the target's aux hidden states at those positions
    verify: VerifyResult | None = None  # None for the prompt (prefill)


class Proposer(Protocol):
    """The drafting seam between the loop and any drafter."""

    name: str

    def reset(self, prompt_ids: torch.Tensor, *, target: TargetInfo, max_len: int) -> None:
        """Start a new sequence (``prompt_ids`` [P]); raise if this drafter cannot serve ``target``."""

    def propose(self, ctx: DraftContext) -> DraftProposal:
        """Draft the next step."""

    def accept(self, accepted: AcceptedTokens) -> None:
        """Follow the target: called after prefill and after every verify step."""


class NoProposer:
    """Plain decoding: an empty draft, so every step is one target forward of the pending token."""

    name = "none"

    def reset(self, prompt_ids: torch.Tensor, *, target: TargetInfo, max_len: int) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftProposal:
        return DraftProposal(chain_tree(ctx.tokens[ctx.length], ctx.tokens[:0]))

    def accept(self, accepted: AcceptedTokens) -> None:
        pass


def check_drafter_target(c, info: TargetInfo, family: str) -> None:
    """Raise a ValueError naming every way a drafter of config ``c`` (either family's: sizes, vocabulary, the aux
    layers it reads) does not fit the target ``info`` describes."""
    problems = []
    if c.hidden_size != info.hidden_size:
        problems.append(f"hidden size {c.hidden_size} vs the target's {info.hidden_size}")
    if c.target_hidden_size != info.hidden_size:
        problems.append(f"aux state width {c.target_hidden_size} vs the target's {info.hidden_size}")
    if c.vocab_size != info.vocab_size:
        problems.append(f"vocabulary {c.vocab_size} vs the target's {info.vocab_size}")
    if list(c.aux_layer_ids) != list(info.aux_layers):
        problems.append(f"aux layers {list(c.aux_layer_ids)} vs the target's {list(info.aux_layers)}")
    if problems:
        raise ValueError(
            f"this {family} drafter was built for another target than {info.name}: "
            + "; ".join(problems)
            + ". Use a drafter trained for this target, or load the target with the drafter's aux layers "
            "(TargetConfig.aux_layers)."
        )


@dataclass
class PromptLookupConfig:
    """Prompt lookup (n-gram match against the context)."""

    max_ngram: int = 3
    """Longest suffix n-gram searched for first."""
    min_ngram: int = 1
    """Shortest suffix n-gram tried before giving up (empty draft)."""
    num_tokens: int = 8
    """Draft length: tokens copied after the match."""

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"prompt lookup num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


class PromptLookupProposer:
    """Copy what followed the last occurrence of the context's suffix n-gram (a chain; q = point masses)."""

    name = "prompt-lookup"

    def __init__(self, cfg: PromptLookupConfig | None = None, **kw):
        self.cfg = cfg or PromptLookupConfig(**kw)

    def reset(self, prompt_ids: torch.Tensor, *, target: TargetInfo, max_len: int) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftProposal:
        seq = ctx.tokens
        k = min(self.cfg.num_tokens, ctx.max_depth, ctx.max_tokens)
        draft = seq[:0]
        for n in range(min(self.cfg.max_ngram, seq.numel() - 1), self.cfg.min_ngram - 1, -1):
            if k <= 0:
                break
            windows = seq[:-1].unfold(0, n, 1)  # [L + 1 - n, n]: every n-gram ending before the suffix's end
            starts = (windows == seq[-n:]).all(
                -1
            ).nonzero().flatten() + n  # where each match's continuation starts
            if starts.numel():
                full = starts[starts + k <= seq.numel()]
                # the most recent match that has k tokens after it, else the earliest (the longest continuation)
                s = int(full[-1]) if full.numel() else int(starts[0])
                draft = seq[s : s + k]
                break
        return DraftProposal(chain_tree(seq[ctx.length], draft))

    def accept(self, accepted: AcceptedTokens) -> None:
        pass


@dataclass
class Eagle3ProposerConfig:
    """How the EAGLE-3 drafter drafts."""

    chain_length: int = 4
    """Draft tokens per step in chain mode (K)."""
    tree: TreeConfig | None = None
    """EAGLE-2 dynamic tree used in tree mode (default :class:`TreeConfig`)."""
    attention_window: int | None = None
    """The drafter's attention window while drafting: None its own (``DrafterConfig.attention_window``), 0 full
    attention, n > 0 a sliding window of n tokens; the weights are shared, so one drafter serves several windows."""

    def __post_init__(self) -> None:
        if self.chain_length <= 0:
            raise ValueError(f"chain_length (K) must be >= 1, got {self.chain_length}")
        if self.attention_window is not None and self.attention_window < 0:
            raise ValueError(
                f"attention_window must be None (the drafter's own), 0 (full attention) or a positive token "
                f"count, not {self.attention_window}"
            )
        if self.tree is None:
            self.tree = TreeConfig()


class Eagle3Proposer:
    """The EAGLE-3 drafter as a proposer (see the module docstring for its cache rows)."""

    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, cfg: Eagle3ProposerConfig | None = None, **kw):
        self.drafter = drafter.eval()
        self.cfg = cfg or Eagle3ProposerConfig(**kw)
        self.cache: SlotCache | None = None
        self._hidden: torch.Tensor | None = None  # [1, 1, H] output of the last context row
        self._logits: torch.Tensor | None = None  # [draft_vocab] its logits: the first draft distribution
        self._parallel: torch.Tensor | None = None  # [K, draft_vocab] a parallel drafter's K draft logits
        # [draft_vocab] target id of each draft id (re-read in reset: the vocab map may be installed later)
        self._to_target = drafter.draft_to_target

    # -- setup ------------------------------------------------------------------------------------------------
    def check_target(self, info: TargetInfo) -> None:
        """Raise a ValueError naming every way this drafter does not fit ``info``."""
        check_drafter_target(self.drafter.config, info, "EAGLE-3")

    def reset(self, prompt_ids: torch.Tensor, *, target: TargetInfo, max_len: int) -> None:
        self.check_target(target)
        tree = self.cfg.tree
        room = max(self.cfg.chain_length, tree.depth * tree.topk) + 1
        if self.cache is None or self.cache.max_len < max_len + room:
            self.cache = self.drafter.new_cache(max_len + room)
        self.cache.reset()
        self._hidden = self._logits = self._parallel = None
        self._to_target = self.drafter.draft_to_target

    # -- following the target ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def accept(self, accepted: AcceptedTokens) -> None:
        cache = self.cache
        start, m = accepted.start, accepted.tokens.numel()
        if cache.length != start:
            raise RuntimeError(
                f"drafter cache holds {cache.length} rows but the target committed from {start}"
            )
        dev = self.drafter.fc.weight.device
        ids = torch.cat([accepted.tokens[1:], accepted.next_token.reshape(1)]).to(dev)  # x_{r+1} for row r
        aux = accepted.aux.to(dev)
        n = m  # rows in this forward: the context, then a parallel drafter's mask rows
        if self.drafter.config.parallel_drafting:
            mask_ids, mask_aux = self.drafter.mask_rows(self.cfg.chain_length - 1)
            ids, aux = torch.cat([ids, mask_ids]), torch.cat([aux, mask_aux.to(aux.dtype)])
            n += mask_ids.numel()
        pos = torch.arange(start, start + n, device=dev)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(diagonal=start)  # causal over rows
        cache.prepare(pos, start + n)
        out = self.drafter(
            ids[None],
            aux[None],
            pos[None],
            cache,
            mask[None, None],
            hidden_is_aux=True,
            logits="last" if n == m else "all",
            attention_window=self.cfg.attention_window,
        )
        cache.commit(m)  # the mask rows' slots are overwritten by the next context
        self._hidden = out.hidden[:, m - 1 : m]
        self._logits = out.logits[0, -1 if n == m else m - 1]
        self._parallel = out.logits[0, m - 1 :] if n > m else None

    # -- drafting ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        if self._logits is None or self.cache.length != ctx.length:
            raise RuntimeError("Eagle3Proposer.propose before accept() of the committed context")
        if ctx.mode == "tree":
            if self._parallel is not None:
                raise ValueError(
                    "a parallel-drafting (P-EAGLE) drafter drafts chains only; use mode=chain or an "
                    "autoregressive EAGLE-3 drafter for trees"
                )
            return self._propose_tree(ctx)
        return self._propose_chain(ctx)

    def _row(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        position: int,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ):
        """One drafter forward of draft rows: tokens [k] (target ids), hidden [1, k, H], mask [k, kv_len]."""
        k = tokens.numel()
        self.cache.prepare(slots, mask.shape[-1])
        pos = torch.full((1, k), position, dtype=torch.long, device=tokens.device)
        return self.drafter(
            tokens[None],
            hidden,
            pos,
            self.cache,
            mask[None, None],
            hidden_is_aux=False,
            attention_window=self.cfg.attention_window,
        )

    def _propose_chain(self, ctx: DraftContext) -> DraftProposal:
        k = min(self.cfg.chain_length, ctx.max_depth, ctx.max_tokens)
        length, dev = ctx.length, self._logits.device
        hidden, logits = self._hidden, self._logits
        draft_ids, qs = [], []
        for j in range(k):
            if ctx.sampling.greedy:
                d = logits.argmax(-1, keepdim=True)
            else:
                q = warp_probs(logits, ctx.sampling.temperature, ctx.sampling.top_p)  # [draft_vocab]
                d = sample(q, ctx.generator)
                qs.append(q)
            draft_ids.append(d)
            if j == k - 1:
                break
            if self._parallel is not None:  # P-EAGLE: depth j + 1 was drafted in accept's forward
                logits = self._parallel[j + 1]
                continue
            # draft row j + 1 sits at position L + j: hidden = previous row's output, token = this draft
            slot = torch.tensor([length + j], device=dev)
            mask = torch.ones(1, length + j + 1, dtype=torch.bool, device=dev)
            out = self._row(self._to_target[d], hidden, length + j, slot, mask)
            hidden, logits = out.hidden, out.logits[0, -1]
        draft = self._to_target[torch.cat(draft_ids)] if draft_ids else ctx.tokens[:0]
        tree = chain_tree(ctx.tokens[length], draft)
        if not qs:
            return DraftProposal(tree)
        probs = torch.zeros(k + 1, self.drafter.config.vocab_size, device=dev)
        probs[1:, self._to_target] = torch.stack(qs)  # draft vocabulary -> target vocabulary
        return DraftProposal(tree, probs)

    def _propose_tree(self, ctx: DraftContext) -> DraftProposal:
        base = self.cfg.tree
        if min(ctx.max_depth, ctx.max_tokens) <= 0:
            return DraftProposal(chain_tree(ctx.tokens[ctx.length], ctx.tokens[:0]))
        cfg = TreeConfig(base.topk, min(base.depth, ctx.max_depth), min(base.total_tokens, ctx.max_tokens))
        length, dev = ctx.length, self._logits.device
        frontier: dict[str, torch.Tensor] = {}

        def expand(tokens: torch.Tensor, parent_slot: torch.Tensor, depth: int) -> torch.Tensor:
            k = tokens.numel()
            eye = torch.eye(k, dtype=torch.bool, device=dev)
            if depth == 1:  # children of the root: all read the last context row's output
                hidden, draft_mask = self._hidden.expand(1, k, -1), eye
            else:
                hidden = frontier["hidden"][:, parent_slot]
                draft_mask = torch.cat([frontier["mask"][parent_slot], eye], dim=1)  # [k, depth * k]
            mask = torch.cat([torch.ones(k, length, dtype=torch.bool, device=dev), draft_mask], dim=1)
            slots = length + (depth - 1) * k + torch.arange(k, device=dev)
            out = self._row(tokens, hidden, length + depth - 1, slots, mask)
            frontier["hidden"], frontier["mask"] = out.hidden, draft_mask
            return torch.log_softmax(out.logits[0], dim=-1)

        root_logprobs = torch.log_softmax(self._logits, dim=-1)
        tree = build_dynamic_tree(ctx.tokens[length], root_logprobs, expand, cfg, self._to_target)
        return DraftProposal(tree)


@dataclass
class DFlashProposerConfig:
    """How the DFlash block drafter drafts."""

    chain_length: int = 6
    """Mask slots per block, i.e. draft tokens per step (K; vLLM's ``num_speculative_tokens``)."""

    def __post_init__(self) -> None:
        if self.chain_length <= 0:
            raise ValueError(f"chain_length (K) must be >= 1, got {self.chain_length}")


class DFlashProposer:
    """The DFlash block drafter as a proposer (see the module docstring): one drafter forward per step."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, cfg: DFlashProposerConfig | None = None, **kw):
        self.drafter = drafter.eval()
        self.cfg = cfg or DFlashProposerConfig(**kw)
        self._k: list[torch.Tensor] = []  # per layer [1, kv, max_len, d]: context keys by position
        self._v: list[torch.Tensor] = []
        self.length = 0  # committed positions whose context keys are written
        self._to_target = drafter.draft_to_target

    def check_target(self, info: TargetInfo) -> None:
        """Raise a ValueError naming every way this drafter does not fit ``info``."""
        check_drafter_target(self.drafter.config, info, "DFlash")

    def reset(self, prompt_ids: torch.Tensor, *, target: TargetInfo, max_len: int) -> None:
        self.check_target(target)
        c, w = self.drafter.config, self.drafter.fc.weight
        if not self._k or self._k[0].shape[2] < max_len:
            shape = (1, c.num_key_value_heads, max_len, c.head_dim)
            self._k = [w.new_zeros(shape) for _ in range(c.num_hidden_layers)]
            self._v = [w.new_zeros(shape) for _ in range(c.num_hidden_layers)]
        self.length = 0
        self._to_target = self.drafter.draft_to_target

    @torch.inference_mode()
    def accept(self, accepted: AcceptedTokens) -> None:
        start, m = accepted.start, accepted.tokens.numel()
        if self.length != start:
            raise RuntimeError(
                f"DFlash context holds {self.length} positions but the target committed from {start}"
            )
        dev = self.drafter.fc.weight.device
        pos = torch.arange(start, start + m, device=dev)
        for buf_k, buf_v, (k, v) in zip(
            self._k, self._v, self.drafter.context_kv(accepted.aux.to(dev)[None], pos[None])
        ):
            buf_k[:, :, start : start + m] = k
            buf_v[:, :, start : start + m] = v
        self.length = start + m

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        if self.length != ctx.length:
            raise RuntimeError("DFlashProposer.propose before accept() of the committed context")
        if ctx.mode == "tree":
            raise ValueError("a DFlash block drafter drafts chains only; use mode=chain")
        length = ctx.length
        k = min(self.cfg.chain_length, ctx.max_depth, ctx.max_tokens)
        root = ctx.tokens[length]
        if k <= 0:
            return DraftProposal(chain_tree(root, ctx.tokens[:0]))
        context = [(kk[:, :, :length], vv[:, :, :length]) for kk, vv in zip(self._k, self._v)]
        dev = self.drafter.fc.weight.device
        logits = self.drafter.draft_block(root.to(dev), length, context, self.cfg.chain_length)[:k]  # [k, Vd]
        if ctx.sampling.greedy:
            draft = self._to_target[logits.argmax(-1)]
            return DraftProposal(chain_tree(root, draft))
        q = warp_probs(logits, ctx.sampling.temperature, ctx.sampling.top_p)  # [k, Vd]
        d = torch.stack([sample(q[j], ctx.generator).reshape(()) for j in range(k)])
        probs = torch.zeros(k + 1, self.drafter.config.vocab_size, device=dev)
        probs[1:, self._to_target] = q
        return DraftProposal(chain_tree(root, self._to_target[d]), probs)
