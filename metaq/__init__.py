"""metaq: ZooKeeper-coordinated consumer groups, broker and producer compatible with Metaq 1.4."""

from metaq._errors import *  # noqa: F403
from metaq._errors import __all__ as _errors_all
from metaq._zkclient import ZkSecurity
from metaq.consumer import ConsumerConfig, Message, MessageConsumer, Rewind
from metaq.producer import Producer, ProducerConfig, SendResult

__version__ = "0.1.0"

__all__ = [*_errors_all, "MessageConsumer", "ConsumerConfig", "Message", "Rewind",
           "Producer", "ProducerConfig", "SendResult", "ZkSecurity", "__version__"]
