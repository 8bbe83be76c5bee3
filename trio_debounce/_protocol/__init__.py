"""The cross-process debounce protocol over a revisioned key-value store.

:class:`KvDebounceBackend` implements :class:`~trio_debounce.abc.DebounceBackend` on any
:class:`~trio_debounce._kv.KvStore`; the rules are in :doc:`/protocol`. The names below
are the ones the library and the tests import from here.
"""

from ._backend import _AFTER_KEEP as _AFTER_KEEP
from ._backend import SWEEPER_KEY as SWEEPER_KEY
from ._backend import KvDebounceBackend as KvDebounceBackend
from ._backend import RunMarker as RunMarker
from ._backend import WindowDoc as WindowDoc
from ._backend import WindowFull as WindowFull
from ._backend import _decode_lease as _decode_lease
from ._backend import _encode_lease as _encode_lease
from ._backend import _FireRecord as _FireRecord
from ._backend import _Lease as _Lease
from ._backend import _Ping as _Ping
