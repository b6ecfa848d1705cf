"""metaq: ZooKeeper-coordinated consumer groups, broker and producer compatible with Metaq 1.4."""

from metaq._errors import *  # noqa: F403
from metaq._errors import __all__ as _errors_all
from metaq._zkclient import ZkSecurity
from metaq.consumer import RECONSUME_LATER, ConsumerConfig, Message, MessageConsumer, Rewind
from metaq.producer import (
    BatchResults,
    LocalTransaction,
    Producer,
    ProducerConfig,
    SendResult,
    XAResource,
    Xid,
)

__version__ = "0.1.0"

__all__ = [*_errors_all, "MessageConsumer", "ConsumerConfig", "Message", "Rewind",
           "RECONSUME_LATER", "Producer", "ProducerConfig", "SendResult", "BatchResults",
           "LocalTransaction", "XAResource", "Xid",
           "ZkSecurity", "__version__"]
