"""Eager inference engine: validated prefill (ragged batches) + per-row incremental decode over a Transformer."""

from __future__ import annotations

import torch

from dsv4_model.model.checks import decode_request, prefill_request
from dsv4_model.model.config import ModelConfig
from dsv4_model.model.transformer import Transformer


class Engine:
    """Owns the per-row positions of a `Transformer` and validates requests before any compute.

    prefill(input_ids [B, S], lengths=None, all_logits=False) -> fp32 logits [B, V] (last valid position of each
    row) or [B, S, V]; decode(next_ids [B]) -> fp32 [B, V], each row continuing at its own position."""

    def __init__(self, model: Transformer, config: ModelConfig | None = None, device=None, *,
                 compile: bool | None = None, cuda_graphs: bool | None = None, graph_mode: str = "manual"):
        self.model = model
        self.config = config if config is not None else model.config
        self.device = torch.device(device) if device is not None else model.device
        self.max_batch_size = model.max_batch_size
        self.max_seq_len = model.max_seq_len
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.long, device=self.device)
        self._lens: list[int] = []
        # How generate() runs decode steps (dsv4_model/runtime/compiled.py); None = on for CUDA, off for CPU.
        self.decode_options = {"compile": compile, "cuda_graphs": cuda_graphs, "graph_mode": graph_mode}
        self.path = None  # checkpoint directory: generate() looks for tokenizer.json there
        self.tokenizer = None

    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=torch.bfloat16, max_batch_size: int = 1,
                        max_seq_len: int = 4096, simulate_quant: bool = True, compile: bool | None = None,
                        cuda_graphs: bool | None = None, graph_mode: str = "manual", quant: str | None = None,
                        act_quant: str | None = None, **options) -> "Engine":
        """Load a checkpoint directory via `dsv4_model.checkpoint.loader.load_model`; `options` go to the loader
        (e.g. layout=, load_mtp=, progress=). compile / cuda_graphs / graph_mode: see `generate`.
        quant: "none" | "nvfp4" (NVFP4 weights, see dsv4_model/quant/quantize_model.py) | None (as stored);
        act_quant: "none" (W4A16) | "nvfp4" (W4A4) | None (as stored / "none")."""
        from dsv4_model.checkpoint.loader import load_model

        model, config = load_model(path, device=device, dtype=dtype, max_batch_size=max_batch_size,
                                   max_seq_len=max_seq_len, simulate_quant=simulate_quant, quant=quant,
                                   act_quant=act_quant, **options)
        engine = cls(model, config, device, compile=compile, cuda_graphs=cuda_graphs, graph_mode=graph_mode)
        engine.path = path
        return engine

    # ------------------------------------------------------------------ state
    @property
    def batch_size(self) -> int:
        return len(self._lens)

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row (= position of the next token)."""
        return list(self._lens)

    def reset(self) -> None:
        self._lens = []
        self.positions.zero_()

    def set_lengths(self, lens: list[int]) -> None:
        """The rows' token counts after decode steps run outside decode() (generate's runner)."""
        self._lens = [int(n) for n in lens]
        self.positions.zero_()
        self.positions[:len(lens)] = torch.tensor(self._lens, dtype=torch.long)

    # ------------------------------------------------------------------ inference
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        tokens, lens = prefill_request(input_ids, lengths, max_batch_size=self.max_batch_size,
                                       max_seq_len=self.max_seq_len, vocab_size=self.config.vocab_size)
        len_dev = torch.tensor(lens, dtype=torch.long, device=self.device)
        logits = self.model.prefill(tokens.to(self.device), len_dev, all_logits=all_logits)
        self._lens = lens
        self.positions.zero_()
        self.positions[:len(lens)] = len_dev
        return logits

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        ids = decode_request(next_ids, self._lens, max_seq_len=self.max_seq_len, vocab_size=self.config.vocab_size)
        B = len(self._lens)
        logits = self.model.decode_step(ids.to(self.device), self.positions[:B])
        self.positions[:B] += 1
        self._lens = [n + 1 for n in self._lens]
        return logits

    def generate(self, prompts, **kwargs):
        """Batched, streaming generation (compiled / CUDA-graph decode); see `dsv4_model.runtime.generate.generate`."""
        from dsv4_model.runtime.generate import generate

        return generate(self, prompts, **kwargs)
