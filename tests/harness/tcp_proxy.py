"""A small TCP proxy (Trio) that slows, stalls and cuts connections on loopback.

There are no root network tools here (no ``tc``, no ``iptables``), so faults on the
wire between a NATS client and a server are made by putting this proxy between them:
the client connects to :attr:`TcpProxy.port`, and every connection is forwarded to the
target port. While the proxy runs, a test can

* add latency to replies (:attr:`TcpProxy.reply_delay`, seconds; every chunk the
  server sends reaches the client that much later, in order) or to requests
  (:attr:`TcpProxy.request_delay`);
* stall every connection (:meth:`TcpProxy.stall`): bytes are held, both ways, until
  :meth:`TcpProxy.resume`; connections stay open, so the client sees a server that
  does not answer;
* cut every connection at once (:meth:`TcpProxy.cut`) with a TCP reset, or arm a cut
  mid-write (:meth:`TcpProxy.cut_mid_write`): the next chunk the client sends is
  forwarded only in part (the server gets a truncated protocol line or payload) and
  then both sides are reset;
* refuse new connections (:attr:`TcpProxy.refuse`), so a cut client cannot come back
  until the test allows it.

Use :func:`open_tcp_proxy` in a Trio test (the proxy's tasks run in its nursery), or
run ``python -m tests.harness.tcp_proxy TARGET_PORT`` to serve from a process of its own: it
prints its port, then reads commands from stdin, one a line (``reply-delay 0.5``,
``request-delay 0``, ``stall``, ``resume``, ``cut``, ``cut-mid-write``, ``refuse``,
``accept``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import socket
import struct
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

#: Bytes read from a socket at once.
CHUNK = 65536


def _reset(stream: trio.SocketStream) -> None:
    """Make the next close of ``stream`` send a TCP reset (``SO_LINGER`` 0)."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _Pipe:
    """One proxied connection: two directions, each with its own delay queue."""

    def __init__(self, proxy: TcpProxy, client: trio.SocketStream, server: trio.SocketStream):
        self.proxy = proxy
        self.client = client
        self.server = server
        self.scope = trio.CancelScope()

    async def run(self) -> None:
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    for source, sink, upstream in (
                        (self.client, self.server, True),
                        (self.server, self.client, False),
                    ):
                        send, receive = trio.open_memory_channel[tuple[float, bytes, bool]](
                            math.inf
                        )
                        nursery.start_soon(self._read, source, send, upstream)
                        nursery.start_soon(self._write, receive, sink)
        finally:
            # Also when the proxy itself is cancelled: no socket is left to the GC.
            for stream in (self.client, self.server):
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    def cut(self) -> None:
        """Reset both sides at once."""
        _reset(self.client)
        _reset(self.server)
        self.scope.cancel()

    async def _read(
        self,
        source: trio.SocketStream,
        send: trio.MemorySendChannel[tuple[float, bytes, bool]],
        upstream: bool,
    ) -> None:
        async with send:
            while True:
                try:
                    data = await source.receive_some(CHUNK)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.scope.cancel()
                    return
                delay = self.proxy.request_delay if upstream else self.proxy.reply_delay
                if upstream and self.proxy._cut_armed:
                    # Forward a part of the chunk only, then reset both sides.
                    self.proxy._cut_armed = False
                    self.proxy.cuts_mid_write += 1
                    await send.send(
                        (trio.current_time() + delay, data[: max(1, len(data) // 2)], True)
                    )
                    return
                await send.send((trio.current_time() + delay, data, False))

    async def _write(
        self,
        receive: trio.MemoryReceiveChannel[tuple[float, bytes, bool]],
        sink: trio.SocketStream,
    ) -> None:
        async with receive:
            async for due, data, cut_after in receive:
                await trio.sleep_until(due)
                await self.proxy._running.wait()
                try:
                    await sink.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.scope.cancel()
                    return
                if cut_after:
                    self.cut()
                    return


class TcpProxy:
    """A TCP proxy from :attr:`port` (127.0.0.1) to a target port; see the module.

    Made by :func:`open_tcp_proxy`. The knobs are plain attributes and methods, so a
    test changes them between awaits.

    Attributes:
      target_port (int): where connections are forwarded (127.0.0.1).
      port (int): the port clients connect to.
      reply_delay (float): seconds added to every server-to-client chunk.
      request_delay (float): seconds added to every client-to-server chunk.
      refuse (bool): close new connections at once (reset) instead of forwarding them.
      accepted (int): connections accepted so far.
      cuts (int): connections reset by :meth:`cut`.
      cuts_mid_write (int): connections reset by an armed mid-write cut.
    """

    def __init__(self, target_port: int, port: int) -> None:
        self.target_port = target_port
        self.port = port
        self.reply_delay = 0.0
        self.request_delay = 0.0
        self.refuse = False
        self.accepted = 0
        self.cuts = 0
        self.cuts_mid_write = 0
        self._pipes: set[_Pipe] = set()
        self._running = trio.Event()
        self._running.set()
        self._cut_armed = False

    def __repr__(self) -> str:
        return f"<TcpProxy :{self.port} -> :{self.target_port}, {len(self._pipes)} open>"

    @property
    def open_connections(self) -> int:
        """Connections being forwarded right now."""
        return len(self._pipes)

    @property
    def stalled(self) -> bool:
        """Whether forwarding is held by :meth:`stall`."""
        return not self._running.is_set()

    def stall(self) -> None:
        """Hold every byte, both ways, until :meth:`resume` (connections stay open)."""
        if self._running.is_set():
            self._running = trio.Event()

    def resume(self) -> None:
        """Forward again what :meth:`stall` held, in order."""
        self._running.set()

    def cut(self) -> int:
        """Reset every open connection now; return how many were cut."""
        pipes = list(self._pipes)
        for pipe in pipes:
            pipe.cut()
        self.cuts += len(pipes)
        return len(pipes)

    def cut_mid_write(self) -> None:
        """Arm a cut: the next chunk a client sends reaches the server only in part,
        then that connection is reset on both sides."""
        self._cut_armed = True

    async def _handle(self, client: trio.SocketStream) -> None:
        if self.refuse:
            _reset(client)
            await client.aclose()
            return
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            _reset(client)
            await client.aclose()
            return
        self.accepted += 1
        pipe = _Pipe(self, client, server)
        self._pipes.add(pipe)
        try:
            await pipe.run()
        finally:
            self._pipes.discard(pipe)


@asynccontextmanager
async def open_tcp_proxy(target_port: int, *, port: int = 0) -> AsyncIterator[TcpProxy]:
    """Run a :class:`TcpProxy` to ``127.0.0.1:target_port`` for the ``async with``.

    Args:
      target_port (int): the server's port.
      port (int): the port to listen on (0: a free one; see :attr:`TcpProxy.port`).

    On exit every connection is closed and the listener stops.
    """
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        bound: int = listeners[0].socket.getsockname()[1]
        proxy = TcpProxy(target_port, bound)
        nursery.start_soon(trio.serve_listeners, proxy._handle, listeners)
        try:
            yield proxy
        finally:
            nursery.cancel_scope.cancel()


async def _serve(target_port: int) -> None:
    """Serve until stdin ends, taking the commands of the module docstring."""
    async with open_tcp_proxy(target_port) as proxy:
        sys.stdout.write(f"{proxy.port}\n")
        sys.stdout.flush()
        stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
        buffer = b""
        while True:
            chunk = await stdin.receive_some(4096)
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                command, _, argument = line.decode().strip().partition(" ")
                if command == "reply-delay":
                    proxy.reply_delay = float(argument)
                elif command == "request-delay":
                    proxy.request_delay = float(argument)
                elif command == "stall":
                    proxy.stall()
                elif command == "resume":
                    proxy.resume()
                elif command == "cut":
                    proxy.cut()
                elif command == "cut-mid-write":
                    proxy.cut_mid_write()
                elif command == "refuse":
                    proxy.refuse = True
                elif command == "accept":
                    proxy.refuse = False
                elif command:
                    sys.stderr.write(f"unknown command {command!r}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target_port", type=int, help="the server's port on 127.0.0.1")
    trio.run(_serve, parser.parse_args().target_port)
