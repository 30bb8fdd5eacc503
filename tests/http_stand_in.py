"""An aiohttp app served from a daemon thread, for tests that talk HTTP to a stand-in server."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


def serve_in_thread(routes: list) -> int:
    """Serve `routes` (aiohttp RouteDefs) on 127.0.0.1 at a port the OS picks; returns it."""
    ready, port = threading.Event(), []

    def run() -> None:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        port.append(runner.addresses[0][1])
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(10), "the stand-in server did not start"
    return port[0]
