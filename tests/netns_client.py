"""A kvpool client driven over stdin/stdout (JSON lines), for tests that run it in
another network namespace: ``python netns_client.py MASTER``.

Requests: {"op": "put", "key", "size", "replicas", "segment"} -> {"replicas": n};
{"op": "get", "key"} -> {"match": bool} (the bytes are those of :func:`value_of`);
{"op": "where", "key"} -> {"segments": [names]}. Any failure: {"error": "Name: text"}.
"""

from __future__ import annotations

import hashlib
import json
import sys

from kvpool.client import Client


def value_of(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def handle(c: Client, req: dict) -> dict:
    key = req["key"]
    if req["op"] == "put":
        return {"replicas": c.put(key, value_of(key, req["size"]), req.get("replicas", 1),
                                  preferred_segment=req.get("segment", ""))}
    if req["op"] == "get":
        value = c.get(key)
        return {"match": value == value_of(key, len(value)) and len(value) == req["size"]}
    h = c.query(key)
    c.release([h])
    return {"segments": [r.segment.name for r in h.replicas]}


def main() -> None:
    with Client(sys.argv[1], timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 5.0) as c:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            try:
                reply = handle(c, json.loads(line))
            except Exception as exc:  # reported to the test, which decides
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
