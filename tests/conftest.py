import pytest
import torch


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    import dsv4_ops

    return dsv4_ops.built_with_cuda()


def pytest_addoption(parser):
    parser.addoption("--kernel-overrides", default="",
                     help='dsv4_ops.overrides for the whole run, e.g. "pdl=0" (scripts/gpu_check.sh pdl)')


def pytest_configure(config):
    spec = config.getoption("--kernel-overrides")
    if spec:
        from dsv4_ops.overrides import parse, set_overrides

        set_overrides(parse(spec))


@pytest.fixture
def override_kernels():
    """Call with KernelOverrides fields to change them for this test; restored at its end."""
    import dataclasses

    from dsv4_ops.overrides import current, set_overrides

    before = current()
    yield lambda **changes: set_overrides(dataclasses.replace(current(), **changes))
    set_overrides(before)


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
