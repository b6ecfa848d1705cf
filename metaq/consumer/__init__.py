"""Consumer side of metaq: ZooKeeper-coordinated consumer groups."""

from metaq.consumer._assignors import STRATEGIES, Strategy, get_strategy
from metaq.consumer._concurrent import RECONSUME_LATER
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._consumer import MessageConsumer
from metaq.consumer._coordinator import State
from metaq.consumer._message import Message
from metaq.consumer._processor import Rewind

__all__ = [
    "MessageConsumer",
    "ConsumerConfig",
    "Message",
    "Rewind",
    "RECONSUME_LATER",
    "State",
    "Strategy",
    "STRATEGIES",
    "get_strategy",
]
