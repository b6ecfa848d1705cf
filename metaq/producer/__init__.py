"""The producer: :class:`Producer`, its :class:`ProducerConfig`, :class:`SendResult`
and (from ``Producer.send_batch``) :class:`BatchResults`."""

from metaq.producer._config import ProducerConfig
from metaq.producer._producer import BatchResults, Producer, SendResult

__all__ = ["BatchResults", "Producer", "ProducerConfig", "SendResult"]
