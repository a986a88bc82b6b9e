"""A body trickling in is cut at limits.body_deadline_s by both enforcers (issue 26 item 10): a
byte every 0.4 s never trips body_timeout_s: 1 (which bounds one read: nginx's
client_body_timeout), so without a deadline on the whole body a 100-byte body held the connection
40 s. With body_deadline_s: 2 each answers 408 and closes the connection at about 2 s, and the
ledger holds nothing for it. A few seconds per enforcer."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from enforcers import small_fake, small_rec, start_enforcer

from kvtune.gateway.config import ClientLimits

LIMITS = ClientLimits(max_body_bytes=256 * 1024, header_timeout_s=5, body_timeout_s=1, body_deadline_s=2)


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_a_trickling_body_is_cut_at_the_deadline(tmp_path, kind):
    with small_fake() as upstream:
        server = start_enforcer(kind, small_rec(upstream.port), tmp_path / "nginx", nginx_worker_processes="1",
                                limits=LIMITS, nginx_user="root" if os.geteuid() == 0 else None)
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n")
                started = time.monotonic()
                closed = threading.Event()

                def trickle() -> None:
                    for _ in range(100):
                        if closed.is_set():
                            return
                        try:
                            sock.sendall(b" ")
                        except OSError:
                            return
                        time.sleep(0.4)

                sender = threading.Thread(target=trickle, daemon=True)
                sender.start()
                answer, answered_s = b"", None
                try:
                    while chunk := sock.recv(65536):
                        answer += chunk
                        answered_s = answered_s or time.monotonic() - started
                except (ConnectionResetError, TimeoutError):
                    pass
                elapsed = time.monotonic() - started
                closed.set()
                sender.join(5)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert answered_s is not None and 1.5 <= answered_s < 4, f"answered at {answered_s} s (deadline 2 s)"
            assert elapsed < 4, f"the connection was held {elapsed:.1f} s (deadline 2 s)"
            assert server.wait_ledger(0)["reserved"] == 0
        finally:
            server.stop()
