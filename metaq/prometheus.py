"""Prometheus exporter for consumers and in-process brokers (needs the ``prometheus``
extra: prometheus-client).

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

__all__ = ["BrokerCollector", "ConsumerCollector", "MetricsServer", "serve_metrics"]


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


class BrokerCollector:
    """A prometheus_client collector of in-process brokers' replication state
    (``Broker.replication_status()``): role, epoch, in-sync slaves, each slave's lag
    (on a master) and each partition copy's lag and state (on a slave); and their
    connections (``Broker.connection_stats()``): open, unused, accepted, refused,
    evicted, closed idle, slow or unused."""

    def __init__(self, brokers: Iterable[Any]) -> None:
        self.brokers = list(brokers)

    def collect(self) -> Iterator[Any]:
        lb = ["broker_id", "replica"]
        role = GaugeMetricFamily("metaq_broker_replication_master",
                                 "1 when this broker leads its broker id, else 0", labels=lb)
        epoch = GaugeMetricFamily("metaq_broker_replication_epoch",
                                  "Replication epoch served in", labels=lb)
        in_sync = GaugeMetricFamily("metaq_broker_replication_in_sync_slaves",
                                    "Slaves in sync (a master's count)", labels=lb)
        ls = [*lb, "slave"]
        slave_bytes = GaugeMetricFamily("metaq_broker_replication_slave_lag_bytes",
                                        "How far a slave is behind (worst partition)",
                                        labels=ls)
        slave_secs = GaugeMetricFamily("metaq_broker_replication_slave_lag_seconds",
                                       "How long a slave has not caught up", labels=ls)
        lp = [*lb, "topic", "partition"]
        copy_secs = GaugeMetricFamily("metaq_broker_replication_copy_lag_seconds",
                                      "Seconds since a slave's copy last reached the master's "
                                      "end", labels=lp)
        copy_bad = GaugeMetricFamily("metaq_broker_replication_copy_stopped",
                                     "1 while a partition copy is diverged or stopped",
                                     labels=lp)
        for b in self.brokers:
            st = b.replication_status()
            if st.get("role") is None:
                continue
            lv = [str(b.config.broker_id), str(st["replica"])]
            role.add_metric(lv, 1 if st["role"] == "master" else 0)
            epoch.add_metric(lv, -1 if st["epoch"] is None else st["epoch"])
            if "in_sync" in st:
                in_sync.add_metric(lv, len(st["in_sync"]))
            for sl in st.get("slaves", ()):
                slave_bytes.add_metric([*lv, str(sl["replica"])], sl["lag_bytes"])
                slave_secs.add_metric([*lv, str(sl["replica"])], sl["lag_seconds"])
            for c in st.get("copies", ()):
                key = [*lv, c["topic"], str(c["partition"])]
                if c["lag_seconds"] is not None:
                    copy_secs.add_metric(key, c["lag_seconds"])
                copy_bad.add_metric(key, 1 if c["state"] in ("diverged", "stopped") else 0)
        yield from (role, epoch, in_sync, slave_bytes, slave_secs, copy_secs, copy_bad)
        yield from self._connections()

    def _connections(self) -> Iterator[Any]:
        """The connections of each broker (``Broker.connection_stats``): open, unused,
        and the counts accepted, refused, evicted and closed idle, slow or unused."""
        lb = ["broker_id"]
        open_ = GaugeMetricFamily("metaq_broker_connections", "Client connections open",
                                  labels=lb)
        unused = GaugeMetricFamily("metaq_broker_connections_unused",
                                   "Open connections that have not sent a whole request",
                                   labels=lb)
        counters = {
            "connections_total": ("metaq_broker_connections_accepted",
                                  "Connections accepted (refused ones included)"),
            "connections_refused": ("metaq_broker_connections_refused",
                                    "Connections refused at a limit"),
            "connections_evicted": ("metaq_broker_connections_evicted",
                                    "Unused connections closed to admit a new one"),
            "idle_closed": ("metaq_broker_connections_idle_closed",
                            "Connections closed after idle_timeout"),
            "slow_closed": ("metaq_broker_connections_slow_closed",
                            "Connections closed: a request not whole within request_timeout"),
            "unused_closed": ("metaq_broker_connections_unused_closed",
                              "Connections closed: no request within first_request_timeout"),
        }
        families = {k: CounterMetricFamily(name, text, labels=lb)
                    for k, (name, text) in counters.items()}
        for b in self.brokers:
            st = b.connection_stats()
            lv = [str(b.config.broker_id)]
            open_.add_metric(lv, st["curr_connections"])
            unused.add_metric(lv, st["unused_connections"])
            for k, fam in families.items():
                fam.add_metric(lv, st[k])
        yield open_
        yield unused
        yield from families.values()


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


def serve_metrics(consumers: Iterable[Any] = (), *, host: str = "127.0.0.1", port: int = 0,
                  with_lag: bool = False, brokers: Iterable[Any] = ()) -> MetricsServer:
    """Serve the consumers' (and in-process brokers') metrics at
    ``http://host:port/metrics`` (port 0: any free)."""
    registry = CollectorRegistry()
    registry.register(ConsumerCollector(consumers, with_lag=with_lag))
    brokers = list(brokers)
    if brokers:
        registry.register(BrokerCollector(brokers))
    return MetricsServer(registry, host, port)
