"""A real Prometheus and a small exporter of Kueue's pending-workload gauge, for integration tests.

The exporter serves ``kueue_pending_workloads`` with the values a test sets (plus a few broken
"Prometheus" APIs); ``Prometheus`` runs Debian's /usr/bin/prometheus scraping it every 500 ms.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import yaml
from aiohttp import web

from extproc.localstack import Process, Stack, free_port, wait_http

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
QUEUE = "inference-interactive"
PENDING = f'sum(kueue_pending_workloads{{cluster_queue="{QUEUE}",status="active"}})'


class Exporter:
    """Serves kueue_pending_workloads in a thread of its own, plus a few broken "Prometheus" APIs."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {QUEUE: 0.0}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="exporter", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _metrics(self, _: web.Request) -> web.Response:
        lines = ["# HELP kueue_pending_workloads Pending workloads.", "# TYPE kueue_pending_workloads gauge"]
        for queue, value in sorted(self.pending.items()):
            lines.append(f'kueue_pending_workloads{{cluster_queue="{queue}",status="active"}} {value}')
            lines.append(f'kueue_pending_workloads{{cluster_queue="{queue}",status="inadmissible"}} 100')
        return web.Response(text="\n".join(lines) + "\n")

    @staticmethod
    async def _slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    @staticmethod
    async def _error(_: web.Request) -> web.Response:
        return web.Response(status=500, text="internal error")

    @staticmethod
    async def _garbage(_: web.Request) -> web.Response:
        return web.Response(text="<html>this is not Prometheus</html>")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/slow/api/v1/query", self._slow)
        app.router.add_get("/error/api/v1/query", self._error)
        app.router.add_get("/garbage/api/v1/query", self._garbage)
        # handler_cancellation: the hub giving up on /slow cancels its handler, leaving nothing pending.
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Prometheus:
    """A real Prometheus scraping the exporter every 500 ms, on a free loopback port."""

    def __init__(self, workdir: Path, exporter: Exporter) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.stack = Stack(workdir)
        config = {
            "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
            "scrape_configs": [{"job_name": "kueue",
                                "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process: Process | None = None

    def start(self) -> None:
        self.process = self.stack.start("prometheus", [
            PROMETHEUS, f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ])
        try:
            wait_http(f"{self.url}/-/ready", timeout=30, proc=self.process.popen)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"prometheus did not start: {exc}\n{self.process.output()[-3000:]}") from None

    def stop(self) -> None:
        self.stack.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
