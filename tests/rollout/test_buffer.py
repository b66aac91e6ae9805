"""fgrpo.rollout.buffer: bounded versioned hand-off and weight slot, with threads and a fake slow engine."""

import threading
import time

import pytest
import torch

from fgrpo.rollout.buffer import RolloutBuffer, WeightStore

pytestmark = pytest.mark.timeout(10)


def _thread(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_drop_rule_exact():
    """max_staleness 1, batches of versions 0..3 waiting, trainer at 3: 0 and 1 (staleness 3, 2) are dropped and
    recorded, 2 (staleness exactly 1) is returned, then 3."""
    buf = RolloutBuffer(max_size=4, max_staleness=1)
    for v in range(4):
        assert buf.put(f"b{v}", v)
    e = buf.get(3)
    assert e is not None
    assert (e.batch, e.version, e.staleness) == ("b2", 2, 1)
    assert [(d.version, d.current_version, d.staleness) for d in e.dropped] == [(0, 3, 3), (1, 3, 2)]
    e = buf.get(3)
    assert e is not None
    assert (e.batch, e.staleness, e.dropped) == ("b3", 0, ())
    assert [d.version for d in buf.dropped] == [0, 1]
    assert buf.metrics() == {"buffer/size": 0.0, "buffer/dropped_total": 2.0}


def test_everything_stale_times_out_empty():
    buf = RolloutBuffer(max_size=2, max_staleness=0)
    buf.put("old", 0)
    with pytest.raises(TimeoutError):
        buf.get(1, timeout=0.05)
    assert len(buf) == 0 and [d.version for d in buf.dropped] == [0]


def test_refuses_batches_from_the_future_and_backwards_versions():
    buf = RolloutBuffer(max_size=3, max_staleness=2)
    buf.put("b", 5)
    with pytest.raises(ValueError, match="pass get"):
        buf.get(4)
    with pytest.raises(ValueError, match="older than"):
        buf.put("c", 4)
    with pytest.raises(ValueError, match="max_size"):
        RolloutBuffer(max_size=0, max_staleness=0)
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(max_size=1, max_staleness=-1)


def test_bounded_size_holds_and_put_blocks():
    buf = RolloutBuffer(max_size=2, max_staleness=100)
    buf.put(0, 0)
    buf.put(1, 0)
    with pytest.raises(TimeoutError):
        buf.put(2, 0, timeout=0.05)
    sizes = []

    def produce():
        for i in range(2, 12):
            buf.put(i, 0)
            sizes.append(len(buf))

    t = _thread(produce)
    got = []
    for _ in range(12):
        time.sleep(0.002)  # a slower consumer keeps the producer pressed against the bound
        sizes.append(len(buf))
        e = buf.get(0)
        assert e is not None
        got.append(e.batch)
    t.join(2)
    assert got == list(range(12)) and max(sizes) == 2


def test_close_unblocks_waiters():
    full = RolloutBuffer(max_size=1, max_staleness=0)
    full.put("x", 0)
    empty = RolloutBuffer(max_size=1, max_staleness=0)
    store = WeightStore()
    results = {}
    threads = [
        _thread(lambda: results.__setitem__("put", full.put("y", 0))),
        _thread(lambda: results.__setitem__("get", empty.get(0))),
        _thread(lambda: results.__setitem__("wait", store.wait_for(3))),
    ]
    time.sleep(0.05)
    assert not results  # all three are blocked
    for c in (full, empty, store):
        c.close()
    for t in threads:
        t.join(1)
    assert results == {"put": False, "get": None, "wait": None}
    e = full.get(0)
    assert e is not None and e.batch == "x" and full.get(0) is None  # close drains, then ends
    assert full.put("z", 0) is False


def test_weight_store_versions_monotone():
    store = WeightStore()
    with pytest.raises(RuntimeError, match="publish version 0"):
        store.latest()
    store.publish("w0", 0)
    with pytest.raises(ValueError, match="only increase"):
        store.publish("again", 0)
    seen = []
    stop = threading.Event()

    def read():
        while not stop.is_set():
            seen.append(store.latest()[1])

    t = _thread(read)
    for v in range(1, 200):
        store.publish(f"w{v}", v)
    stop.set()
    t.join(1)
    assert seen == sorted(seen) and store.latest() == ("w199", 199)
    assert store.wait_for(150, timeout=0.01) == ("w199", 199)
    with pytest.raises(TimeoutError):
        store.wait_for(200, timeout=0.01)


# A fake engine and trainer: the batch is a function of (weights, seed) only, as the real engine's is of
# (weights, prompts, seeds); an update moves the weights by the batch's mean.
def _engine(weights: torch.Tensor, seed: int, delay: float) -> dict:
    time.sleep(delay)
    g = torch.Generator().manual_seed(seed)
    return {"seed": seed, "weights": weights.clone(), "x": weights + torch.randn(4, generator=g)}


def _update(weights: torch.Tensor, batch: dict, delay: float = 0.0) -> torch.Tensor:
    time.sleep(delay)
    return weights - 0.1 * batch["x"].mean()


def _run_async(steps, max_staleness, *, max_size, engine_delay, train_delay, bounded, prefill=False):
    """Trainer on this thread, producer on another; returns (entries trained, final weights, buffer)."""
    buf, store = RolloutBuffer(max_size=max_size, max_staleness=max_staleness), WeightStore()
    w = torch.zeros(())
    store.publish(w.clone(), 0)
    history = [w.clone()]

    def produce():
        k = 0
        while True:
            if (
                bounded
            ):  # never sample a batch the trainer will refuse: batch k needs version k - max_staleness
                got = store.wait_for(k - max_staleness)
                if got is None:
                    return
                state, v = got
            else:
                state, v = store.latest()
            if not buf.put(_engine(state, k, engine_delay), v):
                return
            k += 1

    t = _thread(produce)
    if prefill:  # start training only once the producer has filled the buffer, so drops are certain
        while len(buf) < max_size:
            time.sleep(0.001)
    trained = []
    for v in range(steps):
        e = buf.get(v, timeout=2)
        assert e is not None
        assert e.staleness <= max_staleness and v - e.version == e.staleness
        assert torch.equal(e.batch["weights"], history[e.version])  # the version names the sampling weights
        trained.append(e)
        w = _update(w, e.batch, train_delay)
        store.publish(w.clone(), v + 1)
        history.append(w.clone())
    buf.close()
    store.close()
    t.join(2)
    assert not t.is_alive()
    return trained, w, buf


def _sync(steps):
    w, trained = torch.zeros(()), []
    for k in range(steps):
        batch = _engine(w, k, 0.0)
        trained.append(batch)
        w = _update(w, batch)
    return trained, w


def test_staleness_zero_is_the_synchronous_loop():
    """With max_staleness 0 the producer waits for version k before sampling batch k, so the trainer trains
    exactly the synchronous loop's batches, in its order, and ends on bit-identical weights."""
    sync_batches, sync_w = _sync(12)
    trained, w, buf = _run_async(12, 0, max_size=2, engine_delay=0.002, train_delay=0.002, bounded=True)
    assert [e.staleness for e in trained] == [0] * 12 and buf.dropped == []
    for e, s in zip(trained, sync_batches):
        assert e.batch["seed"] == s["seed"]
        assert torch.equal(e.batch["x"], s["x"]) and torch.equal(e.batch["weights"], s["weights"])
    assert torch.equal(w, sync_w)


def test_staleness_zero_greedy_producer_trains_only_current_samples():
    """A producer that does not wait runs ahead on old weights; with max_staleness 0 every one of those batches
    is dropped, and each trained batch was sampled by exactly the weights being trained."""
    trained, _, buf = _run_async(
        8, 0, max_size=2, engine_delay=0.001, train_delay=0.005, bounded=False, prefill=True
    )
    assert all(e.staleness == 0 for e in trained)
    assert len(buf.dropped) > 0 and all(d.staleness > 0 for d in buf.dropped)


def test_slow_trainer_forces_staleness_and_drops():
    """Fast engine, slow trainer, max_staleness 1, a greedy producer and a full buffer at the start: the
    producer's version-0 batches outlive version 1, so the trainer drops some and trains on others at staleness
    1; no batch is lost without a record (trained + dropped + waiting = produced, in order)."""
    trained, _, buf = _run_async(
        6, 1, max_size=3, engine_delay=0.001, train_delay=0.01, bounded=False, prefill=True
    )
    assert max(e.staleness for e in trained) == 1
    assert len(buf.dropped) > 0 and all(d.staleness > 1 for d in buf.dropped)
    seeds_trained = [e.batch["seed"] for e in trained]
    assert seeds_trained == sorted(seeds_trained)
    assert (
        len(trained) + len(buf.dropped) == seeds_trained[-1] + 1
    )  # batches 0..last: each trained or dropped


def test_bounded_producer_never_drops():
    """Waiting for version k - max_staleness before sampling batch k keeps every batch within the bound: with
    max_staleness 2 the trainer trains batches 0, 1, 2, ... in order, none dropped, staleness <= 2."""
    trained, _, buf = _run_async(10, 2, max_size=4, engine_delay=0.001, train_delay=0.004, bounded=True)
    assert [e.batch["seed"] for e in trained] == list(range(10)) and buf.dropped == []
    assert max(e.staleness for e in trained) <= 2
