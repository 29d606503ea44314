"""A small etcd v3 client over etcd's gRPC gateway (HTTP + JSON), standard library only.

etcd serves its v3 API as JSON on the client port (``POST /v3/kv/range``,
``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/lease/keepalive``, ``/v3/lease/revoke``; keys
and values base64, 64-bit integers as decimal strings: etcd's
``Documentation/dev-guide/api_grpc_gateway.md``). That is all leader election needs, and
it avoids the ``etcd3`` Python package (unmaintained, broken by protobuf >= 4) and
grpcio (a large binary dependency). One call is one short HTTP/1.1 request; a lease
keepalive is one POST whose single streamed answer is read to its first line.

Endpoints are tried in order; the first that answers serves the call. Raises
:class:`EtcdError` when none does.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

from kvpool.errors import ErrorCode, KVPoolError


class EtcdError(KVPoolError):
    """No etcd endpoint answered, or one answered with an error."""

    code = ErrorCode.ETCD_OPERATION_ERROR


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def endpoints_of(spec: str) -> list[str]:
    """``"h1:2379,http://h2:2379"`` -> ``["http://h1:2379", "http://h2:2379"]``.
    Raises EtcdError on an empty list."""
    urls = [u.strip().rstrip("/") for u in spec.split(",") if u.strip()]
    if not urls:
        raise EtcdError(f"no etcd endpoint in {spec!r}")
    return [u if "://" in u else f"http://{u}" for u in urls]


class Etcd:
    """Calls on the etcd cluster at ``endpoints`` (see :func:`endpoints_of`);
    ``timeout_s`` bounds each HTTP request (seconds). Thread-safe (no shared state but
    the endpoint order)."""

    def __init__(self, endpoints: str | list[str], timeout_s: float = 2.0):
        self.endpoints = endpoints_of(endpoints) if isinstance(endpoints, str) else list(endpoints)
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        errors = []
        for i, url in enumerate(list(self.endpoints)):
            req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    line = resp.readline()  # a streamed answer (keepalive): its first message
            except urllib.error.HTTPError as exc:
                raise EtcdError(f"etcd {url}{path}: HTTP {exc.code} {exc.read()[:200]!r}") from None
            except (OSError, ValueError) as exc:
                errors.append(f"{url}: {exc}")
                continue
            if i:  # answer from this one first next time
                self.endpoints.insert(0, self.endpoints.pop(i))
            reply = json.loads(line or b"{}")
            if "error" in reply:
                raise EtcdError(f"etcd {url}{path}: {reply['error']}")
            return reply.get("result", reply)
        raise EtcdError(f"no etcd endpoint answered {path}: {'; '.join(errors)}")

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease of ``ttl_s`` seconds; returns (lease id, the TTL etcd granted,
        which may be longer: etcd's minimum)."""
        reply = self._post("/v3/lease/grant", {"TTL": ttl_s})
        return int(reply["ID"]), int(reply["TTL"])

    def keepalive(self, lease_id: int) -> int:
        """Renew ``lease_id``; returns its TTL in seconds from now, 0 when the lease is
        gone (expired or revoked)."""
        reply = self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(reply.get("TTL", 0))

    def revoke(self, lease_id: int) -> None:
        """End ``lease_id`` now: the keys attached to it are deleted."""
        self._post("/v3/lease/revoke", {"ID": str(lease_id)})

    def create(self, key: str, value: str, lease_id: int) -> bool:
        """Put ``key = value`` attached to ``lease_id`` only if ``key`` does not exist
        (one transaction: compare create_revision == 0). True when it was created."""
        k = _b64(key)
        reply = self._post("/v3/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease_id)}}],
        })
        return bool(reply.get("succeeded"))

    def get(self, key: str) -> str | None:
        """The value of ``key``, or None when it does not exist."""
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None
