"""How the reduce-scatter is chosen and built, without a second process.

The CUDA (NCCL) path cannot run here; these tests pin its selection logic:
a backend whose probe succeeds gets the native ``sum_scatter``.
"""

import mlx.core as mx
import pytest

from mlx_fsdp import collectives


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(collectives.ENV_VAR, raising=False)
    collectives._native_cache.clear()
    yield
    collectives._native_cache.clear()


def test_native_when_the_probe_succeeds_and_probed_once(monkeypatch):
    calls = []
    monkeypatch.setattr(collectives, "_probe_native", lambda g: calls.append(g) or True)
    g = FakeGroup(8, 3)
    assert collectives.reduce_scatter_method(g) == "native"
    assert collectives.reduce_scatter_method(g) == "native"
    assert len(calls) == 1


def test_all_sum_fallback_when_the_probe_fails(monkeypatch):
    monkeypatch.setattr(collectives, "_probe_native", lambda g: False)
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "all_sum"


def test_the_real_probe_on_this_backend_is_false_or_true_never_raises():
    # A single process: MLX's singleton group has no sum_scatter backend.
    assert collectives.supports_sum_scatter(mx.distributed.init()) in (True, False)


def test_environment_and_argument_override(monkeypatch):
    monkeypatch.setattr(collectives, "_probe_native", lambda g: False)
    monkeypatch.setenv(collectives.ENV_VAR, "native")
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "native"
    assert collectives.reduce_scatter_method(FakeGroup(2, 0), "all_sum") == "all_sum"
    monkeypatch.setenv(collectives.ENV_VAR, "auto")
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "all_sum"


def test_unknown_method_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(collectives.ENV_VAR, "ring")
    with pytest.raises(ValueError, match="MLX_FSDP_REDUCE_SCATTER='ring'.*native, all_sum"):
        collectives.reduce_scatter_method(FakeGroup(2, 0))


def test_native_method_calls_sum_scatter_and_keeps_this_ranks_row(monkeypatch):
    seen = {}

    def fake_sum_scatter(x, group=None, stream=None):
        seen["shape"], seen["group"] = x.shape, group
        return x[group.rank()][None] * 10

    monkeypatch.setattr(mx.distributed, "sum_scatter", fake_sum_scatter)
    g = FakeGroup(4, 2)
    x = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    out = collectives.reduce_scatter(x, g, method="native")
    assert seen == {"shape": (4, 3), "group": g}
    assert out.tolist() == [60.0, 70.0, 80.0]


def test_all_sum_method_takes_this_ranks_row(monkeypatch):
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: x * 2)
    x = mx.arange(6, dtype=mx.float32).reshape(2, 3)
    assert collectives.reduce_scatter(x, FakeGroup(2, 1), method="all_sum").tolist() == [6.0, 8.0, 10.0]
