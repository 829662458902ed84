"""Waiting for work running on other threads, from plain code, asyncio or trio, never blocking a loop.

A trajectory's exit may wait briefly for its end-of-session notices. A plain ``with`` exiting on a
thread that runs an event loop must not wait at all (it would stall every other trajectory on that
loop); ``async with`` awaits with the primitives of whichever library runs it. trio is imported
only once it is known to be the library running.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable


class Countdown:
    """Counts jobs down to zero; ``wait`` and ``on_done`` see the last one finish."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def one_finished(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left > 0:
                return
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for callback in callbacks:
            callback()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)

    def on_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._left > 0:
                self._callbacks.append(callback)
                return
        callback()


def loop_running() -> bool:
    """Whether this thread runs an event loop (asyncio's, or trio's; anyio runs on one of them)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _trio_running()
    return True


async def wait_async(countdown: Countdown, timeout: float) -> None:
    """Await ``countdown`` for at most ``timeout`` seconds, in whichever library runs this coroutine."""
    if _trio_running():
        await _wait_trio(countdown, timeout)
    else:
        await _wait_asyncio(countdown, timeout)


def _trio_running() -> bool:
    """Whether this thread runs trio's loop; without trio imported it cannot, and nothing is imported."""
    if "trio" not in sys.modules:
        return False
    try:
        import sniffio
    except ImportError:  # trio depends on sniffio; should it be missing, trio goes unrecognised
        return False
    try:
        return bool(sniffio.current_async_library() == "trio")
    except sniffio.AsyncLibraryNotFoundError:
        return False


async def _wait_asyncio(countdown: Countdown, timeout: float) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # some other library's loop: the work goes on unawaited
    future: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be closed by then
            loop.call_soon_threadsafe(_resolve, future)

    countdown.on_done(wake)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(future), timeout)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _wait_trio(countdown: Countdown, timeout: float) -> None:
    """Await in trio, woken from the last job's thread through trio's token.

    The wait is shielded and ends at ``timeout`` or at the deadline of the scopes around it, whichever
    comes first, so it never raises ``Cancelled`` into the caller: a cancelled trajectory does not wait.
    """
    import trio

    finished = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def wake() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(finished.set)

    countdown.on_done(wake)
    deadline = min(trio.current_time() + timeout, trio.current_effective_deadline())
    with trio.CancelScope(deadline=deadline, shield=True):
        await finished.wait()
