"""Greedy speculative decoding with the DSpark module (docs/dspark.md): the step (dspark_runner.py runs it compiled
/ captured; the scheduler's speculative steps, speculative_scheduler.py, drive it).

Per step and row (y: the last emitted token, at position p, not yet in the caches; d_1..d_K: the DSpark block
drafted from anchor y, K = block_size): the main model verifies [y, d_1..d_K] at p..p+K in one multi-token decode
(Transformer._decode_layers over K + 1 DecodeSteps, as decode_tokens), reading the residual streams entering the
DSpark target layers on the way; n_acc = the leading drafts equal to the main model's argmax; the emitted tokens
are d_1..d_n_acc and the main model's token after them (c). The committed positions p..p+n_acc go into the DSpark
rings (their main_x KV), then DSpark drafts the next block from anchor c. The rejected positions' main-model cache
writes need no undo (spare_window_slots >= K, docs/speculation.md); DSpark's rings only ever take committed rows.

Every value of a step is a device tensor of static shape; the host reads the emitted tokens and n_acc once per
step. The CPU kernels make the verification bit for bit the one-token decode, so the tokens are plain greedy's.
"""
from __future__ import annotations

import torch

from dsv4_model.model.decode_options import DEFAULT as DEFAULT_OPTIONS
from dsv4_model.model.dspark import DSpark, main_hidden_of
from dsv4_model.model.layers import hc_post
from dsv4_model.runtime.speculative import Sampler, accept


def check_dspark_model(model, k: int | None = None) -> DSpark:
    """The model's DSpark module, checked for verifying k drafts per step (default: its whole block)."""
    dspark = getattr(model, "dspark", None)
    if dspark is None:
        raise ValueError("DSpark speculation needs the checkpoint's DSpark module (load_model(load_dspark=None), "
                         "a DSpark checkpoint: docs/dspark.md)")
    k = dspark.block_size if k is None else k
    if not 1 <= k <= dspark.block_size:
        raise ValueError(f"DSpark speculation verifies 1..block_size={dspark.block_size} drafts per step, got {k}")
    if model.spare_window_slots < k:
        raise ValueError(f"DSpark speculation verifies {k} drafts: it needs a model built with spare_window_slots "
                         f">= {k}, got {model.spare_window_slots}")
    return dspark


def prefill_taps(model, dspark: DSpark, prompt: torch.Tensor, lengths: torch.Tensor,
                 start: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill the prompt [B, L] (right-padded: lengths; 0: a row left as it is) from position 0, or a chunk of
    it from each row's start [B], and commit its positions to the DSpark rings -> fp32 logits [B, V] at each row's
    last token."""
    taps = {}

    def tap(layer_id, h):
        if layer_id in dspark.target_layer_ids:
            taps[layer_id] = h

    h = model.streams(prompt, lengths, start=0 if start is None else start, before_layer=tap)
    dspark.commit(main_hidden_of([taps[i] for i in dspark.target_layer_ids]),
                  torch.zeros_like(lengths) if start is None else start, lengths, model.rope_main)
    return model._logits(h[torch.arange(prompt.shape[0], device=h.device), (lengths - 1).clamp(min=0)])


def verify_taps(model, dspark: DSpark, tokens: torch.Tensor, positions: torch.Tensor,
                options=DEFAULT_OPTIONS, limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_tokens (tokens [B, T] at positions [B] ..), and the DSpark context of those positions: -> (fp32
    logits [B, T, V], main_hidden [B, T, n_targets * dim]). limit [B] (None: T - 1): row b's tokens past
    limit[b] go to no routed expert (their outputs are not read: a block cut short reads fewer experts)."""
    B, T = tokens.shape
    targets = dspark.target_layer_ids
    taps = {}

    def call(layer, h, ids, step, pending, fold):
        if layer.layer_id in targets:  # the layer's input: the streams with the previous layer's output folded in
            taps[layer.layer_id] = h if pending is None else hc_post(pending.out, h, pending.post, pending.comb)
        # a target layer's predecessor keeps its MoE output combined (an NVFP4 MoE's uncombined rows would need
        # the fused fold to be read)
        fold = fold and layer.layer_id + 1 not in targets
        return layer.decode(h, ids, step, pending, fold_rows=fold, routed=routed)

    ids = tokens.t().reshape(-1)
    routed = None if limit is None else (torch.arange(T, device=tokens.device).unsqueeze(1)
                                         <= limit.unsqueeze(0)).reshape(-1)  # row t * B + b: token t of row b
    h = model.embed(ids).unsqueeze(1).repeat(1, model.hc, 1)
    h = model._decode_layers(h, ids, model._token_steps(positions, T, options), options, call)
    logits = model._logits(h).view(T, B, -1).transpose(0, 1)
    main_hidden = main_hidden_of([taps[i] for i in targets]).view(T, B, -1).transpose(0, 1)
    return logits, main_hidden


def draft_block(model, dspark: DSpark, anchor: torch.Tensor, last: torch.Tensor, k: int, s: Sampler, j0: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The first k drafts of a DSpark block from anchor [B] after position last [B] -> (drafts [B, k], their
    distributions [B, k, V] or None in greedy mode, the confidence head's predicted chance of each draft's
    acceptance [B, k] fp32). Sampled: position i drawn from its Markov-biased logits with the sampler's parameters
    at draw j0 + i (each kept position: the Markov bias of the next reads it). The positions past k are not drafted
    (DSpark.draft's keep): their drafts would not be verified."""
    if s.mode == "greedy":
        block = dspark.draft(model, anchor, last, keep=k)
        return block.tokens, None, block.confidence.float().sigmoid()
    qs = []

    def pick(logits: torch.Tensor, i: int) -> torch.Tensor:
        q = s.probs(logits.unsqueeze(1))[:, 0]
        qs.append(q)
        return s.draw(q, j0 + i)

    block = dspark.draft(model, anchor, last, pick=pick, keep=k)
    return block.tokens, torch.stack(qs, dim=1), block.confidence.float().sigmoid()


def dspark_step(model, dspark: DSpark, y: torch.Tensor, drafts: torch.Tensor, pos: torch.Tensor,
                options=DEFAULT_OPTIONS, live: torch.Tensor | None = None, s: Sampler | None = None,
                q: torch.Tensor | None = None, limit: torch.Tensor | None = None):
    """One step of rows at positions pos [B] holding y [B] and drafts [B, K] (drawn from q [B, K, V] when
    sampling). Returns (emitted [B, K + 1], valid up to n_acc + 1; n_acc [B]; the next K drafts, drafted from the
    last emitted token, their q and their confidence (draft_block's); the main model's logits [B, K + 1, V] each
    emitted token was decided from). s: the sampler (default greedy; draws 0 .. K - 1 accept, K corrects,
    K + 1 .. 2K draft). live [B] (1 / 0): rows with 0 accept nothing (a row riding along commits only
    its own position, which it rewrites first). limit [B] (None: K): each row's block cut after its first
    limit[b] drafts (`accept`): the positions past it read no routed expert (`verify_taps`)."""
    K = drafts.shape[1]
    s = s if s is not None else Sampler("greedy", *([None] * 5))
    rows = torch.arange(drafts.shape[0], device=y.device)
    logits, main_hidden = verify_taps(model, dspark, torch.cat([y.unsqueeze(1), drafts], dim=1), pos, options,
                                      limit)
    emitted, n_acc = accept(logits, drafts, q, s, live, limit)
    dspark.commit(main_hidden, pos, n_acc + 1, model.rope_main)  # positions p .. p + n_acc
    nxt, nq, nconf = draft_block(model, dspark, emitted[rows, n_acc], pos + n_acc, K, s, K + 1)
    return emitted, n_acc, nxt, nq, nconf, logits
