"""Eager inference engine: validated prefill (ragged batches) + per-row incremental decode over a Transformer."""

from __future__ import annotations

import os

import torch

from dsv4_model.checkpoint.builtin import DEFAULT_MODEL
from dsv4_model.model.checks import check_positive_int
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.to_device import to_device
from dsv4_model.model.transformer import Transformer
from dsv4_model.runtime.prefill_chunks import prefill_in_chunks
from dsv4_model.runtime.session import EngineSession, RunnerOptions, checked_runner_options

# positions per prefill forward by default: a longer prompt is prefilled in chunks of this many (bounded
# activations; a V4-Flash chunk's are a few GB)
DEFAULT_PREFILL_CHUNK = 8192


DRAFT_HEADS = ("stored", "nvfp4")
HEAD_QUANTS = ("none", "nvfp4")

ENGINE_DTYPES = (torch.bfloat16, torch.float32)


class Engine(EngineSession):
    """Owns the per-row positions of a `Transformer` and validates requests before any compute.

    prefill(input_ids [B, S], lengths=None, all_logits=False) -> fp32 logits [B, V] (last valid position of each
    row) or [B, S, V]; decode(next_ids [B]) -> fp32 [B, V], each row continuing at its own position;
    generate(prompts, ...) (dsv4_model.runtime.generate). State and generation: `EngineSession`.
    prefill_chunk: positions per prefill forward (a longer prompt runs in chunks: dsv4_model.runtime.prefill_chunks).
    compile_prefill: prefill_at's chunks (the scheduler's prefill) through compiled graphs per (rows, tokens) bucket
    (dsv4_model.runtime.compiled_prefill; layer by layer where runner_options.regional); off by default until
    measured on the GPU (each bucket compiles on its first chunk: a one-off stall). An attribute: assign it to
    switch."""

    can_prefill_at = True

    def __init__(self, model: Transformer, config: ModelConfig | None = None, device=None, *,
                 runner_options: RunnerOptions = RunnerOptions(), prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 compile_prefill: bool = False):
        check_positive_int(prefill_chunk, "prefill_chunk")
        self.prefill_chunk = prefill_chunk
        self.compile_prefill = _checked_compile_prefill(compile_prefill)
        self._compiled_prefill = None
        self.model = model
        self.config = config if config is not None else model.config
        self.device = torch.device(device) if device is not None else model.device
        self.max_batch_size = model.max_batch_size
        self.max_seq_len = model.max_seq_len
        self.vocab_size = self.config.vocab_size
        self.runner_options = runner_options  # how generate() runs decode steps
        self.path = None  # checkpoint directory: generate() looks for tokenizer.json there
        self.draft_head = "stored"  # the head the drafters read (set_draft_head)
        self._init_session()

    @classmethod
    def from_pretrained(cls, path=DEFAULT_MODEL, *, device="cpu", dtype=torch.bfloat16, max_batch_size: int = 1,
                        max_seq_len: int = 4096, simulate_quant: bool = True, compile: bool | None = None,
                        cuda_graphs: bool | None = None, graph_mode: str = "manual", quant: str | None = None,
                        act_quant: str | None = None, runner_options: RunnerOptions | None = None,
                        prefill_chunk: int = DEFAULT_PREFILL_CHUNK, compile_prefill: bool = False,
                        head_quant: str = "none", **options) -> "Engine":
        """Load a checkpoint directory, a Hugging Face repo id `org/name[@rev]` in the local HF cache, or
        "dsv4-default" (the default: the built-in model) (`dsv4_model.checkpoint.hub.resolve_checkpoint`), via `dsv4_model.checkpoint.loader.load_model`; `options`
        go to the loader (e.g. layout=, load_mtp=, progress=). compile / cuda_graphs / graph_mode: how generate()
        runs decode steps (`RunnerOptions`; or pass runner_options, which then replaces them).
        quant: "none" | "nvfp4" (NVFP4 weights, see dsv4_model/quant/quantize_model.py) | None (as stored);
        act_quant: "none" (W4A16) | "nvfp4" (W4A4) | None (as stored / "none"). compile_prefill: see Engine.
        head_quant: "none" (the head as stored) | "nvfp4" (the head to NVFP4 after loading: a quarter of its bytes
        per step, fp32 logits from W4A16 sums; an accuracy trade, docs/nvfp4.md "The head")."""
        from dsv4_model.checkpoint.hub import resolve_checkpoint
        from dsv4_model.checkpoint.loader import load_model

        check_positive_int(prefill_chunk, "prefill_chunk")  # before any weight is read
        _checked_compile_prefill(compile_prefill)
        if head_quant not in HEAD_QUANTS:
            raise ValueError(f"head_quant must be one of {HEAD_QUANTS}, got {head_quant!r}")
        if dtype not in ENGINE_DTYPES:  # the kernels' activations (fp16 is not one of them)
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype!r}")
        if not isinstance(simulate_quant, bool):
            raise ValueError(f"simulate_quant must be True or False, got {simulate_quant!r}")
        if runner_options is None:
            runner_options = RunnerOptions(compile=compile, cuda_graphs=cuda_graphs, graph_mode=graph_mode)
        checked_runner_options(runner_options)
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a checkpoint directory or a repo id (str), got {type(path).__name__}")
        path = resolve_checkpoint(path)
        model, config = load_model(path, device=device, dtype=dtype, max_batch_size=max_batch_size,
                                   max_seq_len=max_seq_len, simulate_quant=simulate_quant, quant=quant,
                                   act_quant=act_quant, **options)
        if head_quant == "nvfp4":
            from dsv4_model.quant.nvfp4_modules import quantize_head_

            quantize_head_(model.head)
        engine = cls(model, config, device, runner_options=runner_options, prefill_chunk=prefill_chunk,
                     compile_prefill=compile_prefill)
        engine.path = path
        return engine

    def _prefill_logits(self, tokens: torch.Tensor, lengths: torch.Tensor, all_logits: bool = False,
                        speculate: bool = False):
        """speculate: also fill the MTP block's cache over the prompt and return (logits [B, V], the final
        streams at each row's last token [B, hc, dim]) for the first drafts."""
        return prefill_in_chunks(self.model, tokens, lengths, self.prefill_chunk, all_logits, speculate)

    @torch.no_grad()
    def prefill_at(self, tokens: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor,
                   mtp_next: tuple[torch.Tensor, torch.Tensor] | None = None, dspark: bool = False):
        """One prefill chunk of rows [:B] each from its own position: tokens [B, S] right-padded, lengths [B] (0: a
        row left as it is), start [B] -> fp32 logits [B, V] at each row's last token (the scheduler's prefill; the
        rows' positions and lengths are the caller's to keep).
        mtp_next (next_ids [B, S], next_lengths [B]): also fill the MTP block's cache over the chunk (position t
        reads token t + 1 = next_ids[b, t - start]; a row's last prompt position has no next token yet, so its
        next_lengths stops one short) and return (logits, the final streams at each row's last token
        [B, hc, dim]) for the first drafts.
        dspark: also commit the chunk's positions to the DSpark module's rings (the streams entering its target
        layers) and return (logits, None)."""
        dev = self.device
        tokens, lengths, start = to_device(tokens, dev), to_device(lengths, dev), to_device(start, dev)
        if dspark:
            from dsv4_model.runtime.dspark_speculative import prefill_taps

            return prefill_taps(self.model, self.model.dspark, tokens, lengths, start), None
        if mtp_next is None:
            compiled = self.compiled_prefill()
            logits = None if compiled is None else compiled(tokens, lengths, start)
            return self.model.prefill(tokens, lengths, start=start) if logits is None else logits
        _, last = self._chunk_streams(tokens, lengths, start, mtp_next)
        return self.model._logits(last), last

    def _chunk_streams(self, tokens: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor,
                       mtp_next: tuple[torch.Tensor, torch.Tensor] | None):
        """A chunk's final streams [B, S, hc, dim] (the MTP block's cache filled too where mtp_next is given) and
        each row's at its last token [B, hc, dim]; tokens / lengths / start on the device."""
        from dsv4_model.model import mtp

        h = self.model.streams(tokens, lengths, start=start)
        if mtp_next is not None:
            mtp.prefill(self.model, h, to_device(mtp_next[0], self.device), to_device(mtp_next[1], self.device),
                        start=start)
        return h, h[torch.arange(h.shape[0], device=h.device), (lengths - 1).clamp(min=0)]

    @torch.no_grad()
    def prefill_scored(self, tokens: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor, score,
                       mtp_next: tuple[torch.Tensor, torch.Tensor] | None = None):
        """prefill_at's chunk (eager; the MTP block's cache filled too where mtp_next is given) that also scores
        the prompt. score = (rows: the chunk rows to score, next_ids [B, S], next_lengths [B] (host), k): for each
        scored row b and t < next_lengths[b], the log-probability of next_ids[b, t] from the logits after position
        t, and the k most likely there. Returns (fp32 logits [B, V] at each row's last token, the final streams
        there [B, hc, dim], [(chosen [m], top values [m, k], top ids [m, k]) per scored row], device tensors)."""
        dev = self.device
        h, last = self._chunk_streams(to_device(tokens, dev), to_device(lengths, dev), to_device(start, dev),
                                      mtp_next)
        rows, next_ids, next_lengths, k = score
        scores = [score_positions(self.model, h[b, :n], to_device(next_ids[b, :n], dev), k)
                  for b, n in zip(rows, next_lengths[rows].tolist())]
        return self.model._logits(last), last, scores

    def compiled_prefill(self):
        """The CompiledPrefill prefill_at runs its chunks through (built on first use), or None when
        compile_prefill is off. The MTP and DSpark variants of prefill_at stay eager."""
        if not _checked_compile_prefill(self.compile_prefill):
            return None
        if self._compiled_prefill is None:
            from dsv4_model.runtime.compiled_prefill import CompiledPrefill

            self._compiled_prefill = CompiledPrefill(self.model, log=self.runner_options.log,
                                                     regional=self.runner_options.regional)
        return self._compiled_prefill

    def protect_rows(self, rows: list[int]):
        """Their compressor states, to put back after a decode step they ride along in (restore())."""
        saved = self.model.save_compressor_rows(rows)
        return lambda: self.model.restore_compressor_rows(rows, saved)

    def swap_rows(self, pairs: list[tuple[int, int]]) -> None:
        """Exchange the caches of each pair of rows (the scheduler's prefill placement)."""
        self.model.swap_rows_([a for a, _ in pairs], [b for _, b in pairs])

    def copy_rows(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the caches of row a into row b for each pair (the scheduler's prefix snapshots)."""
        self.model.copy_rows_([a for a, _ in pairs], [b for _, b in pairs])

    def speculative_runner(self, k: int):
        """The SpeculativeRunner generate(..., speculate=k) steps (MTP drafts), built on first use per k from
        `runner_options` (rebuilt when they change)."""
        from dsv4_model.runtime.speculative_runner import SpeculativeRunner

        return self._drafting_runner(SpeculativeRunner, k)

    def dspark_runner(self, k: int, cut: float = 0.0):
        """The DSparkRunner generate(..., speculate=k) steps on a DSpark checkpoint, built as speculative_runner;
        cut: its confidence cut (dsv4_model.runtime.dspark_runner; 0: off)."""
        from dsv4_model.runtime.dspark_runner import DSparkRunner

        return self._drafting_runner(DSparkRunner, k, cut=cut)

    def set_draft_head(self, kind: str) -> None:
        """The head the drafters (MTP block, DSpark) read: "stored" (the model's) or "nvfp4" (an NVFP4 copy of it,
        built here: a quarter of the head's bytes per speculative step, at some acceptance; greedy output and the
        sampled distribution are unchanged, since verification reads the stored head; DSpark's Markov bias
        projection gets an NVFP4 copy too). Speculative runners built before are rebuilt on next use."""
        from dsv4_model.model.transformer import attach_draft_head
        from dsv4_model.quant.nvfp4_modules import is_nvfp4, nvfp4_draft_head

        if kind not in DRAFT_HEADS:
            raise ValueError(f"draft_head must be one of {DRAFT_HEADS}, got {kind!r}")
        if kind == self.draft_head:  # (a second copy would leave captured graphs reading the first one's buffers)
            return
        copy = kind == "nvfp4" and not is_nvfp4(self.model.head)  # an NVFP4 head (head_quant) drafts as it is
        attach_draft_head(self.model, nvfp4_draft_head(self.model.head) if copy else None)
        dspark = getattr(self.model, "dspark", None)
        if dspark is not None:  # DSpark's Markov bias likewise: its fp32 rank -> vocabulary projection in NVFP4
            from dsv4_model.model.dspark import attach_draft_markov

            mk = dspark.mtp[-1].markov_head
            fits = mk.markov_w2.in_features % 16 == 0  # (whole NVFP4 blocks; tiny test ranks may not be)
            attach_draft_markov(mk, nvfp4_draft_head(mk.markov_w2) if kind == "nvfp4" and fits else None)
        self.draft_head = kind

    def _drafting_runner(self, cls, k: int, **kw):
        opts = self._checked_runner_options()
        key = (cls, k, opts, tuple(sorted(kw.items())), self.draft_head)
        if getattr(self, "_drafting_key", None) != key:
            self._drafting = cls(self.model, k, compile=opts.compile, cuda_graphs=opts.cuda_graphs,
                                 graph_mode=opts.graph_mode, regional=opts.regional, log=opts.log, **kw)
            self._drafting_key = key
        return self._drafting

    def _decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decode_step(tokens, positions)


def _checked_compile_prefill(value):
    if not isinstance(value, bool):
        raise TypeError(f"compile_prefill must be a bool, got {value!r}")
    return value


SCORE_POSITIONS = 256  # positions per head call when scoring a prompt: [256, V] fp32 logits at a time


def score_positions(model, h: torch.Tensor, ids: torch.Tensor, k: int):
    """Final streams h [n, hc, dim] at n positions and the token after each, ids [n] -> (each one's
    log-probability [n], the k most likely values and ids [n, k]), SCORE_POSITIONS positions at a time (a
    prompt's logits at once would be [n, V])."""
    chosen, vals, idx = [], [], []
    for i in range(0, h.shape[0], SCORE_POSITIONS):
        lp = torch.log_softmax(model._logits(h[i:i + SCORE_POSITIONS]).float(), dim=-1)
        chosen.append(lp.gather(1, ids[i:i + SCORE_POSITIONS].view(-1, 1)).squeeze(1))
        top = lp.topk(k, dim=-1)
        vals.append(top.values)
        idx.append(top.indices)
    empty = h.new_zeros(0, k, dtype=torch.float32)
    return (torch.cat(chosen) if chosen else h.new_zeros(0, dtype=torch.float32),
            torch.cat(vals) if vals else empty, torch.cat(idx) if idx else empty.long())
