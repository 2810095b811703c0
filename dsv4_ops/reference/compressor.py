"""Compressor decode reference (dsv4::compressor_decode)."""
import torch


def compressor_decode_ref(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                          kv_state: torch.Tensor, score_state: torch.Tensor, overlap: bool | None = None,
                          kv_batch: int = 0) -> torch.Tensor:
    """One decode step of dsv4_model.model.compressor.Compressor.decode's state update and pooling (as tensor ops):
    writes the token into rows [:B] of the states in place and returns pooled fp32 [B, hd]: the window's pooling
    where the row's token closes it ((pos + 1) % m == 0), 0 where it stays open (no entry is written). overlap:
    overlapping windows (C = 2 hd; default: the state has 2m rows). States of more than c*m rows (c = 2 with
    overlap) are indexed by position (token p in row p mod R, the window read by position, never shifted).
    kv_batch > 0: the B rows are tokens of kv_batch sequences, token-major: kv_batch rows at a time, in order."""
    if kv_batch:
        return torch.cat([compressor_decode_ref(kv[r:r + kv_batch], score[r:r + kv_batch], ape,
                                                positions[r:r + kv_batch], kv_state, score_state, overlap)
                          for r in range(0, kv.shape[0], kv_batch)])
    B, C = kv.shape
    m, R = ape.shape[0], kv_state.shape[1]
    overlap = R == 2 * m if overlap is None else overlap
    hd, cm = (C // 2, 2 * m) if overlap else (C, m)
    rows = torch.arange(B, device=kv.device)
    pos = positions.long()
    by_position = R > cm
    slot = pos % R if by_position else (m if overlap else 0) + pos % m
    kv_state.index_put_((rows, slot), kv)
    score_state.index_put_((rows, slot), score + ape[pos % m])
    if by_position:  # the window's rows by position; positions below 0 read as unwritten rows
        q = pos.unsqueeze(1) - (cm - 1) + torch.arange(cm, device=kv.device).unsqueeze(0)
        kv_w = kv_state[rows.unsqueeze(1), q % R]
        sc_w = score_state[rows.unsqueeze(1), q % R].masked_fill((q < 0).unsqueeze(-1), float("-inf"))
        kv_w = kv_w.masked_fill((q < 0).unsqueeze(-1), 0.0)
    else:
        kv_w, sc_w = kv_state[:B], score_state[:B]
    closes = ((pos + 1) % m == 0).view(B, 1)
    if not overlap:
        return torch.where(closes, (kv_w * sc_w.softmax(dim=1)).sum(dim=1), 0.0)
    kv_s = torch.cat([kv_w[:, :m, :hd], kv_w[:, m:, hd:]], dim=1)
    sc_s = torch.cat([sc_w[:, :m, :hd], sc_w[:, m:, hd:]], dim=1)
    pooled = torch.where(closes, (kv_s * sc_s.softmax(dim=1)).sum(dim=1), 0.0)
    if not by_position:
        closed = closes.view(B, 1, 1)
        kv_state[:B, :m] = torch.where(closed, kv_state[:B, m:], kv_state[:B, :m])
        score_state[:B, :m] = torch.where(closed, score_state[:B, m:], score_state[:B, :m])
    return pooled
