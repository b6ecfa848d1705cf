"""The producer: :class:`Producer`, its :class:`ProducerConfig` and :class:`SendResult`."""

from metaq.producer._config import ProducerConfig
from metaq.producer._producer import Producer, SendResult

__all__ = ["Producer", "ProducerConfig", "SendResult"]
