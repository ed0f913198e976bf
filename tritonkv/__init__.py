"""tritonkv: pack and unpack paged KV caches and hidden states by query offsets, bit-exactly.

Public API::

    from tritonkv import pack_kv, unpack_kv, pack_hidden, unpack_hidden, layouts
    from tritonkv import kv_digest, digest  # integrity digests (pack_kv(..., digest=True))
    from tritonkv import umac  # keyed payload hash and tags (payload authentication)
    from tritonkv import prepare_kv, KVCacheSet  # layers prepared once (host cost per call)
    from tritonkv import pack_state, unpack_state, clip_to_window  # state slots, windows

See :mod:`tritonkv.layouts` for the view convention every op uses.
"""

from . import digest, layouts, umac
from ._dispatch import use_triton
from ._version import __version__
from .hidden import pack_hidden, pack_hidden_torch, unpack_hidden, unpack_hidden_torch
from .kv import (
    KVCacheSet,
    kv_digest,
    kv_digest_torch,
    nh_in_copy,
    pack_kv,
    pack_kv_torch,
    prepare_kv,
    unpack_kv,
    unpack_kv_torch,
)
from .state import (
    pack_state,
    pack_state_torch,
    state_row_bytes,
    unpack_state,
    unpack_state_torch,
)
from .window import clip_to_window

__all__ = [
    "KVCacheSet",
    "__version__",
    "clip_to_window",
    "digest",
    "kv_digest",
    "kv_digest_torch",
    "layouts",
    "nh_in_copy",
    "pack_hidden",
    "pack_hidden_torch",
    "pack_kv",
    "pack_kv_torch",
    "pack_state",
    "pack_state_torch",
    "prepare_kv",
    "state_row_bytes",
    "umac",
    "unpack_hidden",
    "unpack_hidden_torch",
    "unpack_kv",
    "unpack_kv_torch",
    "unpack_state",
    "unpack_state_torch",
    "use_triton",
]
