"""How this process shares the machine's cores with a worker it starts beside it.

The wire gives such a child half the cores (``wire.declare.sharing_cores``); this is
the other half of that bargain, here where torch is: the process keeps the rest, as
torchrun sets one thread per process where several share a machine. A count the user
chose (``OMP_NUM_THREADS``, or ``torch.set_num_threads`` below the share) is theirs:
the wire does not call this then, and a lower count is never raised.
"""

from __future__ import annotations

import torch


def keep(threads: int) -> None:
    """Lowers this process's torch threads to ``threads``, where it holds more."""
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
