"""Runs inside the sandbox, standard library only: opens the sandbox's only ways out, then runs a program.

The sandbox has no network (its own namespace, only a loopback device). A harness program still has to
reach the model's endpoint, so the host side (sandbox_runtime.py) listens on one unix socket per allowed
endpoint, in a folder bound into the sandbox; this script listens on the sandbox's loopback at the
endpoint's own port and pipes each connection to that socket. So the program uses its usual
http://127.0.0.1:PORT/v1 and reaches exactly the endpoints the host chose, and nothing else.

    python sandbox_bridge.py PORT=SOCKET ... -- PROGRAM ARG...

Exits with the program's exit code; the listeners die with it.
"""

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def forwarder(connect):
    """A connection handler that opens `connect()` and pipes both ways (here to a unix socket; the host side,
    sandbox_runtime.py, uses it from the socket to the endpoint's port)."""
    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            out_reader, out_writer = await connect()
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, out_writer), pipe(out_reader, writer))
    return forward


async def main(argv: list[str]) -> int:
    split = argv.index("--")
    routes, program = argv[:split], argv[split + 1:]
    for route in routes:
        port, socket_path = route.split("=", 1)
        await asyncio.start_server(forwarder(lambda path=socket_path: asyncio.open_unix_connection(path)),
                                   "127.0.0.1", int(port))
    proc = await asyncio.create_subprocess_exec(*program)
    return await proc.wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
