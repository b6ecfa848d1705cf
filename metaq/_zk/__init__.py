"""The embedded real ZooKeeper: find java and the jars, run a server or a 3-node ensemble.

A :class:`ZooKeeperServer` runs ``org.apache.zookeeper.server.quorum.QuorumPeerMain`` in its
own JVM with jars found by :func:`find_zookeeper_classpath` ($ZOOKEEPER_HOME, Debian's
``zookeeper`` package, or the pyspark wheel).  ``metaq zk start|stop|status`` drives the
same code from the command line.
"""

from metaq._zk._classpath import (
    DEBIAN_JAVA_DIR,
    PYSPARK_JAR_PREFIXES,
    find_java,
    find_zookeeper_classpath,
    pyspark_jars_dir,
)
from metaq._zk._ensemble import ZooKeeperEnsemble, wait_for_quorum
from metaq._zk._launcher import ZooKeeperServer
from metaq._zk._process import four_letter_word, free_port, server_mode
from metaq._zk._proxy import ZkProxy
from metaq._zk._state import ZooKeeperConfig, ZooKeeperStatus, status, stop

__all__ = [
    "DEBIAN_JAVA_DIR",
    "PYSPARK_JAR_PREFIXES",
    "ZooKeeperConfig",
    "ZooKeeperEnsemble",
    "ZooKeeperServer",
    "ZooKeeperStatus",
    "ZkProxy",
    "find_java",
    "find_zookeeper_classpath",
    "four_letter_word",
    "free_port",
    "pyspark_jars_dir",
    "server_mode",
    "status",
    "stop",
    "wait_for_quorum",
]
