"""Eager inference engine: validated prefill (ragged batches) + per-row incremental decode over a Transformer."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .model import Transformer


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
        # How generate() runs decode steps (dsv4_model/compiled.py); None = on for CUDA, off for CPU.
        self.decode_options = {"compile": compile, "cuda_graphs": cuda_graphs, "graph_mode": graph_mode}
        self.path = None  # checkpoint directory: generate() looks for tokenizer.json there
        self.tokenizer = None

    @classmethod
    def from_pretrained(cls, path, *, device="cpu", dtype=torch.bfloat16, max_batch_size: int = 1,
                        max_seq_len: int = 4096, simulate_quant: bool = True, compile: bool | None = None,
                        cuda_graphs: bool | None = None, graph_mode: str = "manual", quant: str | None = None,
                        act_quant: str | None = None, **options) -> "Engine":
        """Load a checkpoint directory via `dsv4_model.loader.load_model`; `options` go to the loader
        (e.g. layout=, load_mtp=, progress=). compile / cuda_graphs / graph_mode: see `generate`.
        quant: "none" | "nvfp4" (NVFP4 weights, see dsv4_model/quantize_model.py) | None (as stored);
        act_quant: "none" (W4A16) | "nvfp4" (W4A4) | None (as stored / "none")."""
        from .loader import load_model

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

    # ------------------------------------------------------------------ validation
    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"{what} must be an integer tensor, got {ids.dtype}")
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what} contains token id {bad} outside [0, vocab_size={self.config.vocab_size})")

    # ------------------------------------------------------------------ inference
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a 2-D tensor [batch, seq]")
        B, S = input_ids.shape
        if B < 1 or S < 1:
            raise ValueError(f"empty prompt batch {tuple(input_ids.shape)}")
        if B > self.max_batch_size:
            raise ValueError(f"batch size {B} exceeds max_batch_size={self.max_batch_size}")
        if lengths is None:
            lens = [S] * B
        else:
            lengths = torch.as_tensor(lengths)
            if lengths.shape != (B,):
                raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
            lens = [int(v) for v in lengths.tolist()]
            if min(lens) < 1 or max(lens) > S:
                raise ValueError(f"lengths must lie in [1, {S}], got {lens}")
        if max(lens) > self.max_seq_len:
            raise ValueError(f"prompt length {max(lens)} exceeds max_seq_len={self.max_seq_len}")
        S = max(lens)  # drop all-padding columns
        valid = torch.arange(S).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        ids_cpu = input_ids.detach()[:, :S].cpu()
        self._check_ids(ids_cpu[valid], "input_ids")
        # padding may hold any value (e.g. -1): feed token 0 there; it never influences valid positions
        tokens = torch.where(valid, ids_cpu, torch.zeros_like(ids_cpu)).to(device=self.device, dtype=torch.long)
        len_dev = torch.tensor(lens, dtype=torch.long, device=self.device)
        logits = self.model.prefill(tokens, len_dev, all_logits=all_logits)
        self._lens = lens
        self.positions.zero_()
        self.positions[:B] = len_dev
        return logits

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        if not self._lens:
            raise ValueError("decode() called before prefill()")
        next_ids = torch.as_tensor(next_ids)
        B = len(self._lens)
        if next_ids.shape != (B,):
            raise ValueError(f"next_ids must have shape ({B},) to match the prefilled batch, got "
                             f"{tuple(next_ids.shape)}")
        if max(self._lens) >= self.max_seq_len:
            raise ValueError(f"a row already holds {max(self._lens)} tokens = max_seq_len={self.max_seq_len}")
        self._check_ids(next_ids, "next_ids")
        logits = self.model.decode_step(next_ids.to(device=self.device, dtype=torch.long), self.positions[:B])
        self.positions[:B] += 1
        self._lens = [n + 1 for n in self._lens]
        return logits

    def generate(self, prompts, **kwargs):
        """Batched, streaming generation (compiled / CUDA-graph decode); see `dsv4_model.generate.generate`."""
        from .generate import generate

        return generate(self, prompts, **kwargs)
