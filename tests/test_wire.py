"""The asynchronous mode's weight wire: `parallel.isend_tensors` / `recv_tensors` between 2 gloo ranks.

The worker (this file run under torchrun) sends, from rank 0 to rank 1, (a) `async_mode.trainable_tensors` of a
module with fp32 and bf16 parameters, one of them empty and one frozen, and (b) tensors that do not tile one
buffer (the concatenating path). Rank 1 rebuilds the same module from the same seed and writes what it received
and what it expected; rank 0 writes whether (a) went out without a copy.
"""

import os
import subprocess
import sys

import torch

from fgrpo import parallel
from fgrpo.async_mode import trainable_tensors

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(3, 5))
    m.b = torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
    m.empty = torch.nn.Parameter(torch.zeros(0, 4))
    m.frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    m.c = torch.nn.Parameter(torch.randn(2, 2, 2))
    return m


def _loose() -> dict[str, torch.Tensor]:
    """Tensors of two dtypes that share no buffer: a view with a stride, a bf16 scalar."""
    base = torch.arange(12.0).view(3, 4)
    return {"t": base.t(), "s": torch.tensor(2.5, dtype=torch.bfloat16), "row": base[1]}


def _worker(out_path: str) -> None:
    parallel.init_distributed("cpu")
    m, pending = _module(), parallel.Pending()
    if parallel.rank() == 0:
        sent, a = trainable_tensors(m), m.get_parameter("a")
        with torch.no_grad():
            a.add_(1.0)  # the copies must not follow the module
        parallel.isend_tensors(sent, 1, pending)
        fp32_ptr = sent["a"].untyped_storage().data_ptr()
        no_copy = any(b.untyped_storage().data_ptr() == fp32_ptr for b in pending.buffers)
        parallel.isend_tensors(_loose(), 1, pending)
        pending.wait()
        torch.save({"no_copy": no_copy, "a_moved": bool((sent["a"] != a).all())}, out_path + ".0")
    else:
        got, loose = parallel.recv_tensors(0), parallel.recv_tensors(0)
        want = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
        torch.save({"got": got, "want": want, "loose": loose, "loose_want": _loose()}, out_path + ".1")
    parallel.barrier()
    parallel.shutdown()


def test_weights_cross_the_wire_bit_for_bit_without_pickling_their_data(tmp_path):
    out = str(tmp_path / "wire")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(29700 + os.getpid() % 1000), __file__, out]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r0, r1 = torch.load(out + ".0"), torch.load(out + ".1")
    assert r0 == {"no_copy": True, "a_moved": True}
    assert list(r1["got"]) == ["a", "b", "empty", "c"]  # the trainable ones, in the module's order
    for name, want in r1["want"].items():
        got = r1["got"][name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert list(r1["loose"]) == ["t", "s", "row"]
    for name, want in r1["loose_want"].items():
        got = r1["loose"][name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


if __name__ == "__main__":
    _worker(sys.argv[1])
