"""A packet delayer for one NFQUEUE, standard library only (this kernel has no netem qdisc).

    nfq_delayer.py QUEUE DELAY_MS

Run inside the host whose packets it holds, after an nftables rule sends them to ``QUEUE`` with
``bypass`` (``netns_hosts.Cluster.delay``): it binds the queue over netlink, asks for packet ids
only (no payload copy), and gives each packet its ACCEPT verdict ``DELAY_MS`` after it arrived, in
arrival order. If it dies the queue is unbound and ``bypass`` lets traffic through undelayed.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NF_ACCEPT = 1
NLM_F_REQUEST = 1


def _attr(kind: int, data: bytes) -> bytes:
    return struct.pack("HH", 4 + len(data), kind) + data + b"\0" * (-len(data) % 4)


class Queue:
    def __init__(self, number: int) -> None:
        self.number = number
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self._send(
            NFQNL_MSG_CONFIG, _attr(NFQA_CFG_CMD, struct.pack("BBH", NFQNL_CFG_CMD_BIND, 0, 0))
        )
        params = struct.pack(">IB", 0, NFQNL_COPY_META) + b"\0" * 3
        self._send(NFQNL_MSG_CONFIG, _attr(NFQA_CFG_PARAMS, params))

    def _send(self, msg: int, payload: bytes) -> None:
        # nlmsghdr, then nfgenmsg (family, version, res_id = the queue number, big endian)
        body = struct.pack("BBH", socket.AF_UNSPEC, 0, socket.htons(self.number)) + payload
        header = struct.pack(
            "IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, NLM_F_REQUEST, 0, 0
        )
        self.sock.send(header + body)

    def accept(self, packet_id: int) -> None:
        self._send(
            NFQNL_MSG_VERDICT, _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))
        )

    def packet_ids(self) -> list[int]:
        """The ids of the packets in one netlink read."""
        buf, off, ids = self.sock.recv(1 << 16), 0, []
        while off + 16 <= len(buf):
            length, kind = struct.unpack_from("IH", buf, off)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                a = off + 20  # past nlmsghdr (16) and nfgenmsg (4)
                while a + 4 <= off + length:
                    alen, atype = struct.unpack_from("HH", buf, a)
                    if alen < 4:
                        break
                    if atype & 0x7FFF == NFQA_PACKET_HDR:
                        ids.append(struct.unpack_from(">I", buf, a + 4)[0])
                        break
                    a += (alen + 3) & ~3
            off += (length + 3) & ~3
        return ids


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    queue, delay_s = Queue(int(argv[0])), float(argv[1]) / 1000.0
    held: collections.deque[tuple[float, int]] = collections.deque()  # FIFO: one fixed delay
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            queue.accept(held.popleft()[1])
        wait = max(0.0, held[0][0] - now) if held else 1.0
        if select.select([queue.sock], [], [], wait)[0]:
            arrived = time.monotonic()
            held.extend((arrived + delay_s, pid) for pid in queue.packet_ids())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
