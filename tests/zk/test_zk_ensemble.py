"""A 3-node real ZooKeeper ensemble: losing the leader keeps the service writable."""

from __future__ import annotations

import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, SessionExpiredError

import metaq
from metaq._zk import ZooKeeperEnsemble, four_letter_word
from metaq.testing import wait_until


def _try_create(client: KazooClient, path: str, value: bytes) -> bool:
    try:
        client.create(path, value, makepath=True)
        return True
    except (ConnectionLoss, SessionExpiredError):
        return False


def test_ensemble_ports_and_modes(zk_ensemble: ZooKeeperEnsemble) -> None:
    hosts = zk_ensemble.hosts.split(",")
    assert len(hosts) == 3 and len(set(hosts)) == 3
    leader = zk_ensemble.wait_quorum(timeout=30)
    modes = [zk_ensemble.mode(i) for i in range(3)]
    assert modes.count("leader") == 1 and modes.count("follower") == 2
    assert zk_ensemble.leader() == leader
    for i in range(3):
        host, port = zk_ensemble.node_hosts(i).rsplit(":", 1)
        assert four_letter_word(host, int(port), "ruok") == "imok"


def test_leader_loss_then_rejoin(zk_ensemble: ZooKeeperEnsemble) -> None:
    base = f"/ensemble/{uuid.uuid4().hex[:6]}"
    old_leader = zk_ensemble.wait_quorum(timeout=30)
    client = KazooClient(hosts=zk_ensemble.hosts, timeout=10.0)
    client.start(timeout=15)
    try:
        client.create(f"{base}/before", b"1", makepath=True)

        zk_ensemble.stop_node(old_leader)
        try:
            assert zk_ensemble.mode(old_leader) is None
            new_leader = zk_ensemble.wait_quorum(timeout=30)
            assert new_leader != old_leader
            # The two remaining members form a quorum: writes go through.
            wait_until(lambda: _try_create(client, f"{base}/during", b"2"), timeout=30,
                       what="a write to succeed with the old leader down")
            assert client.get(f"{base}/before")[0] == b"1"
        finally:
            zk_ensemble.start_node(old_leader)

        assert zk_ensemble.mode(old_leader) in ("follower", "leader")
        # The restarted member caught up with what was written while it was away.
        direct = KazooClient(hosts=zk_ensemble.node_hosts(old_leader), timeout=10.0)
        direct.start(timeout=15)
        try:
            direct.sync(base)
            assert direct.get(f"{base}/during")[0] == b"2"
            assert sorted(direct.get_children(base)) == ["before", "during"]
        finally:
            direct.stop()
            direct.close()
        zk_ensemble.wait_quorum(timeout=30)
    finally:
        client.stop()
        client.close()


def test_ensemble_size_is_validated() -> None:
    with pytest.raises(metaq.ConfigError, match="size"):
        ZooKeeperEnsemble(0)
