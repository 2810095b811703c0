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
                options=DEFAULT_OPTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_tokens (tokens [B, T] at positions [B] ..), and the DSpark context of those positions: -> (fp32
    logits [B, T, V], main_hidden [B, T, n_targets * dim])."""
    B, T = tokens.shape
    targets = dspark.target_layer_ids
    taps = {}

    def call(layer, h, ids, step, pending, fold):
        if layer.layer_id in targets:  # the layer's input: the streams with the previous layer's output folded in
            taps[layer.layer_id] = h if pending is None else hc_post(pending.out, h, pending.post, pending.comb)
        # a target layer's predecessor keeps its MoE output combined (an NVFP4 MoE's uncombined rows would need
        # the fused fold to be read)
        fold = fold and layer.layer_id + 1 not in targets
        return layer.decode(h, ids, step, pending, fold_rows=fold)

    ids = tokens.t().reshape(-1)
    h = model.embed(ids).unsqueeze(1).repeat(1, model.hc, 1)
    h = model._decode_layers(h, ids, model._token_steps(positions, T, options), options, call)
    logits = model._logits(h).view(T, B, -1).transpose(0, 1)
    main_hidden = main_hidden_of([taps[i] for i in targets]).view(T, B, -1).transpose(0, 1)
    return logits, main_hidden


def dspark_step(model, dspark: DSpark, y: torch.Tensor, drafts: torch.Tensor, pos: torch.Tensor,
                options=DEFAULT_OPTIONS, live: torch.Tensor | None = None):
    """One greedy step of rows at positions pos [B] holding y [B] and drafts [B, K]. Returns (emitted [B, K + 1],
    valid up to n_acc + 1; n_acc [B]; the next DSparkDraft, drafted from the last emitted token). live [B] (1 / 0):
    rows with 0 accept nothing (a row riding along commits only its own position, which it rewrites first)."""
    B, K = drafts.shape
    rows = torch.arange(B, device=y.device)
    logits, main_hidden = verify_taps(model, dspark, torch.cat([y.unsqueeze(1), drafts], dim=1), pos, options)
    g = logits.argmax(-1)  # [B, K + 1]: the main model's token after each verified position
    n_acc = (drafts == g[:, :K]).int().cumprod(dim=1).sum(dim=1)
    if live is not None:
        n_acc = n_acc * live
    c = g[rows, n_acc]
    emitted = torch.cat([drafts, torch.zeros_like(c).unsqueeze(1)], dim=1).scatter(1, n_acc.unsqueeze(1),
                                                                                    c.unsqueeze(1))
    dspark.commit(main_hidden, pos, n_acc + 1, model.rope_main)  # positions p .. p + n_acc
    return emitted, n_acc, dspark.draft(model, c, pos + n_acc)
