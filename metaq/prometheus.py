"""Prometheus exporter for consumers (needs the ``prometheus`` extra: prometheus-client).

::

    from metaq.prometheus import serve_metrics
    server = serve_metrics([consumer], port=9464)   # GET http://host:9464/metrics
    ...
    server.close()

Every scrape reads ``consumer.metrics()``; with ``with_lag=True`` it also asks
the brokers for log ends (one ``offset`` request per partition per scrape).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import make_wsgi_app
    from prometheus_client.registry import CollectorRegistry
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("metaq.prometheus needs prometheus-client: "
                      "pip install 'metaq-py[prometheus]'") from e

from wsgiref.simple_server import WSGIRequestHandler, make_server

__all__ = ["ConsumerCollector", "MetricsServer", "serve_metrics"]


class ConsumerCollector:
    """A prometheus_client collector over one or more consumers."""

    def __init__(self, consumers: Iterable[Any], *, with_lag: bool = False) -> None:
        self.consumers = list(consumers)
        self.with_lag = with_lag

    def collect(self) -> Iterator[Any]:
        labels = ["group", "consumer_id"]
        messages = CounterMetricFamily("metaq_consumer_messages", "Messages delivered",
                                       labels=labels)
        rebalances = CounterMetricFamily("metaq_consumer_rebalances", "Rebalances run",
                                         labels=labels)
        rejected = CounterMetricFamily("metaq_consumer_rejected", "Messages given up on",
                                       labels=labels)
        store = GaugeMetricFamily("metaq_consumer_recover_store_size",
                                  "Messages waiting in the recover store", labels=labels)
        owned = GaugeMetricFamily("metaq_consumer_partitions", "Partitions owned", labels=labels)
        pl = [*labels, "partition"]
        position = GaugeMetricFamily("metaq_consumer_position", "Next offset to deliver",
                                     labels=pl)
        committed = GaugeMetricFamily("metaq_consumer_committed", "Last committed offset",
                                      labels=pl)
        lag = GaugeMetricFamily("metaq_consumer_lag", "Log end minus position (bytes)",
                                labels=pl)
        lag_seconds = GaugeMetricFamily(
            "metaq_consumer_lag_seconds",
            "Age of the oldest unconsumed message (now minus its msgId time; 0 caught up)",
            labels=pl)
        for c in self.consumers:
            m = c.metrics(with_lag=self.with_lag)
            lv = [m["group"], m["consumer_id"]]
            messages.add_metric(lv, m["messages"])
            rebalances.add_metric(lv, m["rebalances"])
            rejected.add_metric(lv, m["rejected"])
            store.add_metric(lv, m["recover_store_size"])
            owned.add_metric(lv, len(m["partitions"]))
            for part, p in m["partitions"].items():
                position.add_metric([*lv, part], p["position"])
                committed.add_metric([*lv, part], p["committed"])
                if p.get("lag") is not None:
                    lag.add_metric([*lv, part], p["lag"])
                if p.get("lag_seconds") is not None:
                    lag_seconds.add_metric([*lv, part], p["lag_seconds"])
        yield from (messages, rebalances, rejected, store, owned, position, committed, lag,
                    lag_seconds)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class MetricsServer:
    """An HTTP server on a named thread serving ``/metrics``; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd = make_server(host, port, make_wsgi_app(registry), handler_class=_Quiet)
        self.port = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name=f"metaq-prometheus-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(consumers: Iterable[Any], *, host: str = "127.0.0.1", port: int = 0,
                  with_lag: bool = False) -> MetricsServer:
    """Serve the consumers' metrics at ``http://host:port/metrics`` (port 0: any free)."""
    registry = CollectorRegistry()
    registry.register(ConsumerCollector(consumers, with_lag=with_lag))
    return MetricsServer(registry, host, port)
