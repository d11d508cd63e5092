"""The API a user would write in front of peer_tasks: FastAPI on uvicorn, one route that queues the body on
Celery and waits for the answer (the same sync wait as gradsvc's POST /gradients?wait=)."""

from __future__ import annotations

import anyio.to_thread
from fastapi import FastAPI, Request, Response

from peer_tasks import gradients

app = FastAPI()


@app.get("/healthz")
async def healthz() -> dict:
    return {"ok": True}


@app.post("/gradients")
async def post_gradients(request: Request, wait: float = 30.0) -> Response:
    body = await request.body()
    binary = request.headers.get("content-type", "") == "application/msgpack"
    answer = await anyio.to_thread.run_sync(lambda: gradients.delay(body, binary).get(timeout=wait))
    return Response(answer, media_type="application/msgpack" if binary else "application/json")
