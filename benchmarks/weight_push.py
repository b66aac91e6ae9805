"""The asynchronous mode's weight push alone: trainer rank 0 copies a module's trainable tensors out
(`async_mode.trainable_tensors`) and sends them (`parallel.isend_tensors`); rollout rank 1 receives them
(`parallel.recv_tensors`) and loads them into its copy (`async_mode.load_trainable`). CPU gloo ranks, fp32
parameters in 960 tensors (Qwen-Image's LoRA r64 is 0.42 B in about as many).

    uv run torchrun --nproc-per-node 2 benchmarks/weight_push.py --params 200000000 --iters 6 [--pickled]

--pickled sends the same tensors through `parallel.isend_object` / `recv_object` (torch.save's pickle), the
weights' wire before `isend_tensors`: the baseline.

Prints each push, then the medians after the first (whose pages are new to both processes): the trainer's
`time/push` (copy out and post the sends) and the rollout's wait-receive-load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fgrpo import parallel
from fgrpo.async_mode import load_trainable, trainable_tensors

TENSORS = 960


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=200_000_000, help="trainable parameters in all")
    ap.add_argument("--iters", type=int, default=6, help="pushes; the first is left out of the medians")
    ap.add_argument("--pickled", action="store_true", help="send through isend_object (the baseline)")
    args = ap.parse_args()
    send = parallel.isend_object if args.pickled else parallel.isend_tensors
    recv = parallel.recv_object if args.pickled else parallel.recv_tensors
    parallel.init_distributed("cpu")
    if parallel.world_size() != 2:
        raise SystemExit(
            "weight_push: run it under torchrun --nproc-per-node 2 (a trainer and a rollout rank)"
        )
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(args.params // TENSORS)) for _ in range(TENSORS)]
    )
    pending, times = parallel.Pending(), []
    for i in range(args.iters):
        parallel.barrier()
        t0 = time.perf_counter()
        if parallel.rank() == 0:
            send(trainable_tensors(module), 1, pending)
            times.append(time.perf_counter() - t0)
            pending.wait()
            print(f"push {i}: trainer {times[-1]:.2f} s", flush=True)
        else:
            tensors = recv(0)
            assert isinstance(tensors, dict)
            load_trainable(module, tensors)
            times.append(time.perf_counter() - t0)
            print(f"push {i}: rollout {times[-1]:.2f} s", flush=True)
    side = "trainer (copy out, post)" if parallel.rank() == 0 else "rollout (wait, receive, load)"
    print(f"median {side}: {statistics.median(times[1:]):.2f} s over {args.iters - 1} pushes", flush=True)
    parallel.barrier()
    parallel.shutdown()


if __name__ == "__main__":
    main()
