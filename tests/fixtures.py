"""Fixtures shared by tests/ and bench/ (both conftests import them)."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: with tiny matmuls on a shared 2-core machine, OpenMP spin-waits
    cost far more than the work (seen ~1000x), for our code and its baseline alike."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
