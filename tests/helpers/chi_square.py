"""The exact joint distribution of three sampled tokens after a prompt under the plain sampler, and a chi-square
test of observed draws against it: the tests' check that speculative sampling follows the plain distribution."""
from __future__ import annotations

import torch

from dsv4_ops.reference import sample_probs_ref


def exact_joint3(model, prompt: list[int], T: float, top_k: int, top_p: float) -> dict[tuple, float]:
    """{(t1, t2, t3): p(t1) p(t2 | t1) p(t3 | t1, t2)} from the model's prefill logits of every prefix and the
    sampler's reference distribution."""
    def dist(prefix):
        lg = model.prefill(torch.tensor([prefix]))
        return sample_probs_ref(lg, torch.full((1,), T), torch.full((1,), top_k), torch.full((1,), top_p))[0]

    exact: dict[tuple, float] = {}
    p1 = dist(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            p3 = dist(prompt + [a, b])
            for c in p3.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return exact


def assert_follows(seen: dict[tuple, int], exact: dict[tuple, float]) -> None:
    """No sequence the plain sampler cannot produce, and chi-square over the cells expecting >= 5 draws (the rest
    pooled) below its 0.999 quantile (Wilson-Hilferty): a fixed-seed test that fails on a biased sampler."""
    draws = sum(seen.values())
    assert set(seen) <= set(exact)
    big = [c for c in exact if exact[c] * draws >= 5]
    obs = [seen.get(c, 0) for c in big] + [draws - sum(seen.get(c, 0) for c in big)]
    exp = [exact[c] * draws for c in big] + [draws * (1 - sum(exact[c] for c in big))]
    chi2 = sum((o - x) ** 2 / x for o, x in zip(obs, exp) if x > 0)
    dof = len(obs) - 1
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < limit, (chi2, limit, dof)
