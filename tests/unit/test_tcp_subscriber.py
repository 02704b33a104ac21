"""The tcp channel's subscriber handle rides out its weight server's restart: while the trainer
restarts in place (its server is gone), an engine sees nothing newer instead of failing, and
once a server is back on the same port it gets the new versions; an outage longer than
`outage_s` is an error."""

from __future__ import annotations

import pickle

import pytest
import torch

import streamrl.weights.remote as remote
from streamrl.weights.remote import TcpPublisher, TcpSubscriber
from streamrl.weights.tcp import TcpWeightServer


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def test_subscriber_waits_out_a_restarted_server(monkeypatch):
    monkeypatch.setattr(remote, "RECONNECT_S", 0.0)
    first = TcpWeightServer(token="t")
    port = first.address[1]
    first.publish(3, weights(3.0))
    subscriber = pickle.loads(pickle.dumps(TcpSubscriber("127.0.0.1", port, "t")))
    version, tensors = subscriber.fetch_newer(-1)
    assert version == 3 and tensors["w"][0] == 3.0

    first.close()  # the trainer's process died
    assert subscriber.fetch_newer(3) is None
    assert subscriber.latest_version() == 3  # the last version seen

    publisher = TcpPublisher("127.0.0.1", port, "t")  # the restarted trainer: the same port
    publisher.publish(1, weights(1.0))  # resumed from an older checkpoint: nothing newer
    assert subscriber.fetch_newer(3) is None
    assert subscriber.latest_version() == 1
    publisher.publish(4, weights(4.0))
    version, tensors = subscriber.fetch_newer(3)
    assert version == 4 and tensors["w"][0] == 4.0
    publisher._server.close()


def test_a_long_outage_is_an_error(monkeypatch):
    monkeypatch.setattr(remote, "RECONNECT_S", 0.0)
    server = TcpWeightServer()
    port = server.address[1]
    server.close()
    subscriber = TcpSubscriber("127.0.0.1", port, None, outage_s=0.0)
    assert subscriber.fetch_newer(-1) is None  # the outage starts
    with pytest.raises(ConnectionError, match="unreachable for"):
        subscriber.fetch_newer(-1)
