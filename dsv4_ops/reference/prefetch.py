"""L2 prefetch reference (dsv4::prefetch_l2)."""
import torch


def prefetch_l2_ref(after: torch.Tensor, weights: list[torch.Tensor], marker: torch.Tensor) -> None:
    """No value changes (a cache hint); marker = the bytes of the weights asked for (numel x element size each)."""
    marker.fill_(sum(w.numel() * w.element_size() for w in weights))
