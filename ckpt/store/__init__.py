"""Object stores: the storage interface, its backends and wrappers."""

from ckpt.store.base import Capabilities, ObjectInfo, Store, check_name
from ckpt.store.local import LocalStore
from ckpt.store.memory import MemoryStore
from ckpt.store.retry import RetryStore

__all__ = ["Capabilities", "LocalStore", "MemoryStore", "ObjectInfo", "RetryStore", "Store", "check_name"]
