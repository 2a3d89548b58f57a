"""The socket transport (somatize.wire.client and a worker started from the command
line) passes the transport contract."""

import pytest
from transport_contract import TransportContract
from wire_helpers import TOKEN, Standing

from somatize import Worker


class TestSocket(TransportContract):
    @pytest.fixture(scope="class")
    @classmethod
    def place(cls, tmp_path_factory):
        log = tmp_path_factory.mktemp("socket") / "worker.log"
        cls.standing = Standing(log)
        with Worker.at(cls.standing.addr, mode="network", send=["transport_nodes"],
                       token=TOKEN) as place:
            yield place
        cls.standing.stop()

    def restart(self, place):
        old = type(self).standing
        old.stop()
        type(self).standing = Standing(old.log_path, listen=f"127.0.0.1:{old.port}")
