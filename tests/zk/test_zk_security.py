"""ZooKeeper digest credentials and ACLs: strangers can read (when allowed) but never change."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from metaq import ConfigError, MessageConsumer, ZkSecurity
from metaq.consumer import State
from metaq.testing import wait_until
from zk_layout import Layout, TopicBroker, encode_topic_broker

pytestmark = pytest.mark.broker

L = Layout()


def _publish(client):
    client.create(L.topic_sub("t", 0), encode_topic_broker(TopicBroker(num_parts=2,
                                                                       broker_id=0)),
                  makepath=True)


@pytest.mark.parametrize("mode", ["creator-read", "creator"])
def test_group_nodes_refuse_unauthenticated_changes(zk_connect, zk_client, mode):
    _publish(zk_client)
    sec = ZkSecurity(auth="app:s3cret", acl=mode)
    with MessageConsumer("secure", zk_connect, consumer_id="a", zk_security=sec) as c:
        c.subscribe("t", lambda m: None)
        c.start()
        wait_until(lambda: c.state is State.STABLE and len(c.assignment().get("t", [])) == 2,
                   timeout=20, what="secured consumer settled")
        owner = L.owner("secure", "t", "0-0")
        member = L.consumer_id("secure", c.consumer_id)
        stranger = KazooClient(hosts=zk_connect)
        intruder = KazooClient(hosts=zk_connect, auth_data=[("digest", "app:wrong")])
        stranger.start(timeout=20)
        intruder.start(timeout=20)
        try:
            for client in (stranger, intruder):
                if mode == "creator-read":
                    assert client.get(owner)[0] == c.consumer_id.encode()
                    assert client.get_children(L.consumer_ids("secure")) == [c.consumer_id]
                else:
                    with pytest.raises(NoAuthError):
                        client.get(owner)
                with pytest.raises(NoAuthError):
                    client.set(owner, b"secure_thief")
                with pytest.raises(NoAuthError):
                    client.delete(member)
                with pytest.raises(NoAuthError):
                    client.create(L.owner("secure", "t", "0-9"), b"x")
                with pytest.raises(NoAuthError):
                    client.create(L.consumer_id("secure", "secure_rogue"), b"t",
                                  ephemeral=True)
            # the shared parents stay open: other groups and brokers can still register
            stranger.create(L.consumer_id("other", "other_x"), b"t", makepath=True,
                            ephemeral=True)
        finally:
            stranger.stop()
            intruder.stop()
    # the rightful member left cleanly (seen with its credential: "creator" hides it)
    zk_client.add_auth("digest", "app:s3cret")
    assert zk_client.get_children(L.consumer_ids("secure")) == []
    assert zk_client.get_children(L.owners_dir("secure", "t")) == []


def test_security_config_is_validated():
    with pytest.raises(ConfigError, match="user:password"):
        ZkSecurity(auth="nopassword")
    with pytest.raises(ConfigError, match="needs a credential"):
        ZkSecurity(acl="creator")
    with pytest.raises(ConfigError, match="acl"):
        ZkSecurity(auth="a:b", acl="closed")
    with pytest.raises(ConfigError, match="tls"):
        ZkSecurity(ca_file="/x.pem")
    kw = ZkSecurity(tls=True, ca_file="/ca.pem", auth="a:b").client_kwargs()
    assert kw["use_ssl"] is True and kw["ca"] == "/ca.pem" and kw["auth_data"] == [
        ("digest", "a:b")]


def test_secured_broker_protects_its_nodes_and_leaves_shared_dirs_open(zk_connect, tmp_path):
    from metaq.broker import Broker, BrokerConfig
    from metaq.testing import free_port

    def broker(bid, auth):
        return Broker(BrokerConfig(broker_id=bid, data_dir=tmp_path / f"b{bid}",
                                   port=free_port(), topics={"t": 1}, zk_connect=zk_connect,
                                   zk_security=ZkSecurity(auth=auth, acl="creator-read")))

    with broker(0, "ops0:pw0"), broker(1, "ops1:pw1"):  # different credentials, same topic
        stranger = KazooClient(hosts=zk_connect)
        stranger.start(timeout=20)
        try:
            assert sorted(stranger.get_children(L.topic_sub_dir("t"))) == ["0-m", "1-m"]
            assert stranger.get(L.broker_master(0))[0].startswith(b"meta://127.0.0.1:")
            for path in (L.broker_master(0), L.topic_pub("t", 1), L.broker_id(0),
                         L.replication(0)):  # the fence between masters too
                with pytest.raises(NoAuthError):
                    stranger.set(path, b"meta://evil:1")
                with pytest.raises(NoAuthError):
                    stranger.delete(path, recursive=False)
        finally:
            stranger.stop()
