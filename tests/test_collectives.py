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


def test_fallbacks_when_the_probe_fails_exchange_for_two_ranks(monkeypatch):
    monkeypatch.setattr(collectives, "_probe_native", lambda g: False)
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "exchange"
    for n in (3, 4, 8):
        assert collectives.reduce_scatter_method(FakeGroup(n, 0)) == "all_sum"


def test_native_wins_over_exchange_at_two_ranks(monkeypatch):
    monkeypatch.setattr(collectives, "_probe_native", lambda g: True)
    assert collectives.reduce_scatter_method(FakeGroup(2, 1)) == "native"


def test_exchange_forced_on_more_than_two_ranks_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(collectives, "_probe_native", lambda g: False)
    with pytest.raises(ValueError, match="method='exchange' needs a group of exactly 2 ranks.*has 4.*'all_sum'"):
        collectives.reduce_scatter_method(FakeGroup(4, 0), "exchange")
    monkeypatch.setenv(collectives.ENV_VAR, "exchange")
    with pytest.raises(ValueError, match="MLX_FSDP_REDUCE_SCATTER='exchange' needs a group of exactly 2"):
        collectives.reduce_scatter_method(FakeGroup(3, 0))
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "exchange"
    with pytest.raises(ValueError, match="exchange needs a group of exactly 2 ranks"):
        collectives.exchange(mx.zeros((4,)), FakeGroup(3, 0))


def test_the_real_probe_on_this_backend_is_false_or_true_never_raises():
    # A single process: MLX's singleton group has no sum_scatter backend.
    assert collectives.supports_sum_scatter(mx.distributed.init()) in (True, False)


def test_environment_and_argument_override(monkeypatch):
    monkeypatch.setattr(collectives, "_probe_native", lambda g: False)
    monkeypatch.setenv(collectives.ENV_VAR, "native")
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "native"
    assert collectives.reduce_scatter_method(FakeGroup(2, 0), "all_sum") == "all_sum"
    monkeypatch.setenv(collectives.ENV_VAR, "auto")
    assert collectives.reduce_scatter_method(FakeGroup(2, 0)) == "exchange"
    assert collectives.reduce_scatter_method(FakeGroup(3, 0)) == "all_sum"


def test_unknown_method_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(collectives.ENV_VAR, "ring")
    with pytest.raises(ValueError, match="MLX_FSDP_REDUCE_SCATTER='ring'.*native, exchange, all_sum"):
        collectives.reduce_scatter_method(FakeGroup(2, 0))


def test_native_method_calls_sum_scatter_on_the_flat_vector(monkeypatch):
    seen = {}

    def fake_sum_scatter(x, group=None, stream=None):
        seen["shape"], seen["group"] = x.shape, group
        cols = x.shape[0] // group.size()
        return x[group.rank() * cols:(group.rank() + 1) * cols] * 10

    monkeypatch.setattr(mx.distributed, "sum_scatter", fake_sum_scatter)
    g = FakeGroup(4, 2)
    x = mx.arange(12, dtype=mx.float32)
    out = collectives.reduce_scatter(x, g, method="native")
    assert seen == {"shape": (12,), "group": g}
    assert out.tolist() == [60.0, 70.0, 80.0]


def test_all_sum_method_takes_this_ranks_shard(monkeypatch):
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: x * 2)
    x = mx.arange(6, dtype=mx.float32)
    assert collectives.reduce_scatter(x, FakeGroup(2, 1), method="all_sum").tolist() == [6.0, 8.0, 10.0]


def _fake_all_gather(peer_half):
    # What the other rank sends: all_gather concatenates the two ranks' inputs.
    def all_gather(x, group=None, stream=None):
        parts = [x, peer_half] if group.rank() == 0 else [peer_half, x]
        return mx.concatenate(parts)
    return all_gather


def test_exchange_sends_the_peers_half_and_adds_what_comes_back(monkeypatch):
    mine = mx.array([1.0, 2.0, 3.0, 4.0])  # this rank's bucket vector: two shards of 2
    peer = mx.array([10.0, 20.0, 30.0, 40.0])  # the other rank's
    for rank in (0, 1):
        sent = {}

        def all_gather(x, group=None, stream=None):
            sent["half"] = x.tolist()
            return _fake_all_gather(peer[2 * rank:2 * rank + 2])(x, group, stream)

        monkeypatch.setattr(mx.distributed, "all_gather", all_gather)
        out = collectives.reduce_scatter(mine, FakeGroup(2, rank), method="exchange")
        other = 1 - rank
        assert sent["half"] == mine[2 * other:2 * other + 2].tolist(), "must send the half the peer keeps"
        assert out.tolist() == (mine[2 * rank:2 * rank + 2] + peer[2 * rank:2 * rank + 2]).tolist()
