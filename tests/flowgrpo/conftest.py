import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    """These tests run many tiny ops; on a shared 2-core machine intra-op threading costs several times the wall
    time (measured ~5x). Results do not depend on it: every reference in these tests is computed in-process."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
