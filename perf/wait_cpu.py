"""CPU time a rank spends waiting for a peer that arrives 5 s late (mpiexec -n 2 python perf/wait_cpu.py)."""
import os
import time

import numpy as np
from mpi4py import MPI

import giftcomm as gc

comm = MPI.COMM_WORLD
x = np.ones(1 << 20, np.float32)
gc.allreduce(x, comm=comm)  # transport + window set up
if comm.rank == 1:
    time.sleep(5)
c0, w0 = time.process_time(), time.monotonic()
gc.allreduce(x, comm=comm)
c1, w1 = time.process_time(), time.monotonic()
if comm.rank == 0:
    print(f"{os.environ.get('PYTHONPATH', 'new')}: rank 0 waited {w1 - w0:.2f} s using {c1 - c0:.3f} s CPU "
          f"({100 * (c1 - c0) / (w1 - w0):.1f}%)", flush=True)
