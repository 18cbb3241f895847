"""The names of the KV transports, without importing them: the command line offers these as
choices without loading torch. `kvtransfer.transport.register` refuses any other name."""

from __future__ import annotations

# gloo and nccl: kvtransfer/torch_dist.py; ipc: kvtransfer/ipc.py; ucx*: kvtransfer/ucx.py
# (needs the ucxx package).
TRANSPORT_NAMES = ("gloo", "nccl", "ipc", "ucx", "ucx-shm", "ucx-tcp")
