"""One compute thread per test process.

pytest-xdist runs one worker per core, and each process the tests start (ranks, experiments, benchmarks)
shares those cores with both workers. torch's default of one thread per core in every one of them
oversubscribes the machine, and OpenMP's spinning threads then run several times slower than one thread
each. The environment variable reaches every subprocess; the call sets this process's pool.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
