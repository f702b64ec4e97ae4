"""Source loaders: one per (source, partition), each holding its source's file-access state once per node and a
bounded read-ahead of transformed samples by ordinal.

``loader.py`` is the loader (``SourceLoader``); ``readbuffer.py`` its bounded read-ahead, ``readcounts.py`` its
counters, ``sampleread.py`` the read-and-transform of one batch of ordinals, ``ordinals.py`` a partition's
ordinals.
"""

from .loader import LoaderStats, SourceLoader

__all__ = ["LoaderStats", "SourceLoader"]
