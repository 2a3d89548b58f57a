"""The wire: slices of a graph run by workers in other processes or on other machines.

``Worker`` declares where a host is (``Worker.at("node3:7000")``, a child with
``Worker.generic()``, or a Ray actor with ``Worker.on_ray(num_gpus=1)``);
``Broker.embedded({"w1": worker})`` is what ``forward`` is handed. The worker itself
is ``python -m somatize.worker --listen HOST:PORT``. The frames, the handshake and
every message are described in ``docs/wire.md``.
"""

from __future__ import annotations

from .broker import Broker
from .declare import Worker

__all__ = ["Broker", "Worker"]
