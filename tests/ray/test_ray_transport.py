"""Ray actors (somatize.ray) pass the transport contract."""

import time

import pytest
from transport_contract import TransportContract

from somatize import Worker


class TestRay(TransportContract):
    @pytest.fixture(scope="class")
    @classmethod
    def place(cls, cluster):
        with Worker.on_ray(mode="network", send=["transport_nodes"], num_cpus=0,
                           max_restarts=2) as place:
            yield place

    def restart(self, place):
        import ray

        actor = place.actor("h")
        before = ray.get(actor.ready.remote())["instance"]
        ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # ray.kill only asks: wait for the new one
            try:
                if ray.get(actor.ready.remote(), timeout=60)["instance"] != before:
                    return
            except ray.exceptions.RayActorError:
                pass
            time.sleep(0.05)
        raise AssertionError("Ray did not restart the actor within 60 s")
