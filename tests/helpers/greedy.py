"""The plain greedy loop of one prompt on an engine (prefill, then argmax and decode; no stop tokens): the loop
the C++ runner runs, the oracle its output is compared with."""
from typing import Sequence

import torch


@torch.no_grad()
def greedy_ids(engine, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Token ids of the greedy continuation of prompt_ids on engine (an ExportedEngine: reset, prefill,
    decode), no stop tokens."""
    if len(prompt_ids) + max_new_tokens - 1 > engine.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len {engine.max_seq_len}")
    engine.reset()
    logits = engine.prefill(torch.tensor([list(prompt_ids)]))
    out: list[int] = []
    for i in range(max_new_tokens):
        out.append(int(logits[0].argmax()))
        if i + 1 < max_new_tokens:
            logits = engine.decode(torch.tensor([out[-1]]))
    return out
