import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Every test on one thread: tensors this small gain nothing from intra-op threads, and a
    busy second core (pytest -n 2) makes the thread barrier cost 100x the work. (Tests that
    name it still do: it was theirs before every test had it.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_kernels(monkeypatch):
    """model/fused.py's module state (its kernels, a failure) as at import, and put back after."""
    from ddpgpt.model import fused
    monkeypatch.setattr(fused, "_kernels", {})
    monkeypatch.setattr(fused, "failure", "")
