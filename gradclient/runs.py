"""Training runs from the SDK (docs/runs.md): `run = client.run("exp-1")`, then `run.gradients(...)` with
client.gradients' arguments once a step; the run numbers the steps and the service records each. Run and
AsyncRun drive the same flows, as Client and AsyncClient do."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from gradsvc import wire

from .base import Flow
from .request import RUN_OPTION
from .result import GradientResult


class BaseRun:
    """A run's name and the number its next step gets (`step`, from `start`; a step that raised keeps its
    number for the next call, since the service recorded nothing of it)."""

    def __init__(self, client: Any, name: str, start: int = 0) -> None:
        self.client = client
        self.name = name
        self.step = start

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, step={self.step})"

    @property
    def _path(self) -> str:
        return f"/runs/{quote(self.name, safe='')}"

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {**options, RUN_OPTION: {"name": self.name, "step": self.step}}

    def _info(self) -> Flow[wire.RunInfo]:
        return (yield from self.client._getting(self._path, wire.RunInfo))

    def _csv(self) -> Flow[str]:
        _, buf = yield from self.client._sending("GET", self._path, params={"format": "csv"})
        return bytes(buf).decode()

    def _delete(self) -> Flow[None]:
        yield from self.client._sending("DELETE", self._path)


class Run(BaseRun):
    """client.run(name): gradients() records each call as the run's next step; steps(), csv(), delete()."""

    def gradients(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy",
                  **kwargs: Any) -> GradientResult:
        """client.gradients(...), recorded as step `self.step` of the run; the step number then goes up by one."""
        result = self.client.gradients(model, inputs, targets, loss, **self._options(kwargs))
        self.step += 1
        return result

    def steps(self) -> list[wire.RunStep]:
        """GET /runs/{name}: every recorded step (what the service keeps: GRADSVC_RUN_MAX_STEPS)."""
        return self.client._drive(self._info()).steps

    def csv(self) -> str:
        """GET /runs/{name}?format=csv: one row a step, modules as columns."""
        return self.client._drive(self._csv())

    def delete(self) -> None:
        self.client._drive(self._delete())


class AsyncRun(BaseRun):
    """Run's methods as coroutines (AsyncClient.run)."""

    async def gradients(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy",
                        **kwargs: Any) -> GradientResult:
        result = await self.client.gradients(model, inputs, targets, loss, **self._options(kwargs))
        self.step += 1
        return result

    async def steps(self) -> list[wire.RunStep]:
        return (await self.client._drive(self._info())).steps

    async def csv(self) -> str:
        return await self.client._drive(self._csv())

    async def delete(self) -> None:
        await self.client._drive(self._delete())
