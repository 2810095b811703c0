import pytest
import torch


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    import dsv4_ops

    return dsv4_ops.built_with_cuda()


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and dsv4_ops built with CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()
