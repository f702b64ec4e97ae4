"""msdata's node server: one asyncio (uvloop) process per node hosting source loaders, data constructors
and (on the leader) the planner. It never imports torch."""

__version__ = "0.1.0"
