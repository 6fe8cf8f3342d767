"""Start the trainer's ranks with torchrun, listening on one address only (never on every interface).

    python -m primebuild.runtime.trainer.launch --nnodes N --node-rank R --master-addr HOST \
        --master-port PORT --bind ADDR -- --nproc-per-node K -m primebuild.runtime.trainer.main --config C

torchrun's own stores bind every interface: `--standalone` opens two TCPStore servers on `*` (the c10d
rendezvous store and the store the ranks share), and a TCPStore server cannot be told an address to
bind. So this process binds the rendezvous socket itself (loopback on one host, the node's own address
across hosts), hands it to a multi-tenant TCPStore server, and then runs torchrun in this process with
the static rendezvous on that port: torchrun's TCPStore(port, multi_tenant=True) finds the server
already running there and reuses it, and the ranks reach it as clients (TORCHELASTIC_USE_AGENT_STORE).
GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) name the interface that holds the bind address, so the
ranks' own collective sockets listen there too.

`--master-port 0` (one node) picks a free port on the bind address: nothing to configure, nothing to clash.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import socket
import struct
import sys
import time

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
BIND_PATIENCE_SECONDS = 30.0


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 `address` (`lo` for 127.0.0.1), or None."""
    wanted = socket.inet_aton(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if answer[20:24] == wanted:
                return name
    if address.startswith("127."):  # 127.0.0.0/8 is loopback even when only 127.0.0.1 is configured
        return "lo"
    return None


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="primebuild.runtime.trainer.launch")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True, help="how the other nodes reach node rank 0")
    parser.add_argument("--master-port", type=int, required=True, help="0: a free port (one node only)")
    parser.add_argument("--bind", required=True, help="this node's own address: every socket listens there")
    if "--" not in argv:
        parser.error("give the torchrun arguments after --")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    if args.master_port == 0 and args.nnodes > 1:
        parser.error("--master-port 0 works on one node only: the other nodes must know the port")
    return args, argv[split + 1:]


def _bind(address: str, port: int, patience_s: float = BIND_PATIENCE_SECONDS) -> socket.socket:
    """The rendezvous listener. A port still held by the ending run before (its store closes a few seconds
    after its last step) is waited for, with a message, rather than failing this run at once."""
    deadline, told = time.monotonic() + patience_s, False
    while True:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError as err:
            listener.close()
            if err.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            if not told:
                print(f"rendezvous port {address}:{port} is in use; waiting up to {patience_s:.0f} s for it",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(2)
            continue
        listener.listen(1024)
        return listener


def main(argv: list[str]) -> None:
    args, rest = parse(argv)
    interface = interface_of(args.bind)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    port = args.master_port
    store = None
    if args.node_rank == 0:
        import torch.distributed as dist

        listener = _bind(args.bind, port)
        port = listener.getsockname()[1]
        # Kept alive for the whole run: torchrun's stores on this port are this very server.
        store = dist.TCPStore(args.bind, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    from torch.distributed.run import main as torchrun

    master = args.bind if args.nnodes == 1 else args.master_addr
    torchrun(["--rdzv-backend", "static", "--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
              "--master-addr", master, "--master-port", str(port), *rest])
    del store


if __name__ == "__main__":
    from primebuild.runtime.stacks import dump_on_signal

    dump_on_signal()  # a hung run asks for this process's stacks
    main(sys.argv[1:])
