"""The speculative serving loop: draft, verify in one target forward, keep the accepted path, repeat.

Design decisions:
- State between steps is two static caches and a pending token: the target's :class:`SlotCache` holds the
  committed tokens ``[0, L)``; the *pending* token (the last token the target chose) is not yet in it. A step
  feeds the pending token and the draft tree in ONE target forward at slots ``L .. L+n-1`` with positions
  ``L + depth`` and a 4-D mask (the whole prefix plus the tree's ancestor-or-self mask), with logits computed
  only at those ``n`` positions. Verification picks a path; ``SlotCache.keep`` gathers that path's entries to
  ``[L, L + a + 1)`` and ``length`` advances; everything else written is simply never read again.
- The loop never looks inside a drafter: it calls ``propose`` / ``accept`` of a :class:`Proposer` and hands the
  drafter the committed tokens with their aux hidden states from the same verify forward.
- Greedy and sampling share the loop; only :func:`serving.verify.verify` differs. All randomness comes from one
  ``torch.Generator`` seeded by :class:`SamplingConfig`, so a run is reproducible.
- Each step records draft time (propose + the drafter's accept), verify time (target forward, verification,
  cache keep), context length and draft/accept counts, from which eval derives tau, acceptance per draft
  position and tokens/s. Timing uses ``time.perf_counter`` after ``torch.cuda.synchronize`` on CUDA.
- Bad input (empty or over-long prompt, ids outside the vocabulary, a drafter built for another target) fails
  with a clear error before any model runs.
- A prompt's prefill depends only on the target, the prompt and the cache's capacity, never on the proposer, so
  generations of one prompt by several methods may share it (:class:`PrefillMemo`): the first runs the target and
  keeps a copy of the filled cache, its last logits and aux states; a later one with the same (target, prompt,
  capacity) continues from a copy, bit for bit what its own prefill would have written. Each result still
  reports the measured time of the real prefill (``prefill_s``, ``total_s``), so sharing flatters no timing; the
  drafter's prompt rows are each proposer's own and always run. At long context the prefill is most of a
  generation's cost (85 s at 16k tokens on a 2-core CPU for the embedded target).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eyas.serving.models.kv_cache import SlotCache
from eyas.serving.models.target import Target, TargetOutput
from eyas.serving.proposers import AcceptedTokens, DraftContext, Mode, Proposer
from eyas.serving.tree import DraftTree
from eyas.serving.verify import SamplingConfig, sample, verify, warp_probs

log = logging.getLogger(__name__)

MODES = ("chain", "tree")
DRAFT_ROOM = 64  # cache slots past the last token wanted, so the final steps can still verify a full draft


@dataclass
class StepStats:
    """One draft + verify step."""

    context_len: int  # tokens committed in the target cache before the step (the verify forward's prefix)
    num_drafted: int  # draft tokens verified (tree nodes without the root)
    draft_depth: int  # longest draft path in the proposal
    num_accepted: int  # draft tokens accepted and emitted (none past an EOS the step emitted)
    num_emitted: int  # tokens emitted: num_accepted + the bonus token, unless an EOS ended the step earlier
    draft_s: float  # proposer.propose + proposer.accept (all drafter work of the step)
    verify_s: float  # target forward over the pending token and the draft, verification, cache keep
    step_s: float  # the whole step, wall clock


@dataclass
class GenerationResult:
    """Tokens generated after the prompt and the per-step record."""

    tokens: list[int]
    steps: list[StepStats] = field(default_factory=list)
    prompt_len: int = 0
    prefill_s: float = 0.0  # target prefill + the drafter's prompt rows
    total_s: float = 0.0  # prefill and all steps
    stop_reason: str = "length"  # length | eos | context

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step (accepted drafts + the bonus token)."""
        return sum(s.num_emitted for s in self.steps) / max(len(self.steps), 1)

    def acceptance_by_position(self) -> list[float]:
        """Entry i: fraction of steps that drafted a path of depth >= i+1 and accepted >= i+1 tokens."""
        depth = max((s.draft_depth for s in self.steps), default=0)
        out = []
        for i in range(1, depth + 1):
            tried = [s for s in self.steps if s.draft_depth >= i]
            out.append(sum(s.num_accepted >= i for s in tried) / max(len(tried), 1))
        return out

    @property
    def decode_s(self) -> float:
        return sum(s.step_s for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        """End-to-end throughput, prefill included."""
        return len(self.tokens) / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens emitted by the speculative steps per second of step time (prefill excluded)."""
        return sum(s.num_emitted for s in self.steps) / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> dict[str, float]:
        n = max(len(self.steps), 1)
        return {
            "tokens": len(self.tokens),
            "steps": len(self.steps),
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "mean_draft_ms": 1e3 * sum(s.draft_s for s in self.steps) / n,
            "mean_verify_ms": 1e3 * sum(s.verify_s for s in self.steps) / n,
            "mean_step_ms": 1e3 * self.decode_s / n,
            "prefill_ms": 1e3 * self.prefill_s,
        }


@dataclass
class Prefilled:
    """A prompt written into a target cache: what generation continues from."""

    cache: SlotCache  # committed length = the prompt's
    logits: torch.Tensor  # [V] fp32, at the prompt's last position
    aux: torch.Tensor  # [P, n_aux * H] the target's aux states at the prompt's positions
    seconds: float  # wall clock of the target's prefill forward (a copy reports the real prefill's)


class PrefillMemo:
    """The last prefill of each target, for generations of the same prompt that follow (module docstring).

    Holds one entry per target (a new prompt or capacity replaces it), each a full cache copy: keep one memo per
    prompt (``eval.acceptance`` does) so memory stays at one cache per target beside the live one.

    ``across_copies``: one entry for every copy of the same target in the same dtype (the row-exact copy and the
    sdpa copy of an evaluation): whichever copy prefills first, the others continue from its cache, logits and
    aux states. The copies then share their starting state exactly (a method's output is still compared with
    plain decoding from that same state), and a long-context run pays one prefill per prompt instead of one per
    copy; what differs is only the numerics of the prefill the second copy would have run itself."""

    def __init__(self, across_copies: bool = False) -> None:
        self._entries: list[tuple[Target, torch.Tensor, Prefilled]] = []
        self.across_copies = across_copies

    def _same(self, a: Target, b: Target) -> bool:
        if a is b:
            return True
        return self.across_copies and a.info == b.info and a.dtype == b.dtype and a.device == b.device

    def restore(self, target: Target, prompt: torch.Tensor, max_len: int) -> Prefilled | None:
        """A copy of ``target``'s prefill of ``prompt`` ([P]) into a cache of ``max_len`` slots, else None."""
        for t, p, done in self._entries:
            if (
                self._same(t, target)
                and done.cache.max_len == max_len
                and p.shape == prompt.shape
                and torch.equal(p, prompt)
            ):
                return Prefilled(done.cache.clone(), done.logits, done.aux, done.seconds)
        return None

    def store(self, target: Target, prompt: torch.Tensor, done: Prefilled) -> None:
        """Keep a copy of ``done`` (just prefilled; its cache goes on to decode) as ``target``'s entry."""
        kept = Prefilled(done.cache.clone(), done.logits, done.aux, done.seconds)
        self._entries = [e for e in self._entries if not self._same(e[0], target)] + [
            (target, prompt.clone(), kept)
        ]


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def context_limit(target: Target) -> int:
    """The longest sequence the target may see (its ``max_position_embeddings``)."""
    return int(getattr(target.config, "max_position_embeddings", None) or 1 << 30)


def eos_ids(target: Target) -> list[int]:
    """The target's end-of-sequence ids (generation config first, then the tokenizer)."""
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(target.tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _check_prompt(target: Target, prompt_ids, max_new_tokens: int, mode: str) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt.dim() == 2:
        if prompt.shape[0] != 1:
            raise ValueError(
                f"generate serves one sequence at a time; got a batch of {prompt.shape[0]} prompts"
            )
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise ValueError(f"prompt_ids must be [P] or [1, P], got shape {tuple(prompt.shape)}")
    if prompt.numel() == 0:
        raise ValueError("empty prompt: give at least one token id (e.g. the BOS token or a chat template)")
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.vocab_size:
        raise ValueError(f"prompt ids must lie in [0, {target.vocab_size}) (the target's vocabulary)")
    limit = context_limit(target)
    if prompt.numel() >= limit:
        raise ValueError(
            f"prompt of {prompt.numel()} tokens does not fit the target's context of {limit} tokens "
            "(max_position_embeddings); shorten the prompt"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return prompt.to(target.device)


@torch.inference_mode()
def prefill(target: Target, cache: SlotCache, prompt: torch.Tensor) -> TargetOutput:
    """Write the prompt ([P]) into an empty cache (causal mask); logits at the last position only."""
    p_len, dev = prompt.numel(), prompt.device
    cache.prepare(torch.arange(p_len, device=dev), p_len)
    causal = torch.ones(p_len, p_len, dtype=torch.bool, device=dev).tril()[None, None]  # [1, 1, P, P]
    out = target.forward(prompt[None], attention_mask=causal, cache=cache, logits="last")
    cache.commit(p_len)
    return out


def prefill_or_restore(
    target: Target, prompt: torch.Tensor, max_len: int, memo: PrefillMemo | None
) -> Prefilled:
    """``prompt`` ([P]) in a new cache of ``max_len`` slots: restored from ``memo`` when it holds this prefill,
    else run (and stored in ``memo`` when given)."""
    done = None if memo is None else memo.restore(target, prompt, max_len)
    if done is not None:
        return done
    dev = target.device
    t0 = _clock(dev)
    cache = target.new_cache(max_len)
    out = prefill(target, cache, prompt)
    done = Prefilled(cache, out.logits[0, -1], out.aux[0], _clock(dev) - t0)
    if memo is not None:
        memo.store(target, prompt, done)
    return done


@torch.inference_mode()
def tree_forward(target: Target, cache: SlotCache, tree: DraftTree) -> TargetOutput:
    """The verify forward: the tree's nodes (root = pending token) at slots ``L .. L+n-1`` and positions
    ``L + depth``, each seeing the committed prefix and its own ancestors; logits at the ``n`` nodes only."""
    length, n, dev = cache.length, tree.size, target.device
    mask = torch.ones(n, length + n, dtype=torch.bool, device=dev)  # [n, L + n]
    mask[:, length:] = tree.mask
    cache.prepare(length + torch.arange(n, device=dev), length + n)
    return target.forward(
        tree.tokens[None],
        position_ids=(length + tree.depths)[None],
        attention_mask=mask[None, None],
        cache=cache,
        logits="all",
    )


@torch.inference_mode()
def commit(cache: SlotCache, path: torch.Tensor) -> None:
    """Keep the verified ``path`` (node indices of the last :func:`tree_forward`) as the next committed tokens."""
    cache.commit(path=path)


@torch.inference_mode()
def generate(
    target: Target,
    proposer: Proposer,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    mode: Mode = "chain",
    stop_on_eos: bool = True,
    eos_token_ids: Sequence[int] | None = None,
    prefill_memo: PrefillMemo | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` ([P] or [1, P]) with speculative decoding.

    mode: ``chain`` (chain verification; the proposer drafts a chain) or ``tree`` (tree verification; the
    proposer may draft a tree). The output is the target's own greedy output (temperature 0) or a sample from
    the target's warped distribution, whatever the proposer. ``prefill_memo``: share the prompt's prefill with
    the other generations of this prompt on this target (:class:`PrefillMemo`; same output, same timings).
    """
    sampling = sampling or SamplingConfig()
    prompt = _check_prompt(target, prompt_ids, max_new_tokens, mode)
    dev, p_len = target.device, prompt.numel()
    max_len = min(context_limit(target), p_len + max_new_tokens + DRAFT_ROOM)
    if p_len + max_new_tokens > context_limit(target):
        log.warning(
            "prompt (%d) + max_new_tokens (%d) exceed the target's context (%d): generation stops when it is full",
            p_len,
            max_new_tokens,
            context_limit(target),
        )
    eos = set(eos_token_ids if eos_token_ids is not None else eos_ids(target)) if stop_on_eos else set()
    gen = torch.Generator(device=dev).manual_seed(sampling.seed)
    proposer.reset(prompt, target=target.info, max_len=max_len)  # raises before any model runs

    def choose(logits: torch.Tensor) -> torch.Tensor:  # [V] -> [1]
        if sampling.greedy:
            return logits.argmax(-1, keepdim=True)
        return sample(warp_probs(logits, sampling.temperature, sampling.top_p), gen)

    # prefill: the prompt into the cache, the first output token becomes the pending token
    done = prefill_or_restore(target, prompt, max_len, prefill_memo)
    t_prompt = _clock(dev)  # a restored prefill's copy is not timed: done.seconds is the real prefill's
    cache = done.cache
    pending = choose(done.logits)
    proposer.accept(AcceptedTokens(start=0, tokens=prompt, next_token=pending, aux=done.aux))
    seq = torch.empty(max_len + 1, dtype=torch.long, device=dev)  # prompt, then every emitted token
    seq[:p_len], seq[p_len] = prompt, pending[0]
    emitted = [int(pending)]
    t_decode = _clock(dev)
    result = GenerationResult(tokens=emitted, prompt_len=p_len, prefill_s=done.seconds + t_decode - t_prompt)
    result.stop_reason = "eos" if emitted[0] in eos else "length"

    while result.stop_reason != "eos" and len(emitted) < max_new_tokens:
        length = cache.length
        room = max_len - length - 1  # draft tokens that fit in the cache after the pending token
        if room < 0:
            result.stop_reason = "context"
            break
        t0 = _clock(dev)
        ctx = DraftContext(
            tokens=seq[: length + 1],
            length=length,
            sampling=sampling,
            generator=gen,
            mode=mode,
            max_depth=min(room, max_new_tokens - len(emitted) - 1),
            max_tokens=room,
        )
        proposal = proposer.propose(ctx)
        t1 = _clock(dev)
        tree = proposal.tree
        if tree.num_draft > room or int(tree.tokens[0]) != int(seq[length]):
            raise ValueError(
                f"proposer {proposer.name!r} drafted {tree.num_draft} tokens (at most {room} fit) rooted at "
                f"{int(tree.tokens[0])} (must be the pending token {int(seq[length])})"
            )
        out = tree_forward(target, cache, tree)
        res = verify(out.logits[0], tree, proposal.draft_probs, sampling, gen, chain=mode == "chain")
        commit(cache, res.path)
        t2 = _clock(dev)
        proposer.accept(
            AcceptedTokens(
                start=length,
                tokens=tree.tokens[res.path],
                next_token=res.tokens[-1:],
                aux=out.aux[0, res.path],
                verify=res,
            )
        )
        t3 = _clock(dev)
        new = res.tokens.tolist()
        seq[length + 1 : length + 1 + len(new)] = res.tokens
        before = len(emitted)
        for tok in new[: max_new_tokens - len(emitted)]:
            emitted.append(tok)
            if tok in eos:
                result.stop_reason = "eos"
                break
        num_emitted = len(emitted) - before  # accepted drafts past an EOS are not output: not counted
        result.steps.append(
            StepStats(
                context_len=length,
                num_drafted=tree.num_draft,
                draft_depth=tree.max_depth,
                num_accepted=min(res.num_accepted, num_emitted),
                num_emitted=num_emitted,
                draft_s=(t1 - t0) + (t3 - t2),
                verify_s=t2 - t1,
                step_s=t3 - t0,
            )
        )
    result.total_s = result.prefill_s + _clock(dev) - t_decode
    return result
