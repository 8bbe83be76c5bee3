"""A real three-node JetStream cluster on loopback, for the cluster tests and chaos.

:class:`NatsCluster` runs ``size`` ``nats-server`` processes (the binary that
:func:`tests.harness.nats_server.find_nats_server` finds), each with its own client, route and
monitoring ports (free loopback ports), its own JetStream store directory and its own
config file, routed to each other under one cluster name. :meth:`NatsCluster.start`
returns once every node answers and the JetStream meta group has a leader.

Each node is a :class:`ClusterNode`, a :class:`~tests.harness.nats_server.NatsServer` that can
be stopped, killed, paused (``SIGSTOP``), resumed and restarted on the same ports and
store. The helpers answer the questions a fault scenario asks:

* :meth:`NatsCluster.stream_leader`: which node leads a KV bucket's stream (from the
  monitoring port's ``/jsz``; the JetStream API would need a leader to answer);
* :meth:`NatsCluster.node_of_pid` / :meth:`NatsCluster.node_of_ports`: which node a
  client process (or a client socket of this process) is connected to, from the nodes'
  ``/connz`` and the process's sockets in ``/proc``.

Synchronous, like :mod:`tests.harness.nats_server` (``subprocess``, blocking sockets and HTTP
with short timeouts), so pytest fixtures and chaos drivers outside Trio can use them.
The ``nats_cluster`` fixture (import it into a test module, or use
:func:`running_cluster`) starts one cluster per test and terminates it at teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.nats_server import START_TIMEOUT, NatsServer, free_port

#: Seconds the meta group may take to elect a leader after the nodes start.
META_LEADER_TIMEOUT = 20.0


class ClusterNode(NatsServer):
    """One node of a :class:`NatsCluster`: a :class:`NatsServer` started from a
    config file that names the node, its route listener and the routes to its peers.

    Args:
      name (str): the node's ``server_name`` (``n1``, ``n2``, ...).
      base_dir (Path): where its store directory, config file and log go.
      cluster_name (str): the cluster's name (the same on every node).
    """

    def __init__(self, name: str, base_dir: Path, *, cluster_name: str) -> None:
        super().__init__(base_dir / f"js-{name}")
        self.name = name
        self.cluster_name = cluster_name
        self.cluster_port = free_port()
        self.monitor_port = free_port()
        self.routes: list[int] = []
        self.config_file = base_dir / f"{name}.conf"
        self._log = base_dir / f"nats-{name}.log"

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("up" if self.proc is not None else "down")
        return f"<ClusterNode {self.name} :{self.port} {state}>"

    def _write_config(self) -> None:
        routes = "\n".join(f"    nats-route://127.0.0.1:{port}" for port in self.routes)
        self.config_file.write_text(
            f"server_name: {self.name}\n"
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f'jetstream {{\n  store_dir: "{self.store_dir}"\n}}\n'
            f"cluster {{\n  name: {self.cluster_name}\n"
            f"  listen: 127.0.0.1:{self.cluster_port}\n"
            f"  routes: [\n{routes}\n  ]\n}}\n"
        )

    def launch(self) -> None:
        """Start the process without waiting for it (see :meth:`wait_ready`)."""
        if self.proc is not None:
            raise RuntimeError(f"node {self.name} already running")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        args = [self.binary, "-c", str(self.config_file), "-l", str(self._log)]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self.paused = False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the node answers a JetStream request.

        Raises:
          RuntimeError: the node exited, or did not answer within ``timeout`` seconds
            (the message holds its log's tail).
        """
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"node {self.name} exited with {code}:\n{self._log_tail()}")
            if self._jetstream_answers():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"node {self.name} did not answer within {timeout} s:\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def start(self) -> None:
        """Start the process and wait until it answers JetStream requests."""
        self.launch()
        self.wait_ready()

    def monitor(self, path: str, timeout: float = 2.0) -> dict[str, Any]:
        """GET ``path`` (``/jsz?...``, ``/connz``, ...) from the monitoring port.

        Raises:
          OSError: the node did not answer within ``timeout`` seconds (it is down or
            paused).
        """
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data: dict[str, Any] = json.load(response)
                return data
        except urllib.error.HTTPError as exc:
            # Closed here: it holds the reply's body (a ResourceWarning on 3.14).
            exc.close()
            raise OSError(f"{url}: HTTP {exc.code} {exc.reason}") from None

    def client_ports(self) -> set[int]:
        """The remote (client-side) ports of the node's client connections."""
        connz = self.monitor("/connz?limit=1024")
        return {int(c["port"]) for c in connz.get("connections") or []}


class NatsCluster:
    """``size`` routed ``nats-server`` nodes with JetStream, on 127.0.0.1.

    Args:
      base_dir (Path): a directory of its own (store dirs, configs, logs).
      size (int): the number of nodes (3 by default; JetStream needs a majority).
      name (str): the cluster's name.
    """

    def __init__(self, base_dir: Path, *, size: int = 3, name: str = "debounce") -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.nodes = [ClusterNode(f"n{i + 1}", base_dir, cluster_name=name) for i in range(size)]
        for node in self.nodes:
            node.routes = [peer.cluster_port for peer in self.nodes if peer is not node]

    @property
    def urls(self) -> tuple[str, ...]:
        """Every node's client URL (for ``NatsConfig(servers=...)``)."""
        return tuple(node.url for node in self.nodes)

    def node(self, name: str) -> ClusterNode:
        """The node called ``name`` (``n1``, ...)."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in {[n.name for n in self.nodes]}")

    def up(self) -> list[ClusterNode]:
        """The nodes running and not paused."""
        return [n for n in self.nodes if n.proc is not None and not n.paused]

    def start(self, *, meta_leader: bool = True) -> None:
        """Start every node and wait for each to answer and (unless ``meta_leader`` is
        False: a freshly started cluster, still forming) for a meta leader.

        Raises:
          RuntimeError: a node did not start, or no meta leader within
            :data:`META_LEADER_TIMEOUT` seconds.
        """
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready()
            if meta_leader:
                self.wait_meta_leader()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate every node (resuming paused ones first); never raises."""
        for node in self.nodes:
            try:
                node.stop(timeout=5.0)
            except (OSError, RuntimeError, subprocess.SubprocessError):
                node.kill()

    def meta_leader(self) -> str | None:
        """The meta group leader's name, as the first live node that knows one says."""
        for node in self.up():
            try:
                meta = node.monitor("/jsz").get("meta_cluster") or {}
            except (OSError, ValueError):
                continue
            leader = meta.get("leader")
            if leader:
                return str(leader)
        return None

    def wait_meta_leader(self, timeout: float = META_LEADER_TIMEOUT) -> str:
        """Wait until the meta group has a leader; return its name.

        Raises:
          RuntimeError: none within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            leader = self.meta_leader()
            if leader is not None:
                return leader
            if time.monotonic() > deadline:
                raise RuntimeError(f"no JetStream meta leader within {timeout} s")
            time.sleep(0.1)

    def stream_detail(self, node: ClusterNode, bucket: str) -> dict[str, Any] | None:
        """The KV bucket's stream (``KV_<bucket>``) as ``node``'s ``/jsz`` shows it
        (with its ``cluster`` block: ``leader``, ``replicas``); None when the node
        does not answer or hosts no replica."""
        try:
            jsz = node.monitor("/jsz?streams=true")
        except (OSError, ValueError):
            return None
        for account in jsz.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") == f"KV_{bucket}":
                    return dict(detail)
        return None

    def stream_leader(self, bucket: str) -> ClusterNode | None:
        """The node leading the KV bucket's stream, or None while it has none
        (during an election, or without quorum). Only a node that says it leads
        counts: a follower may still name a lost leader."""
        for node in self.up():
            detail = self.stream_detail(node, bucket) or {}
            if (detail.get("cluster") or {}).get("leader") == node.name:
                return node
        return None

    def wait_stream_leader(self, bucket: str, timeout: float = META_LEADER_TIMEOUT) -> ClusterNode:
        """Wait until the bucket's stream has a leader; return it.

        Raises:
          RuntimeError: none within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            leader = self.stream_leader(bucket)
            if leader is not None:
                return leader
            if time.monotonic() > deadline:
                raise RuntimeError(f"stream KV_{bucket} has no leader after {timeout} s")
            time.sleep(0.1)

    def wait_stream_current(self, bucket: str, timeout: float = META_LEADER_TIMEOUT) -> ClusterNode:
        """Wait until the bucket's stream has a leader that sees every other node's
        replica current (caught up); return the leader.

        Raises:
          RuntimeError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            leader = self.stream_leader(bucket)
            if leader is not None:
                detail = self.stream_detail(leader, bucket) or {}
                replicas = (detail.get("cluster") or {}).get("replicas") or []
                if len(replicas) == len(self.nodes) - 1 and all(r.get("current") for r in replicas):
                    return leader
            if time.monotonic() > deadline:
                raise RuntimeError(f"stream KV_{bucket} not current after {timeout} s")
            time.sleep(0.1)

    def node_of_ports(self, ports: set[int]) -> ClusterNode | None:
        """The live node that one of the client-side ``ports`` is connected to."""
        for node in self.up():
            try:
                if node.client_ports() & ports:
                    return node
            except (OSError, ValueError):
                continue
        return None

    def node_of_pid(self, pid: int) -> ClusterNode | None:
        """The live node a client process ``pid`` is connected to (its first
        connection found), from its sockets in ``/proc``; None when none is."""
        return self.node_of_ports(local_ports(pid))


_SOCKET = re.compile(r"socket:\[(\d+)\]")


def local_ports(pid: int) -> set[int]:
    """The local ports of ``pid``'s IPv4 TCP sockets on 127.0.0.1 (Linux ``/proc``)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return set()
    for fd in fds:
        try:
            match = _SOCKET.fullmatch(os.readlink(fd))
        except OSError:
            continue
        if match:
            inodes.add(match.group(1))
    ports = set()
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return set()
    for line in lines:
        fields = line.split()
        if len(fields) > 9 and fields[9] in inodes:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@contextlib.contextmanager
def running_cluster(
    base_dir: Path, *, size: int = 3, meta_leader: bool = True
) -> Iterator[NatsCluster]:
    """A started cluster of ``size`` nodes under ``base_dir``, terminated on exit
    (``meta_leader``: see :meth:`NatsCluster.start`)."""
    cluster = NatsCluster(base_dir, size=size)
    cluster.start(meta_leader=meta_leader)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A started three-node JetStream cluster; every node is terminated at teardown."""
    with running_cluster(tmp_path / "cluster") as cluster:
        yield cluster
