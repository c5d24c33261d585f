"""Fixtures the test files share."""
import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """Every floating tensor allocated with torch.empty starts as NaN: an unwritten output shows."""
    real = torch.empty

    def nan_empty(*a, **k):
        t = real(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
