"""The op families (dsv4_ops.families) against the schema table and the files: every op of
csrc/registration.cpp in exactly one family, each family's files under its own name, a fake for every op, and a
library lacking an op of the table refused at load in one error naming it."""
import os
import re

import pytest
import torch

import dsv4_ops
from dsv4_ops import _loader
from dsv4_ops.families import FAMILIES, OP_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS_DIR = os.path.join(ROOT, "dsv4_ops")


def _schema_ops():
    src = open(os.path.join(OPS_DIR, "csrc", "registration.cpp")).read()
    return re.findall(r'm\.def\(\s*"(\w+)\(', src)


def test_every_op_of_the_schema_table_is_in_one_family():
    assert sorted(OP_NAMES) == sorted(_schema_ops())
    assert len(set(OP_NAMES)) == len(OP_NAMES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_files(family):
    want = [f"csrc/{family}_checks.h", f"csrc/cpu/{family}.cpp", f"csrc/cuda/{family}.cu",
            f"csrc/cuda/{family}_bindings.cpp", f"fakes/{family}.py", f"reference/{family}.py", f"../tests/test_{family}.py"]
    missing = [p for p in want if not os.path.isfile(os.path.join(OPS_DIR, p))]
    assert not missing, f"family {family}: no {missing}"


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_op_has_a_fake(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv4::{op}", "Meta") or \
        torch._library.simple_registry.singleton.find(f"dsv4::{op}").fake_impl.kernel is not None


def test_a_stale_library_is_refused_in_one_error_naming_the_missing_op():
    path = dsv4_ops.library_path()
    _loader.check_current(path)  # the built library is current
    with pytest.raises(ImportError, match=r"stale: it lacks dsv4::not_built_yet \(ops of the schema table") as e:
        _loader.check_current(path, OP_NAMES + ("not_built_yet",))
    assert path in str(e.value) and "scripts/build_ops.sh" in str(e.value)
