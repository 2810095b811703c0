"""What an engine owns between calls, written once for `Engine` and dsv4_export's `ExportedEngine`: the rows'
positions and token counts (validated prefill / decode bookkeeping), the DecodeRunner built from its
`RunnerOptions`, the tokenizer, and generate()."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dsv4_model.model.checks import decode_request, prefill_request
from dsv4_model.model.to_device import device_longs, to_device


@dataclass(frozen=True)
class RunnerOptions:
    """How generate() runs decode steps (the settings of dsv4_model.runtime.compiled.DecodeRunner): compile /
    cuda_graphs None = on for CUDA, off on the CPU; graph_mode "manual" | "reduce-overhead"; regional: compile one
    decoder layer at a time (decode steps, and the Engine's compiled prefill chunks); log: called with progress lines while a batch bucket compiles / captures."""

    compile: bool | None = None
    cuda_graphs: bool | None = None
    graph_mode: str = "manual"
    regional: bool = False
    log: Callable[[str], None] | None = None

    def validate(self) -> "RunnerOptions":
        """One clear error per bad field (checked when an Engine is made, before any weight is read): a "no" for
        compile must not switch it on."""
        for name in ("compile", "cuda_graphs"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be True, False or None (auto), got {v!r}")
        if not isinstance(self.regional, bool):
            raise ValueError(f"regional must be True or False, got {self.regional!r}")
        from dsv4_model.runtime.compiled import GRAPH_MODES

        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}")
        if self.log is not None and not callable(self.log):
            raise ValueError(f"log must be callable, got {type(self.log).__name__}")
        return self


def checked_runner_options(opts) -> RunnerOptions:
    if not isinstance(opts, RunnerOptions):
        raise TypeError(f"runner_options must be a RunnerOptions, got {type(opts).__name__}")
    return opts.validate()


class EngineSession:
    """Subclasses set model, config, device, max_batch_size, max_seq_len, vocab_size, runner_options and path,
    call `_init_session()`, and provide `_prefill_logits(tokens, lengths)` / `_decode_logits(tokens, positions)`
    (device tensors in, fp32 logits out)."""

    # whether generate() can run this engine's prompts through the Scheduler: prefill_at (a chunk of rows each
    # from its own position) and protect_rows (dsv4_model.runtime.scheduler)
    can_prefill_at = False

    def _init_session(self) -> None:
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.long, device=self.device)
        self._lens: list[int] = []
        self._runner = None
        self._runner_built_from: RunnerOptions | None = None
        self.tokenizer = None  # None: loaded from `path` (or the byte fallback) on first use

    # ------------------------------------------------------------------ state
    @property
    def batch_size(self) -> int:
        return len(self._lens)

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row (= position of the next token)."""
        return list(self._lens)

    def reset(self) -> None:
        """Forget the batch (the caches need no clearing: prefill rewrites what decode reads)."""
        self._lens = []
        self.positions.zero_()

    def set_lengths(self, lens: list[int]) -> None:
        """The rows' token counts after decode steps run outside decode() (generate's runner)."""
        self._lens = [int(n) for n in lens]
        self.positions.zero_()
        self.positions[:len(lens)] = torch.tensor(self._lens, dtype=torch.long)

    # ------------------------------------------------------------------ inference
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids [B, S] (right-padded rows of `lengths`) -> fp32 logits [B, V] at each row's last token."""
        tokens, lens = prefill_request(input_ids, lengths, max_batch_size=self.max_batch_size,
                                       max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)
        len_dev = device_longs(lens, self.device)
        logits = self._prefill_logits(to_device(tokens, self.device), len_dev, **kwargs)
        self._lens = lens
        self.positions.zero_()
        self.positions[:len(lens)] = len_dev
        return logits

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        """next_ids [B] -> fp32 logits [B, V], each row continuing at its own position."""
        ids = decode_request(torch.as_tensor(next_ids).reshape(-1), self._lens, max_seq_len=self.max_seq_len,
                             vocab_size=self.vocab_size)
        b = len(self._lens)
        logits = self._decode_logits(ids.to(self.device), self.positions[:b])
        self.positions[:b] += 1
        self._lens = [n + 1 for n in self._lens]
        return logits

    # ------------------------------------------------------------------ generation
    def runner(self):
        """The DecodeRunner generate() steps, built on first use from `runner_options` and rebuilt when they
        change (assign a new RunnerOptions to change them)."""
        # Imported here: the runner loads the op library, which ExportedEngine loads first with its own checks.
        from dsv4_model.runtime.compiled import DecodeRunner

        opts = self._checked_runner_options()
        if self._runner is None or self._runner_built_from != opts:
            self._runner = DecodeRunner(self.model, compile=opts.compile, cuda_graphs=opts.cuda_graphs,
                                        graph_mode=opts.graph_mode, regional=opts.regional, log=opts.log)
            self._runner_built_from = opts
        return self._runner

    def _checked_runner_options(self) -> RunnerOptions:
        return checked_runner_options(self.runner_options)

    def get_tokenizer(self):
        if self.tokenizer is None:
            from dsv4_model.checkpoint.tokenizer import load_tokenizer

            # (lenient: an engine on a random full-size checkpoint runs on token ids; the CLIs require the file)
            self.tokenizer = load_tokenizer(self.path, self.config, require=False)
        return self.tokenizer

    def generate(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_token_ids=None, stream=None, **kwargs):
        """Batched, streaming generation (compiled / CUDA-graph decode); see `dsv4_model.runtime.generate`."""
        from dsv4_model.runtime.generate import generate

        return generate(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, stream,
                        **kwargs)
