"""Run a coroutine on asyncio or uvloop and fail on exceptions nobody retrieved (shared by async tests)."""

import asyncio

LOOPS = ["asyncio", "uvloop"]


def run(coro, loop: str = "asyncio"):
    """Run on asyncio or uvloop; fail on exceptions that nobody retrieved."""
    errors = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        return await coro

    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            out = r.run(main())
    else:
        out = asyncio.run(main())
    assert not errors, f"unretrieved exceptions in the event loop: {errors}"
    return out
