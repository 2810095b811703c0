"""Speculative decoding with the MTP block (docs/speculation.md): per step the main model verifies the last token
and K drafts in one pass (dsv4_model.model.mtp.verify_tokens), the drafts are accepted on the device (greedy: equal
to the main model's choice; sampling: the rejection rule, so the output follows the non-speculative
distribution), and the MTP block drafts K more from the last accepted position. Rejected tokens are not undone:
the model's window rings have K spare slots and its compressor states are indexed by position
(Transformer(spare_window_slots >= K)), so what they wrote is overwritten before anything reads it.

Every value of a step is a device tensor of static shape (no host sync, no data-dependent shape): the step
compiles with fullgraph and replays as one CUDA graph per (batch bucket, K, sampling mode)
(dsv4_model.runtime.speculative_runner)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_model.model import mtp
from dsv4_model.model.layers import wide_argmax
from dsv4_ops import ops

SAMPLING_MODES = ("greedy", "sample", "filter")  # argmax only | temperature | temperature + top-k / top-p


@dataclass
class SpeculationStats:
    k: int
    steps: int = 0  # verification passes
    row_steps: int = 0  # rows counted over those passes (a row that has finished is not counted)
    emitted: int = 0  # tokens those rows emitted (bonus tokens included)
    accepted: list[int] = field(default_factory=list)  # per draft position: rows that accepted it
    offered: list[int] = field(default_factory=list)  # per draft position: rows whose earlier drafts all passed
    # a drafter with a confidence head (DSpark): per draft position, its predicted chance of acceptance summed over
    # the rows it was offered to (set against acceptance())
    predicted: list[float] = field(default_factory=list)
    predicted_rows: int = 0  # the counted rows that came with a prediction
    # every counted row's (drafts accepted, their confidence in thousandths) where kept (judged=[]): cut()'s input
    judged: list[tuple[int, list[int]]] | None = None

    def __post_init__(self):
        self.accepted = self.accepted or [0] * self.k
        self.offered = self.offered or [0] * self.k
        self.predicted = self.predicted or [0.0] * self.k

    @property
    def tokens_per_step(self) -> float:
        """Tokens per verification pass and row."""
        return self.emitted / max(1, self.row_steps)

    def acceptance(self) -> list[float]:
        return [a / o if o else float("nan") for a, o in zip(self.accepted, self.offered)]

    def predicted_acceptance(self) -> list[float]:
        """Per draft position, the confidence head's mean predicted chance over the rows it was offered to (nan:
        no prediction counted)."""
        if not self.predicted_rows:
            return [float("nan")] * self.k
        return [p / o if o else float("nan") for p, o in zip(self.predicted, self.offered)]

    def count(self, n_accepted: list[int], confidence: list[list[int]] | None = None) -> None:
        """One verification pass: the drafts each counted row accepted (and, from a drafter with a confidence
        head, each row's k drafts' predicted chance of acceptance in thousandths, -1 for a draft a cut left out)."""
        self.steps += 1
        self.row_steps += len(n_accepted)
        self.emitted += sum(n + 1 for n in n_accepted)
        for i, n in enumerate(n_accepted):
            for j in range(self.k):  # a draft a confidence cut left out (-1) was not offered
                self.offered[j] += j <= n and (confidence is None or confidence[i][j] >= 0)
                self.accepted[j] += j < n
        if confidence is None:
            return
        self.predicted_rows += len(confidence)
        for n, c in zip(n_accepted, confidence):
            for j in range(min(n + 1, self.k)):
                self.predicted[j] += max(c[j], 0) / 1000
        if self.judged is not None:
            self.judged.extend((n, list(c)) for n, c in zip(n_accepted, confidence))

    def cut(self, threshold: float) -> tuple[float, float]:
        """What cutting each block at its first draft predicted below `threshold` would have given on the kept
        passes (judged): (tokens per row and pass, drafts verified per row and pass). A row keeps the tokens it
        accepted before the cut and the verification's own; the verification cost follows the drafts verified."""
        if not self.judged:
            raise ValueError("cut() needs the passes kept: SpeculationStats(k, judged=[]) and a drafter that predicts")
        tokens = verified = 0
        for n, c in self.judged:
            keep = next((j for j, v in enumerate(c) if v < 1000 * threshold), len(c))
            tokens += min(n, keep) + 1
            verified += keep
        return tokens / len(self.judged), verified / len(self.judged)


def check_model(model, k: int) -> None:
    from dsv4_model.model.checks import check_speculate

    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculate must be an int >= 1, got {k!r}")
    check_speculate(k)
    if not model.config.n_mtp_layers and getattr(model, "dspark", None) is not None:
        raise ValueError("speculative decoding here drafts with an MTP block, and this checkpoint carries a DSpark "
                         "module instead: speculate_method 'dspark' / --speculate-method dspark (or auto) drafts with it "
                         "(docs/dspark.md)")
    if not model.config.n_mtp_layers:
        raise ValueError("speculative decoding needs the model's MTP block (n_mtp_layers >= 1)")
    if model.spare_window_slots < k:
        raise ValueError(f"speculate={k} needs a model built with spare_window_slots >= {k}, "
                         f"got {model.spare_window_slots}")


def sampling_mode(params) -> str:
    """The cheapest mode that serves every row of a batch (SamplingParams list)."""
    if all(p.temperature <= 0 for p in params):
        return "greedy"
    if any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params):
        return "filter"
    return "sample"


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   mode: str) -> torch.Tensor:
    """The distribution dsv4::sample draws from (docs/ops.md "Sampler"), as fp32 probabilities [N, V] of logits
    [N, V] with per-row parameters [N]: one-hot at the first maximum for temperature <= 0; else softmax(logits / T)
    over the top-k set (ties at the k-th logit kept), then over the tokens whose strictly larger tokens' mass is
    below top_p (ties kept; top_p <= 0 keeps the most likely). Top-p masses are fp32 sums here (the op sums in
    fixed point): they can differ only for tokens within rounding of the boundary."""
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"))
    greedy = temperature <= 0
    one_hot = torch.zeros_like(logits).scatter_(1, wide_argmax(logits).unsqueeze(1), 1.0)
    if mode == "greedy":
        return one_hot
    x = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if mode == "filter":
        V = logits.shape[1]
        val, idx = logits.sort(dim=1, descending=True, stable=True)
        kth = val.gather(1, (top_k.clamp(1, V) - 1).unsqueeze(1))
        k_off = ((top_k <= 0) | (top_k >= V)).unsqueeze(1)
        keep_k = k_off | (val >= kth)
        p = torch.softmax(torch.where(keep_k, x.gather(1, idx), float("-inf")), dim=1)
        before = p.cumsum(1) - p  # mass of the tokens sorted before
        first = torch.ones_like(keep_k)
        first[:, 1:] = val[:, 1:] != val[:, :-1]
        # a tie group's mass of strictly larger tokens: the value at its first member (before is nondecreasing)
        larger = torch.where(first, before, 0.0).cummax(1).values
        keep = keep_k & ((top_p >= 1).unsqueeze(1) | (larger < top_p.unsqueeze(1)) | (larger == 0))
        x = torch.where(torch.zeros_like(keep).scatter_(1, idx, keep), x, float("-inf"))
    return torch.where(greedy.unsqueeze(1), one_hot, torch.softmax(x, dim=1))


def draw(probs: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] with the sampler's Philox stream (seed, offset) [N]: dsv4::sample's
    Gumbel-max at temperature 1 on log-probabilities is an exact categorical draw."""
    ones = torch.ones_like(seed, dtype=torch.float32)
    return ops.sample(probs.log(), temperature=ones, top_k=torch.zeros_like(seed), top_p=ones, seed=seed,
                      offset=offset)


def bernoulli(a: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """True with probability a [N] (a draw between two outcomes of masses a and 1 - a)."""
    return draw(torch.stack([a, 1 - a], dim=1), seed, offset) == 0


@dataclass
class Sampler:
    """The rows' sampling parameters [B] and the first Philox offset of the step's draws; draw j of a step uses
    offset base + j (a step makes 2K + 1 draws: K acceptances, the correction, K drafts)."""

    mode: str
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    base: torch.Tensor

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, T, V] -> [B, T, V] (every position with its row's parameters)."""
        B, T, V = logits.shape
        rep = (lambda t: t.repeat_interleave(T)) if T > 1 else (lambda t: t)
        return filtered_probs(logits.reshape(B * T, V), rep(self.temperature), rep(self.top_k), rep(self.top_p),
                              self.mode).view(B, T, V)

    def draw(self, probs: torch.Tensor, j: int) -> torch.Tensor:
        return draw(probs, self.seed, self.base + j)


def draft_chain(model, logits: torch.Tensor, streams: torch.Tensor, pos: torch.Tensor, k: int, s: Sampler,
                j0: int, options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k drafts per row from the MTP block's logits [B, V] and output streams [B, hc, dim] at position pos - 1:
    draft 1 from those logits, each later one from the block run at the next position on its own streams and the
    draft before. Returns (drafts [B, k], their distributions [B, k, V] or None in greedy mode); draws use
    offsets base + j0 ...."""
    toks, qs = [], []
    for j in range(k):
        if s.mode == "greedy":
            t = wide_argmax(logits)
        else:
            q = s.probs(logits.unsqueeze(1))[:, 0]
            t = s.draw(q, j0 + j)
            qs.append(q)
        toks.append(t)
        if j + 1 < k:
            lg, out = mtp.decode_tokens(model, streams.unsqueeze(1), t.unsqueeze(1), pos + j, options)
            logits, streams = lg[:, 0], out[:, 0]
    return torch.stack(toks, dim=1), (torch.stack(qs, dim=1) if qs else None)


def first_drafts(model, streams: torch.Tensor, first: torch.Tensor, pos: torch.Tensor, k: int, s: Sampler,
                 options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafts after prefill: the MTP block at the last prompt position pos [B] (the main streams there
    [B, hc, dim], the first sampled token) and on from there."""
    lg, out = mtp.decode_tokens(model, streams.unsqueeze(1), first.unsqueeze(1), pos, options)
    return draft_chain(model, lg[:, 0], out[:, 0], pos + 1, k, s, 0, options)


def accept(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, s: Sampler,
           live: torch.Tensor | None = None, limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification's verdict on drafts [B, K] (drawn from q [B, K, V]; None in greedy mode) from the main
    model's logits [B, K + 1, V] after the last token and each draft -> (emitted [B, K + 1]: the accepted drafts
    then the correction / bonus token, valid up to n_acc + 1; n_acc [B]). Greedy: drafts equal to the main model's
    choice; sampling: the rejection rule (draws base + 0 .. K - 1 for the acceptances, base + K for the correction),
    so the output follows the main model's distribution. live [B] (1 / 0): rows with 0 accept nothing. limit [B]
    (0..K, None: K): row b offers only its first limit[b] drafts (a block cut short), the token after them drawn
    as a bonus; a limit decided from the drafts before each offered one keeps the output's distribution."""
    B, K = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    offered = None if limit is None else torch.arange(K, device=drafts.device) < limit.unsqueeze(1)
    if s.mode == "greedy":
        g = wide_argmax(logits)  # [B, K + 1]: the main model's token after each verified position
        match = drafts == g[:, :K]
        n_acc = (match if offered is None else match & offered).int().cumprod(dim=1).sum(dim=1)
        if live is not None:
            n_acc = n_acc * live
        c = g[rows, n_acc]
    else:
        p = s.probs(logits)
        pd = p[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2)
        qd = q.gather(2, drafts.unsqueeze(2)).squeeze(2)
        a = torch.where(qd > 0, (pd / qd).clamp(max=1.0), 0.0)
        acc = torch.stack([bernoulli(a[:, j], s.seed, s.base + j) for j in range(K)], dim=1)
        n_acc = (acc if offered is None else acc & offered).int().cumprod(dim=1).sum(dim=1)
        if live is not None:
            n_acc = n_acc * live
        # the correction at the first rejection: norm(max(0, p - q)) (p where they are equal); the bonus after
        # every offered draft passed: p at n_acc
        pn = p[rows, n_acc]
        qn = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n_acc]
        if limit is not None:
            qn = torch.where((n_acc < limit).unsqueeze(1), qn, 0.0)
        r = (pn - qn).clamp(min=0)
        c = s.draw(torch.where(r.sum(1, keepdim=True) > 0, r, pn), K)
    # the token after each verified position as committed: the accepted drafts, then c
    emitted = torch.cat([drafts, torch.zeros_like(c).unsqueeze(1)], dim=1).scatter(1, n_acc.unsqueeze(1),
                                                                                    c.unsqueeze(1))
    return emitted, n_acc


def verify_step(model, y: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, pos: torch.Tensor,
                s: Sampler, options, live: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One speculative step of rows at positions pos [B] holding y [B] (not yet in the caches) and drafts [B, K]
    (drawn from q [B, K, V]; None in greedy mode). Returns (emitted [B, K + 1], n_acc [B] as `accept`; the next
    step's drafts [B, K] and their q; the main model's logits [B, K + 1, V] each emitted token was decided from).
    live [B] (1 / 0): rows with 0 accept nothing, so a row riding along writes no further ahead than a step that
    rejects every draft (its K + 1 positions; what any later step of that row rewrites first)."""
    K = drafts.shape[1]
    rows = torch.arange(drafts.shape[0], device=y.device)
    logits, hs = mtp.verify_tokens(model, torch.cat([y.unsqueeze(1), drafts], dim=1), pos, options)
    emitted, n_acc = accept(logits, drafts, q, s, live)
    # the block over the K + 1 verified positions (its cache for the committed ones); the head on the row each
    # row drafts from only (B rows instead of (K + 1) x B: the weight is read either way, the work is not)
    m_out = mtp.decode_streams(model, hs, emitted, pos, options)[rows, n_acc]
    nxt, nq = draft_chain(model, mtp.logits(model, m_out), m_out, pos + n_acc + 1, K, s, K + 1, options)
    return emitted, n_acc, nxt, nq, logits
