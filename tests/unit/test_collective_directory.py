"""The bookkeeping of the collective channel's directory actor (run here as a plain object):
which members are alive, which version is tagged with which group epoch. The channel itself
runs in tests/integration/test_collective_channel.py."""

from __future__ import annotations

import time

from streamrl.weights.collective_channel import _DirectoryActor


def directory() -> _DirectoryActor:
    return _DirectoryActor()  # its versions come with no buckets here: no object store needed


def test_only_newer_versions_are_held_and_a_failed_broadcast_untags():
    d = directory()
    assert d.set_tagged(3, [], epoch=1)
    assert d.state() == (3, 1)
    assert not d.set_tagged(3, [], epoch=None)  # a resumed trainer replaying a step
    assert not d.set_tagged(2, [], epoch=None)
    d.untag(2)  # an older version: no effect
    assert d.state() == (3, 1)
    d.untag(3)
    assert d.state() == (3, None)


def test_members_are_alive_while_they_heartbeat_and_see_the_announced_epoch():
    d = directory()
    assert d.heartbeat("10.0.0.1:7:a", "10.0.0.1") is None
    d.heartbeat("10.0.0.2:8:b", "10.0.0.2")
    record = {"epoch": d.new_epoch(), "ranks": {"10.0.0.1:7:a": 1}}
    d.announce(record)
    assert d.heartbeat("10.0.0.1:7:a", "10.0.0.1") == record
    assert d.live_members(5.0, None) == ["10.0.0.1:7:a", "10.0.0.2:8:b"]
    assert d.live_members(5.0, "10.0.0.2") == ["10.0.0.2:8:b"]  # loopback: the trainer's node
    d.members["10.0.0.2:8:b"] = ("10.0.0.2", time.monotonic() - 6.0)  # silent for 6 s
    assert d.live_members(5.0, None) == ["10.0.0.1:7:a"]
    assert d.new_epoch() == 2


class FakeDirectory:
    """The directory's client, in process, with a fixed set of live members."""

    def __init__(self, members):
        self.actor = directory()
        self.members = members

    def publish_tagged(self, version, named_tensors, epoch):
        return self.actor.set_tagged(version, [], epoch)

    def call(self, method, *args):
        if method == "live_members":
            return self.members
        return getattr(self.actor, method)(*args)


class BrokenSender:
    def publish(self, version, named_tensors):
        raise RuntimeError("Connection reset by peer")

    def close(self, wait_s):
        pass


def test_a_failed_broadcast_falls_back_to_the_host_copy(monkeypatch):
    import ray

    from streamrl.weights import collective_channel as cc

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    fake = FakeDirectory(["10.0.0.1:7:a"])
    sender = cc._GroupSender(fake, "127.0.0.1", 0, timeout_s=1.0)
    sender.group = cc._Epoch(1, ("10.0.0.1:7:a",), BrokenSender())  # a live group of one
    sender.publish(5, {})
    assert fake.actor.state() == (5, None)  # held, untagged: engines take it from the host copy
    assert sender.group is None
    sender.publish(4, {})  # not newer (a resumed trainer replaying): neither held nor broadcast
    assert fake.actor.state() == (5, None)
