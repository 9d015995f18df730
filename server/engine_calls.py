"""What the server asks of its engine beside requests, run on the engine thread (everything
engine-side runs there) and awaited from the event loop: the prefix-cache flush, and sleep
mode and weight updates (vLLM's development-mode routes: dev_routes.py).

EngineCalls is AsyncLLMEngine's part: a call crosses to the engine thread through the
engine's inbox, in order with the requests and aborts before it, and its result (or what it
raised) comes back to the awaiting coroutine. The engine thread is busy for as long as a
call runs: a weight update from a folder holds the steps until it is read.
"""

from __future__ import annotations

import asyncio

from jaxserve.engine.failures import EngineDeadError
from jaxserve.engine.sleep_mode import SLEEPING
from jaxserve.server.errors import APIError


class EngineAsleepError(APIError, EngineDeadError):
    """A request for a sleeping engine: HTTP 503 (code engine_sleeping) with Retry-After, and
    an EngineDeadError for the callers that answer those as "unavailable" (gRPC's
    UNAVAILABLE). Only requests' callers get it, never the engine thread, whose loop stops on
    an EngineDeadError of its own."""

    def __init__(self) -> None:
        super().__init__(503, f"{SLEEPING[:1].upper()}{SLEEPING[1:]} (POST /wake_up).",
                         code="engine_sleeping", headers={"Retry-After": "1"})


class EngineCalls:
    """Calls on the engine thread (AsyncLLMEngine's part; see the module's docstring)."""

    # Whether the engine sleeps, as of the last sleep / wake_up call (they all come here):
    # read by submit_many on the event loop, so that a sleeping engine refuses at once.
    sleeping = False

    async def call(self, fn, *args):
        """fn(*args) on the engine thread, after what is queued before it; its result, or
        what it raised. EngineDeadError when the engine loop has stopped."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine loop has stopped")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", (fn, args, done)))
        self._notify()
        while not done.done():  # bounded by the loop's life: a dead loop never answers
            await asyncio.wait([done], timeout=0.1)
            if not done.done() and not self.is_running:
                raise EngineDeadError(self.dead_reason or "the engine loop has stopped")
        return done.result()

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks); returns once
        done."""
        await self.call(self.engine.reset_prefix_cache)

    async def sleep(self, level: int = 1) -> None:
        """The engine to sleep (engine/sleep_mode.py: ValueError without enable_sleep_mode,
        RequestsUnfinishedError while requests run); new requests get EngineAsleepError
        until wake_up."""
        self.sleeping = await self.call(_then_sleeping, self.engine, "sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping = await self.call(_then_sleeping, self.engine, "wake_up", tags)

    async def is_sleeping(self) -> bool:
        self.sleeping = await self.call(self.engine.is_sleeping)
        return self.sleeping

    async def update_weights(self, weights) -> int:
        """engine.update_weights on the engine thread: how many parameters changed."""
        return await self.call(self.engine.update_weights, weights)

    def check_awake(self) -> None:
        if self.sleeping:
            raise EngineAsleepError()


def _then_sleeping(engine, method: str, *args) -> bool:
    """engine.method(*args), then whether the engine sleeps (engine thread)."""
    getattr(engine, method)(*args)
    return engine.is_sleeping()


def run_call(payload) -> None:
    """Engine thread: run a call's function and hand its outcome to the awaiting future."""
    fn, args, future = payload
    try:
        result, error = fn(*args), None
    except Exception as err:  # noqa: BLE001 - the caller's to raise
        result, error = None, err
    resolve(future, result, error)


def resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Complete a future of the event loop from the engine thread (if that loop still
    runs)."""
    def done() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(done)
    except RuntimeError:  # the loop has closed: nobody waits
        pass
