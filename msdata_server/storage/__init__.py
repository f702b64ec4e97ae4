"""Reading source files where they live: local disk or object storage (S3 and any scheme pyarrow's
filesystems accept), with retries, request counters and the node-wide settings of node.toml ``[storage]``."""

from .listing import ListedFile, local_file
from .metacache import MetaCache, SourceMeta
from .remotefile import RemoteFile
from .stats import STAT_KEYS, StorageStats
from .store import Store, configure, get_store
from .uri import check_uri, is_uri, local_path

__all__ = [
    "STAT_KEYS",
    "ListedFile",
    "MetaCache",
    "RemoteFile",
    "SourceMeta",
    "StorageStats",
    "Store",
    "check_uri",
    "configure",
    "get_store",
    "is_uri",
    "local_file",
    "local_path",
]
