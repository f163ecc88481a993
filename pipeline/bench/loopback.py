"""The wire's own limit, measured in the same run as the store: raw TCP over loopback.

A child process listens on 127.0.0.1; the parent moves ``messages`` messages of
``message_bytes`` each, request/response like a store call: *send* (the parent
``sendall``s a message, the child ``recv_into``s a buffer it reuses and acks one byte),
*recv* (the parent asks with one byte, the child ``sendall``s, the parent ``recv_into``s
a reused buffer). No serialization, no allocation per message: the ceiling a store call of
the same bytes could reach between two processes here. Figures in bytes/s; beside each
rate, the CPU seconds both processes spent per byte moved (``*_cpu_s_per_byte``: the
parent's thread and the child, which reports its own process time when asked).
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import struct
import time

import numpy as np

ACK = b"k"
_CPU = struct.Struct("<d")  # the child's process time (s), answered to a b"c" request


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("loopback peer closed early")
        got += n


def _serve(port_q, message_bytes: int) -> None:
    """Child: answer ``send``/``recv`` requests until the parent closes the connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(message_bytes))
    payload = memoryview(np.ones(message_bytes, np.uint8))
    op = memoryview(bytearray(1))
    while True:
        if conn.recv_into(op, 1) == 0:
            break
        if op[0] == ord("s"):  # the parent sends one message: take it, ack
            _recv_exactly(conn, buf)
            conn.sendall(ACK)
        elif op[0] == ord("c"):  # the parent asks for this process's CPU time so far
            conn.sendall(_CPU.pack(time.process_time()))
        else:  # the parent asks for one message
            conn.sendall(payload)
    conn.close()
    srv.close()


def measure(message_bytes: int, messages: int) -> dict[str, float]:
    """Bytes/s of ``messages`` sends and of as many receives of ``message_bytes`` each
    (one warm-up of each first, untimed): ``send_bytes_per_s``, ``recv_bytes_per_s``, and
    the CPU seconds per byte of each, both processes together: ``send_cpu_s_per_byte``,
    ``recv_cpu_s_per_byte``."""
    message_bytes = max(1, int(message_bytes))
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    child = ctx.Process(target=_serve, args=(port_q, message_bytes), daemon=True)
    child.start()
    try:
        conn = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
        data = memoryview(np.ones(message_bytes, np.uint8))
        buf = memoryview(bytearray(message_bytes))
        ack = memoryview(bytearray(1))

        def send_one() -> None:
            conn.sendall(b"s")
            conn.sendall(data)
            _recv_exactly(conn, ack)

        def recv_one() -> None:
            conn.sendall(b"r")
            _recv_exactly(conn, buf)

        cpu_answer = memoryview(bytearray(_CPU.size))

        def child_cpu_s() -> float:
            conn.sendall(b"c")
            _recv_exactly(conn, cpu_answer)
            return _CPU.unpack(cpu_answer)[0]

        out = {}
        total = message_bytes * messages
        for name, one in (("send", send_one), ("recv", recv_one)):
            one()
            child0, c0, t0 = child_cpu_s(), time.thread_time(), time.perf_counter()
            for _ in range(messages):
                one()
            wall, mine = time.perf_counter() - t0, time.thread_time() - c0
            out[f"{name}_bytes_per_s"] = total / wall
            out[f"{name}_cpu_s_per_byte"] = (mine + child_cpu_s() - child0) / total
        conn.close()
        return out
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
