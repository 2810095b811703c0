"""The sampler reference (dsv4::sample)."""
import torch


# ======================================================================================================
# Sampler: dsv4::sample
# ======================================================================================================

_U32 = 0xFFFFFFFF


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * m for uint32 values held in int64 (16-bit limbs avoid int64 overflow)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    m_hi, m_lo = m >> 16, m & 0xFFFF
    mid = (a_hi * m_lo + a_lo * m_hi) * 65536 + a_lo * m_lo  # < 2^50
    return a_hi * m_hi + (mid >> 32), mid & _U32


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 (Salmon et al. 2011). counter [..., 4], key [..., 2]: uint32 values in int64 tensors."""
    c = [counter[..., i].to(torch.int64) for i in range(4)]
    k0, k1 = key[..., 0].to(torch.int64), key[..., 1].to(torch.int64)
    for _ in range(10):
        hi0, lo0 = _mulhilo32(c[0], 0xD2511F53)
        hi1, lo1 = _mulhilo32(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + 0x9E3779B9) & _U32
        k1 = (k1 + 0xBB67AE85) & _U32
    return torch.stack(c, dim=-1)


def sample_uniform_words(seed: torch.Tensor, offset: torch.Tensor, V: int) -> torch.Tensor:
    """The random word of every (row, element): int64 [B, V] in [0, 2^32).

    Element i of a row uses word i % 4 of Philox(counter = (i // 4 as 64 bit, offset as 64 bit), key = seed).
    """
    B = seed.shape[0]
    groups = torch.arange((V + 3) // 4, dtype=torch.int64, device=seed.device)
    s = seed.to(torch.int64)[:, None].expand(B, groups.numel())
    o = offset.to(torch.int64)[:, None].expand(B, groups.numel())
    g = groups[None, :].expand(B, -1)
    counter = torch.stack([g & _U32, (g >> 32) & _U32, o & _U32, (o >> 32) & _U32], dim=-1)
    key = torch.stack([s & _U32, (s >> 32) & _U32], dim=-1)
    return philox4x32_10(counter, key).reshape(B, -1)[:, :V]


def gumbel_from_words(words: torch.Tensor) -> torch.Tensor:
    """Gumbel(0,1) in fp32: v = ((w >> 9) + 0.5) * 2^-23, g = -log(-log1p(-v))."""
    v = ((words >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log1p(-v))


def sample_probs_ref(logits, temperature, top_k, top_p) -> torch.Tensor:
    """The exact distribution dsv4::sample draws from, float64 [B, V] (rows sum to 1).

    temperature <= 0: one-hot at the first argmax. Otherwise softmax(logits / T) restricted to
    - top-k (k > 0 and k < V): tokens whose logit >= the k-th largest logit (ties at the boundary kept);
    - then top-p (p < 1): among those, token i is kept iff the renormalized mass of tokens with a strictly
      larger logit is < p (so the most likely token always stays; ties at the boundary kept),
    renormalized. (The kernels evaluate the top-p mass in 2^-40 fixed point, so tokens within ~2^-40 of the
    boundary may be decided differently.)
    """
    lg = torch.nan_to_num(logits.double(), nan=float("-inf"))
    B, V = lg.shape
    out = torch.zeros_like(lg)
    for b in range(B):
        row = lg[b]
        t = float(temperature[b])
        if not t > 0:
            out[b, int(torch.argmax(row))] = 1.0
            continue
        keep = torch.ones(V, dtype=torch.bool, device=lg.device)
        k = int(top_k[b])
        if 0 < k < V:
            kth = torch.topk(row, k).values[-1]
            keep &= row >= kth
        p = torch.softmax(torch.where(keep, row / t, float("-inf")), dim=0)
        tp = float(top_p[b])
        if tp < 1.0:
            above = (p[None, :] * (row[None, :] > row[:, None])).sum(dim=1)  # O(V^2): small V only
            top_mask = (above < tp) | (row == row.max())
            keep &= top_mask
            p = torch.where(keep, p, 0.0)
            p = p / p.sum()
        out[b] = p
    return out


def sample_ref(logits, temperature, top_k, top_p, seed, offset) -> torch.Tensor:
    """dsv4::sample in plain torch: Gumbel-max over the kept set of `sample_probs_ref`, int64 [B]."""
    lg = torch.nan_to_num(logits.float(), nan=float("-inf"))
    probs = sample_probs_ref(logits, temperature, top_k, top_p)
    keys = lg / temperature.float().clamp_min(1e-30)[:, None] + gumbel_from_words(
        sample_uniform_words(seed, offset, lg.shape[1])
    )
    keys = torch.where(probs > 0, keys, float("-inf"))
    greedy = ~(temperature > 0)
    return torch.where(greedy, torch.argmax(lg, dim=1), torch.argmax(keys, dim=1))
