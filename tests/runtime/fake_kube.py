"""A stand-in Kubernetes API server for Leases (coordination.k8s.io/v1): create, read,
merge-patch, delete, and list with an equality label selector, with resourceVersions
and the API's status codes (404 missing, 409 exists). No Kubernetes API server can run
here; the real client library talks to this one over HTTP."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_PATH = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/?]+))?$")


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


class FakeKubeApi:
    """Leases by (namespace, name); `calls` counts requests by method."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.down = False  # answer 503 to everything (an API server outage)
        self._rv = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length") or 0)
                return dict(json.loads(self.rfile.read(n) or b"{}"))

            def _route(self) -> None:
                path, _, query = self.path.partition("?")
                m = _PATH.match(path)
                with fake._lock:
                    fake.calls[self.command] = fake.calls.get(self.command, 0) + 1
                    fake.requests.append((self.command, self.path))
                    if fake.down:
                        return self._send(503, _status(503, "ServiceUnavailable"))
                    if m is None:
                        return self._send(404, _status(404, "NotFound"))
                    ns, name = m.group(1), m.group(2)
                    body = self._body() if self.command in ("POST", "PATCH") else {}
                    code, doc = fake.handle(self.command, ns, name, query, body)
                self._send(code, doc)

            do_GET = do_POST = do_PATCH = do_DELETE = _route

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def handle(
        self, method: str, ns: str, name: str | None, query: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        if name is None and method == "GET":
            params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
            want = _selector(params.get("labelSelector", ""))
            items = [lease for (n, _), lease in sorted(self.leases.items()) if n == ns
                     if want.items() <= lease["metadata"].get("labels", {}).items()]  # fmt: skip
            meta = {"resourceVersion": str(self._rv)}
            return 200, {"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                         "metadata": meta, "items": items}  # fmt: skip
        if name is None and method == "POST":
            name = body["metadata"]["name"]
            if (ns, name) in self.leases:
                return 409, _status(409, "AlreadyExists")
            self._rv += 1
            body["metadata"].update(namespace=ns, resourceVersion=str(self._rv))
            self.leases[ns, name] = body
            return 201, body
        lease = self.leases.get((ns, name or ""))
        if lease is None:
            return 404, _status(404, "NotFound")
        if method == "GET":
            return 200, lease
        if method == "PATCH":
            _merge(lease, body)
            self._rv += 1
            lease["metadata"]["resourceVersion"] = str(self._rv)
            return 200, lease
        if method == "DELETE":
            del self.leases[ns, name or ""]
            self._rv += 1
            return 200, _status(200, "Success")
        return 405, _status(405, "MethodNotAllowed")

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server, as `KUBECONFIG` takes."""
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "not-checked"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }  # fmt: skip
        path.write_text(json.dumps(doc))
        return path

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _selector(text: str) -> dict[str, str]:
    from urllib.parse import unquote

    pairs = [p.split("=", 1) for p in unquote(text).split(",") if "=" in p]
    return {k: v for k, v in pairs}


def _status(code: int, reason: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure" if code >= 400 else
            "Success", "reason": reason, "code": code}  # fmt: skip
